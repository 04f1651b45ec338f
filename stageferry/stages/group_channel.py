"""Leader → followers messages of a stage group, over torch.distributed collectives (never pickle).

Every message starts with a *header*: a msgpack map broadcast as a length (int64) and a uint8 tensor.
Headers and CPU tensors travel over a gloo group; CUDA tensors over the default group (NCCL when the
ranks have GPUs).  Message kinds:

* ``job``  — the job, its media bytes, and the payload: the manifest in the header, then one broadcast
  per non-empty region, straight from the leader's buffers (its pool slot when the payload came over
  NIXL) into a fresh buffer on each follower, from which the follower unpacks the same tensors;
* ``fail`` — the leader could not get the payload: followers raise the same typed error;
* ``noop`` — keeps idle followers' collectives well inside their timeout;
* ``stop`` — the group is draining: followers return.

After a job every rank contributes to one all-reduce of a failure flag, so a model error on any rank
fails the request on the leader instead of leaving the group out of step.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from stageferry.broker.payload_codec import validate_manifest
from stageferry.schemas import DeviceKind, Manifest

MAX_HEADER_BYTES = 64 << 20


class MessageKind(enum.StrEnum):
    JOB = "job"
    FAIL = "fail"
    NOOP = "noop"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Message:
    """What a follower receives: the header fields, media bytes and payload region buffers."""

    kind: MessageKind
    header: dict[str, Any]
    media: dict[str, bytes]
    buffers: dict[DeviceKind, torch.Tensor]
    manifest: Manifest | None


class GroupChannel:
    """The collectives of one stage group, as seen from one rank."""

    def __init__(self, *, rank: int, world_size: int, device: torch.device, cpu_group: Any, device_group: Any):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cpu_group = cpu_group
        self.device_group = device_group

    @classmethod
    def solo(cls, device: torch.device) -> GroupChannel:
        """A group of one rank: every message and collective is a no-op."""
        return cls(rank=0, world_size=1, device=device, cpu_group=None, device_group=None)

    # ------------------------------------------------------------------ leader

    def send(
        self,
        kind: MessageKind,
        header: Mapping[str, Any] | None = None,
        *,
        media: Mapping[str, bytes] | None = None,
        manifest: Manifest | None = None,
        buffers: Mapping[DeviceKind, torch.Tensor] | None = None,
    ) -> None:
        """Broadcast one message from the leader (rank 0)."""
        if self.world_size == 1:
            return
        media = dict(media or {})
        body = dict(header or {})
        body["kind"] = kind.value
        body["media"] = {name: len(data) for name, data in media.items()}
        body["manifest"] = manifest.model_dump_json() if manifest is not None else None
        self._broadcast_bytes(msgpack.packb(body, use_bin_type=True))
        for name in sorted(media):  # sizes are in the header: no length broadcast
            self._broadcast_bytes(media[name], expect=len(media[name]))
        if manifest is not None:
            assert buffers is not None
            for region in manifest.regions:
                if region.nbytes:
                    self._broadcast_region(buffers[region.device][: region.nbytes], region.device)

    # ------------------------------------------------------------------ followers

    def receive(self) -> Message:
        """Block until the leader's next message (followers only)."""
        raw = self._broadcast_bytes(None)
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        kind = MessageKind(body.pop("kind"))
        sizes = body.pop("media") or {}
        media = {name: self._broadcast_bytes(None, expect=int(sizes[name])) for name in sorted(sizes)}
        manifest_json = body.pop("manifest")
        manifest = None
        buffers: dict[DeviceKind, torch.Tensor] = {}
        if manifest_json is not None:
            manifest = Manifest.model_validate_json(manifest_json)
            validate_manifest(manifest, max_payload_bytes=1 << 40)
            for region in manifest.regions:
                buffers[region.device] = self._receive_region(region.nbytes, region.device)
        return Message(kind=kind, header=body, media=media, buffers=buffers, manifest=manifest)

    # ------------------------------------------------------------------ every rank

    def any_failed(self, failed: bool) -> bool:
        """All-reduce a failure flag: True on every rank if any rank failed."""
        if self.world_size == 1:
            return failed
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(flag.item())

    def gather_counts(self, counts: list[int]) -> list[list[int]]:
        """Every rank's integer counters (e.g. connector puts/gets), on every rank."""
        if self.world_size == 1:
            return [list(counts)]
        mine = torch.tensor(counts, dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.cpu_group)
        return [t.tolist() for t in out]

    # ------------------------------------------------------------------ internals

    def _broadcast_bytes(self, data: bytes | None, *, expect: int | None = None) -> bytes:
        """Length, then bytes, from rank 0 over the gloo group; returns what rank 0 sent."""
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        if expect is None:
            dist.broadcast(length, src=0, group=self.cpu_group)
        else:
            length[0] = expect
        n = int(length.item())
        if not 0 <= n <= MAX_HEADER_BYTES and expect is None:
            raise ValueError(f"header of {n} bytes from the leader")
        if n == 0:
            return b""
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cpu_group)
        return data if data is not None else buf.numpy().tobytes()

    def _group_for(self, kind: DeviceKind) -> Any:
        return self.device_group if kind is DeviceKind.CUDA else self.cpu_group

    def _broadcast_region(self, buf: torch.Tensor, kind: DeviceKind) -> None:
        if kind is DeviceKind.CUDA and buf.device != self.device:
            buf = buf.to(self.device)
        dist.broadcast(buf.contiguous(), src=0, group=self._group_for(kind))

    def _receive_region(self, nbytes: int, kind: DeviceKind) -> torch.Tensor:
        device = self.device if kind is DeviceKind.CUDA else torch.device("cpu")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            dist.broadcast(buf, src=0, group=self._group_for(kind))
        return buf
