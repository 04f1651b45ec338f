"""Leader → followers messages of a stage group, over torch.distributed collectives (never pickle).

Every message starts with a *frame*, broadcast in one collective over the **device group** — NCCL
when the ranks have GPUs, the same gloo group as CPU tensors otherwise.  A frame is a *head* of
:data:`FRAME_BYTES` (a little-endian u32 length, then the header: a msgpack map), optionally followed
by the payload's region of the frame's own memory kind (CUDA on GPU ranks, CPU on CPU ranks) *inline*.
A header longer than the head sends its tail in a second broadcast on the same group.  Keeping headers
off gloo matters on GPUs: a gloo round trip per job (length, then bytes) cost ≈ 0.7 ms, twenty times the
NCCL broadcast of a T2VA payload.

**Inline payloads.**  Every header names the size of the *next* frame (``next``), so every rank knows
how many bytes the next broadcast carries before it arrives.  The leader sizes it for the last job's
region (up to :data:`INLINE_MAX_BYTES`): a stage's jobs repeat a few shapes, so from its second job of a
shape the payload rides the frame — one broadcast per job, and no host round trip on a follower between
reading the header and posting the region's broadcast.  The leader copies the region into the frame on
its device (a D2D copy: microseconds for a T2VA payload); followers get views of the frame they received.
Frames are kept and received into again (:mod:`.frames`), so a follower's inline payload holds until
its next message, as the leader's pool slot holds until the job is done.  A region that does not fit
the announced frame travels as before, in its own broadcast.  Media bytes and CPU regions of GPU ranks
travel over the gloo group.  Message kinds:

* ``job``  — the job, its media bytes, and the payload: the manifest in the header, the region inline
  or one broadcast per non-empty region, straight from the leader's buffers (its pool slot when the
  payload came over NIXL) into the kept frame (inline) or a fresh buffer on each follower, over which
  the channel unpacks the same tensors (``Message.payload``);
* ``fail`` — the leader could not get the payload: followers raise the same typed error;
* ``noop`` — keeps idle followers' collectives well inside their timeout;
* ``stop`` — the group is draining: followers return.

**Headers by mailbox.**  All ranks of a group normally share a host, and then a header goes through
host shared memory (:mod:`.mailbox`) instead of a frame: the leader writes it there, then broadcasts the
message's *carrier* — the announced number of bytes, straight from its payload buffer (its pool slot) when
the region fits exactly, else copied into a kept carrier (a smaller region) or a kept dummy carrier (no
region, or a larger one, which then gets its own broadcast).  A follower posts the carrier's broadcast into
a kept buffer on entering :meth:`GroupChannel.receive`, before it reads the header — so the broadcast
never waits for it — and reads the header from the mailbox while the bytes move.  No header upload, no
download, no copy of a repeated shape's region on the leader.  :meth:`GroupChannel.link` sets this up on
the first message (a collective over the gloo group); where a follower cannot map the leader's mailbox
(another host, no ``/dev/shm``), or with ``STAGEFERRY_GROUP_MAILBOX=0``, the whole group keeps frames.  A
header too long for a mailbox slot says so in its slot and follows the carrier over the device group.

After a job every rank contributes to one all-reduce of a failure flag, so a model error on any rank
fails the request on the leader instead of leaving the group out of step.

**Routes.** A 1-D group broadcasts each piece once, over the whole group.  A grid (TP × SP, HSDP shard ×
replicate; :mod:`stageferry.stages.group.grid`) gives every rank a *route*: the broadcasts it takes part in,
in order — the leader's row first, then each row member down its column.  Every piece of every message
follows the same route, so each rank receives each message exactly once, from exactly one sender, and
relays it on (from the buffer it just received into) when it is a row member.  Each rank counts the
messages it sent or received (:meth:`GroupChannel.receipts`), so tests can check that.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from stageferry.broker.data.payload_codec import unpack, validate_manifest
from stageferry.schemas import DeviceKind, Manifest
from stageferry.stages.group.frames import (
    FRAME_BYTES,
    HEAD_LEN,
    Frame,
    Staging,
    checked_capacity,
    checked_carrier,
    next_capacity,
    to_host,
)
from stageferry.stages.group.group_messages import Hop, Message, MessageKind, ModelGroups
from stageferry.stages.group.mailbox import LONG, Mailbox, handshake

__all__ = ["FRAME_BYTES", "GroupChannel", "Hop", "Message", "MessageKind", "ModelGroups"]

MAX_HEADER_BYTES = 64 << 20
#: The largest region that rides a frame; larger ones get their own broadcast.  Measured on 2 × H200: inline
#: 11 MB and 65 MB regions were 0.1–0.3 ms *slower* (the leader's D2D copy, and a follower that reads the
#: header only once the whole frame landed instead of while the region's broadcast runs).
INLINE_MAX_BYTES = 2 << 20
MANIFEST_CACHE_SIZE = 64
#: Frames a rank keeps, one per recent frame size (at most ``FRAME_BYTES + INLINE_MAX_BYTES`` each).
FRAME_CACHE_SIZE = 4
#: The largest carrier (mailbox mode) by the ranks' memory kind.  On GPUs a region of the announced size
#: rides the carrier with no copy and no header in front of it, so the 11 MB task size rides too; but a
#: carrier is sent whole whatever follows — a noop, or a smaller job after a large one — so it stays small
#: enough (≈ 0.06 ms of NVLink) that a mix of shapes cannot cost more than it saves; 65 MB regions keep
#: their own broadcast.  Over gloo a dummy carrier costs real time: CPU ranks keep the frames' limit.
CARRIER_MAX_BYTES = {"cuda": 16 << 20, "cpu": INLINE_MAX_BYTES}
#: The carrier of a group's first message, and of messages after a payload too large to ride one.
CARRIER_MIN_BYTES = 64


class GroupChannel:
    """The collectives of one stage group, as seen from one rank.

    ``cpu_group``/``device_group`` span the whole group (failure flags, counters); messages travel along
    ``route`` (by default one broadcast from rank 0 over the whole group)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        cpu_group: Any,
        device_group: Any,
        route: Sequence[Hop] | None = None,
        model_groups: ModelGroups | None = None,
        mailbox: bool | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cpu_group = cpu_group
        self.device_group = device_group
        self.route = tuple(route) if route is not None else (Hop(0, cpu_group, device_group),)
        self.model_groups = model_groups or ModelGroups(process_group=device_group, groups={"world": device_group})
        self._counts: collections.Counter[str] = collections.Counter()
        self._manifests: collections.OrderedDict[str, Manifest] = collections.OrderedDict()
        self._capacity = FRAME_BYTES  # bytes of the next frame, as the last header said (every rank)
        self._staging: Staging | None = None  # pinned head buffer of a GPU rank, made on first use
        self._frames: collections.OrderedDict[int, Frame] = collections.OrderedDict()  # by size
        self._frame_dev = device if device.type == "cuda" else torch.device("cpu")
        self._own = DeviceKind.CUDA if device.type == "cuda" else DeviceKind.CPU
        self._sent_manifest: tuple[Manifest | None, str | None] = (None, None)
        if mailbox is None:
            mailbox = os.environ.get("STAGEFERRY_GROUP_MAILBOX", "1") != "0"
        self._linked = not mailbox  # frames only: nothing to set up
        self._mailbox: Mailbox | None = None
        self._carrier_max = CARRIER_MAX_BYTES[self._frame_dev.type]
        self._posted: Any = None  # a GPU follower's event after its carrier's broadcast

    @classmethod
    def solo(cls, device: torch.device) -> GroupChannel:
        """A group of one rank: every message and collective is a no-op."""
        return cls(rank=0, world_size=1, device=device, cpu_group=None, device_group=None)

    def receipts(self) -> list[int]:
        """``[jobs, fails, payload bytes]`` this rank sent (the leader) or received (a follower)."""
        return [self._counts[MessageKind.JOB.value], self._counts[MessageKind.FAIL.value], self._counts["bytes"]]

    def collectives(self) -> dict[str, int]:
        """Broadcasts this rank took part in for messages, by group (``cpu``: gloo; ``device``: the
        payload's group), so tests can check that a header costs no gloo call where the groups differ."""
        return {"cpu": self._counts["calls:cpu"], "device": self._counts["calls:device"]}

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
        """Broadcast one message from the leader (rank 0).

        Every step here runs before the payload's broadcast, so it is kept to few Python and torch calls:
        on the 2 × H200 host each costs 5-80 µs, and they added up to ≈ 0.2 ms before the first byte moved
        (``benchmarks/fanout_phases.py``)."""
        if self.world_size == 1:
            return
        regions: dict[DeviceKind, torch.Tensor] = {}
        if manifest is not None:
            assert buffers is not None
            for region in manifest.regions:
                buf = buffers[region.device]
                if buf.numel() < region.nbytes:  # NCCL would wait forever for the missing bytes
                    raise ValueError(f"{region.device} buffer of {buf.numel()} bytes, region of {region.nbytes}")
                regions[region.device] = buf if buf.numel() == region.nbytes else buf[: region.nbytes]
        if not self._linked:
            self.link()
        if self._mailbox is not None:
            self._send_by_mailbox(kind, header, media, manifest, regions, buffers)
            return
        inline = regions.get(self._own)
        capacity = self._capacity
        body = dict(header) if header else {}
        body["kind"] = kind.value
        body["media"] = {name: len(data) for name, data in media.items()} if media else {}
        body["manifest"] = self._manifest_json(manifest)
        body["inline"] = inline is not None and 0 < inline.numel() <= capacity - FRAME_BYTES
        body["next"] = next_capacity(capacity, inline, INLINE_MAX_BYTES)
        packed = msgpack.packb(body, use_bin_type=True)
        if body["inline"] and HEAD_LEN + len(packed) > FRAME_BYTES:  # a long header: its tail follows the frame
            body["inline"] = False
            packed = msgpack.packb(body, use_bin_type=True)
        self._send_frame(packed, inline if body["inline"] else None)
        self._capacity = body["next"]
        self._send_rest(media, regions, body["inline"])
        self._count(kind, manifest)  # after the broadcasts: bookkeeping never delays the first byte

    def _send_by_mailbox(
        self,
        kind: MessageKind,
        header: Mapping[str, Any] | None,
        media: Mapping[str, bytes] | None,
        manifest: Manifest | None,
        regions: dict[DeviceKind, torch.Tensor],
        buffers: Mapping[DeviceKind, torch.Tensor] | None,
    ) -> None:
        """The header into the mailbox, then the carrier the last header announced (see the module
        docstring): the region itself when it fills the carrier, so the leader copies nothing."""
        assert self._mailbox is not None
        capacity = self._capacity
        own = regions.get(self._own)
        n = own.numel() if own is not None else 0
        inline = 0 < n <= capacity
        carrier: torch.Tensor | None = None
        if inline:
            assert own is not None and buffers is not None
            whole = buffers[self._own]
            if whole.numel() >= capacity and whole.device == self._frame_dev:  # bytes past the region: ignored
                carrier = whole if whole.numel() == capacity else whole[:capacity]
        body = dict(header) if header else {}
        body["kind"] = kind.value
        body["media"] = {name: len(data) for name, data in media.items()} if media else {}
        body["manifest"] = self._manifest_json(manifest)
        body["inline"] = inline
        body["next"] = capacity if not n else (n if n <= self._carrier_max else CARRIER_MIN_BYTES)
        packed = msgpack.packb(body, use_bin_type=True)
        if len(packed) > MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(packed)} bytes")
        long = len(packed) > self._mailbox.capacity
        if carrier is None:  # a dummy carrier, or a shorter region copied into a kept one
            frame = self._frame(head=0)
            if inline:
                assert own is not None
                frame.region(n).copy_(own if own.device == frame.buf.device else own.to(frame.buf.device))
            carrier = frame.buf
        if long:
            self._mailbox.post(b"", flags=LONG, length=len(packed))
        else:
            self._mailbox.post(packed)
        self._propagate_frame(carrier)
        self._capacity = body["next"]
        if long:
            self._propagate_frame(torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(self._frame_dev))
        self._send_rest(media, regions, inline)
        self._count(kind, manifest)

    def _send_rest(
        self, media: Mapping[str, bytes] | None, regions: dict[DeviceKind, torch.Tensor], inline: bool
    ) -> None:
        """Media (sizes are in the header: no length broadcast), then every region that did not ride."""
        for name in sorted(media or ()):
            assert media is not None
            self._broadcast_bytes(media[name], expect=len(media[name]))
        for device_kind, buf in regions.items():
            if buf.numel() and not (inline and device_kind is self._own):
                self._broadcast_region(buf, device_kind)

    # ------------------------------------------------------------------ followers

    def receive(self) -> Message:
        """Block until the leader's next message (followers only).  Its inline buffers and payload hold
        until the next call (see :class:`Message`)."""
        if not self._linked:
            self.link()
        frame, raw = self._receive_frame() if self._mailbox is None else self._receive_by_mailbox()
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        kind = MessageKind(body.pop("kind"))
        inline = bool(body.pop("inline", False))
        if self._mailbox is None:
            self._capacity = checked_capacity(body.pop("next", FRAME_BYTES), INLINE_MAX_BYTES)
        else:
            self._capacity = checked_carrier(body.pop("next", CARRIER_MIN_BYTES), self._carrier_max)
        offset = FRAME_BYTES if self._mailbox is None else 0
        sizes = body.pop("media") or {}
        media = {name: self._broadcast_bytes(None, expect=int(sizes[name])) for name in sorted(sizes)}
        manifest_json = body.pop("manifest")
        if manifest_json is None:
            self._count(kind, None)
            return Message(kind=kind, header=body, media=media, buffers={}, manifest=None)
        manifest = self._manifest(manifest_json)
        buffers: dict[DeviceKind, torch.Tensor] = {}
        for region in manifest.regions:
            if inline and region.device is self._own:
                if offset + region.nbytes > frame.buf.numel():
                    raise ValueError(f"inline region of {region.nbytes} bytes in a {frame.buf.numel()}-byte frame")
                buffers[region.device] = frame.region(region.nbytes)
            else:
                buffers[region.device] = self._receive_region(region.nbytes, region.device)
        self._count(kind, manifest)
        if inline and len(buffers) == 1:  # every byte is in the kept frame: its views can be kept too
            payload = frame.payload(manifest_json, manifest, buffers)
        else:
            payload = unpack(manifest, buffers, copy=False)
        return Message(kind=kind, header=body, media=media, buffers=buffers, manifest=manifest, payload=payload)

    # ------------------------------------------------------------------ every rank

    def link(self) -> bool:
        """Set up the header mailbox with every rank of the group — a collective over the gloo group, run
        by the first :meth:`send` / :meth:`receive` — and say whether the group uses it.

        The leader creates it and broadcasts its name and a random token; each follower maps it and checks
        the token (a follower on another host finds no such file); one all-reduce agrees, so either every
        rank uses it or none does.  The leader then unlinks the name: from here on nothing is left in
        ``/dev/shm`` whatever happens to the processes.  Not counted in :meth:`collectives` (setup, once)."""
        self._linked = True
        if self.world_size > 1:
            self._mailbox = handshake(self.rank, self.world_size, self.cpu_group)
            if self._mailbox is not None:
                self._capacity = CARRIER_MIN_BYTES
        return self._mailbox is not None

    @property
    def uses_mailbox(self) -> bool:
        """Whether this group's headers go by its mailbox (after :meth:`link`)."""
        return self._mailbox is not None

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

    def _manifest(self, manifest_json: str) -> Manifest:
        """The leader's manifest, parsed and checked once per payload shape: a stage's jobs repeat a few
        shapes, and parsing plus checking a T2VA manifest took longer than NCCL's broadcast of its bytes."""
        manifest = self._manifests.get(manifest_json)
        if manifest is None:
            manifest = Manifest.model_validate_json(manifest_json)
            validate_manifest(manifest, max_payload_bytes=1 << 40)
            self._manifests[manifest_json] = manifest
            if len(self._manifests) > MANIFEST_CACHE_SIZE:
                self._manifests.popitem(last=False)
        else:
            self._manifests.move_to_end(manifest_json)
        return manifest

    def _manifest_json(self, manifest: Manifest | None) -> str | None:
        """The manifest as JSON, re-serialised only when it differs from the last one sent."""
        if manifest is None:
            return None
        last, text = self._sent_manifest
        if manifest is not last and manifest != last:
            text = manifest.model_dump_json()
            self._sent_manifest = (manifest, text)
        return text

    def _count(self, kind: MessageKind, manifest: Manifest | None) -> None:
        self._counts[kind.value] += 1
        if manifest is not None:
            self._counts["bytes"] += manifest.total_bytes

    def _propagate(self, buf: torch.Tensor, kind: DeviceKind = DeviceKind.CPU) -> None:
        """Move ``buf`` along this rank's route: after it, ``buf`` holds what the leader sent."""
        on_device = kind is DeviceKind.CUDA
        for hop in self.route:
            dist.broadcast(buf, src=hop.src, group=hop.device_group if on_device else hop.cpu_group)
        self._counts["calls:device" if on_device else "calls:cpu"] += len(self.route)

    def _propagate_frame(self, buf: torch.Tensor) -> None:
        """Frames ride the device group (NCCL on GPUs; on CPU ranks the device group is gloo)."""
        for hop in self.route:
            dist.broadcast(buf, src=hop.src, group=hop.device_group)
        self._counts["calls:device"] += len(self.route)

    def _stage(self) -> Staging:
        if self._staging is None:
            self._staging = Staging()
        return self._staging

    def _frame(self, head: int = FRAME_BYTES) -> Frame:
        """The kept frame of the announced size: frames are received into again, not allocated per job.

        Reuse is safe on every rank: on GPUs each step — the header's copy, the region's, the broadcast,
        the model's kernels on a follower's views — is ordered on the stream (a synchronous collective
        waits for the current stream and makes it wait in turn); gloo broadcasts return when done."""
        frame = self._frames.get(self._capacity)
        if frame is None:
            frame = self._frames[self._capacity] = Frame(self._capacity, self._frame_dev, head)
            if len(self._frames) > FRAME_CACHE_SIZE:
                self._frames.popitem(last=False)
        else:
            self._frames.move_to_end(self._capacity)
        return frame

    def _send_frame(self, body: bytes, inline: torch.Tensor | None) -> None:
        """One frame of ``self._capacity`` bytes (length + the body's head, then ``inline``), then the
        body's tail when it does not fit the head.  Nothing here waits for the device."""
        if len(body) > MAX_HEADER_BYTES:
            raise ValueError(f"header of {len(body)} bytes")
        head = body[: FRAME_BYTES - HEAD_LEN]
        frame = self._frame()
        prefix = len(body).to_bytes(HEAD_LEN, "little")
        if frame.host is None:
            self._stage().upload(prefix, head, frame.head)
        else:
            frame.host[:HEAD_LEN] = memoryview(prefix)
            frame.host[HEAD_LEN : HEAD_LEN + len(head)] = memoryview(head)
        if inline is not None:
            if inline.device != frame.buf.device:
                inline = inline.to(frame.buf.device)
            frame.region(inline.numel()).copy_(inline)
        self._propagate_frame(frame.buf)
        if len(body) > len(head):
            tail = bytearray(body[len(head) :])
            self._propagate_frame(torch.frombuffer(tail, dtype=torch.uint8).to(self._frame_dev))

    def _receive_frame(self) -> tuple[Frame, bytes]:
        """The leader's frame (kept: inline regions are views of it) and its header body."""
        frame = self._frame()
        self._propagate_frame(frame.buf)
        host = self._stage().download(frame.head) if frame.host is None else frame.host
        n = int.from_bytes(host[:HEAD_LEN].tobytes(), "little")
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"header of {n} bytes from the leader")
        head = host[HEAD_LEN : HEAD_LEN + min(n, FRAME_BYTES - HEAD_LEN)].tobytes()
        if n <= len(head):
            return frame, head
        tail = torch.empty(n - len(head), dtype=torch.uint8, device=self._frame_dev)
        self._propagate_frame(tail)
        return frame, head + to_host(tail)

    def _receive_by_mailbox(self) -> tuple[Frame, bytes]:
        """The carrier (kept: inline regions are views of it) and the header from the mailbox.  The
        carrier's broadcast is posted *before* the header is read, so it never waits for this rank."""
        assert self._mailbox is not None
        frame = self._frame(head=0)
        self._propagate_frame(frame.buf)
        data, flags, length = self._mailbox.take(self._block_on_carrier if frame.buf.is_cuda else None)
        if not flags & LONG:
            return frame, data
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"header of {length} bytes from the leader")
        tail = torch.empty(length, dtype=torch.uint8, device=self._frame_dev)
        self._propagate_frame(tail)
        return frame, to_host(tail)

    def _block_on_carrier(self) -> None:
        """An idle GPU follower sleeps until the carrier has landed (the leader wrote the header before
        sending it), on a blocking event rather than a spinning poll."""
        if self._posted is None:
            self._posted = torch.cuda.Event(blocking=True)
        self._posted.record()
        self._posted.synchronize()

    def _broadcast_bytes(self, data: bytes | None, *, expect: int) -> bytes:
        """``expect`` bytes (their size is in the header) from rank 0 over the gloo group."""
        n = expect
        if n == 0:
            return b""
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        self._propagate(buf)
        return data if data is not None else buf.numpy().tobytes()

    def _broadcast_region(self, buf: torch.Tensor, kind: DeviceKind) -> None:
        if kind is DeviceKind.CUDA and buf.device != self.device:
            buf = buf.to(self.device)
        self._propagate(buf.contiguous(), kind)

    def _receive_region(self, nbytes: int, kind: DeviceKind) -> torch.Tensor:
        device = self.device if kind is DeviceKind.CUDA else torch.device("cpu")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if nbytes:
            self._propagate(buf, kind)
        return buf
