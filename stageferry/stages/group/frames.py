"""A stage group's frames: the fixed-size buffers every message of :mod:`.group_channel` starts with.

A frame is a *head* of :data:`FRAME_BYTES` (a little-endian u32 length, then the header: a msgpack map),
optionally followed by an inline payload region.  Frames are *kept* — one per recent size on each rank —
and broadcast into again, and a follower keeps the payload unpacked over a frame's inline region: on the
2 × H200 host every torch call costs 5–80 µs of host time, and allocating a frame, slicing views and
unpacking the payload per job were most of a job's cost over a bare NCCL broadcast
(``benchmarks/fanout_phases.py``).  A GPU rank moves a head between the frame and the host through
:class:`Staging`'s pinned buffer.  The next frame's size travels in each header; :func:`next_capacity`
picks it and :func:`checked_capacity` / :func:`checked_carrier` bound what a follower accepts.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stageferry.broker.data.payload_codec import unpack
from stageferry.schemas import DeviceKind, Manifest

#: Size of a frame's head (the header): big enough for a job and a T2VA manifest, small enough that
#: broadcasting it costs no more than the broadcast's fixed latency.  An inline region starts right after.
FRAME_BYTES = 16 << 10
HEAD_LEN = 4  #: the head's length prefix (bytes)
#: Unpacked inline payloads (and region views) a kept frame remembers, one per manifest.
PAYLOAD_CACHE_SIZE = 8
#: How a follower waits for a frame's header on a GPU (:meth:`Staging.wait`): spin this long, then poll
#: at this interval until this long, then block.
SPIN_S = 0.002
POLL_S = 0.0001
POLL_FOR_S = 1.0


class Frame:
    """A kept frame: its buffer, views of its head and of its inline regions (by size), and — on a
    follower — the payloads unpacked over it (by manifest), so a repeated shape makes no new views."""

    __slots__ = ("_offset", "_payloads", "_regions", "buf", "head", "host")

    def __init__(self, capacity: int, device: torch.device, head: int = FRAME_BYTES) -> None:
        """``head``: bytes before the inline region (0 for a *carrier*: a header that came by the
        group's mailbox, :mod:`.mailbox`, leaves the whole frame to the payload)."""
        self.buf = torch.empty(capacity, dtype=torch.uint8, device=device)
        self._offset = head
        self.head = self.buf[:head]
        #: A CPU frame's bytes as numpy (it is its own host copy); ``None`` on a GPU (see :class:`Staging`).
        self.host: np.ndarray | None = None if self.buf.is_cuda else self.buf.numpy()
        self._regions: dict[int, torch.Tensor] = {}
        self._payloads: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def region(self, nbytes: int) -> torch.Tensor:
        """The inline region of ``nbytes`` bytes, right after the head (if any)."""
        view = self._regions.get(nbytes)
        if view is None:
            if len(self._regions) >= PAYLOAD_CACHE_SIZE:
                self._regions.clear()
            view = self._regions[nbytes] = self.buf[self._offset : self._offset + nbytes]
        return view

    def payload(self, key: str, manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor]) -> Any:
        """The payload over this frame's inline region: unpacked (and checked) once per manifest, then
        handed out as new containers around new views (:func:`_fresh`)."""
        held = self._payloads.get(key)
        if held is None:
            held = self._payloads[key] = unpack(manifest, buffers, copy=False)
            if len(self._payloads) > PAYLOAD_CACHE_SIZE:
                self._payloads.popitem(last=False)
        return _fresh(held)


def _fresh(node: Any) -> Any:
    """New containers around new views (``detach``) of the same tensors: a model that edits its input
    in place — a dict entry, a tensor's shape — must not edit the next job's."""
    if isinstance(node, torch.Tensor):
        return node.detach()
    if isinstance(node, dict):
        return {key: _fresh(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_fresh(value) for value in node]
    if isinstance(node, tuple):
        return tuple(_fresh(value) for value in node)
    return node


class Staging:
    """A GPU rank's pinned host copy of a frame's head, and the event that guards it.

    The leader writes a header here and copies the whole head to the frame without blocking (one copy of
    two ready-made tensors; the next header waits for that copy first, long done by then); a follower
    copies a received head here and waits for it (:meth:`wait`)."""

    def __init__(self) -> None:
        self.pinned = torch.empty(FRAME_BYTES, dtype=torch.uint8, pin_memory=True)
        self.host: np.ndarray = self.pinned.numpy()
        self.done = torch.cuda.Event(blocking=True)
        self.pending = False

    def upload(self, prefix: bytes, head: bytes, dest: torch.Tensor) -> None:
        if self.pending and not self.done.query():
            self.done.synchronize()
        self.host[:HEAD_LEN] = memoryview(prefix)
        self.host[HEAD_LEN : HEAD_LEN + len(head)] = memoryview(head)
        dest.copy_(self.pinned, non_blocking=True)
        self.done.record()
        self.pending = True

    def download(self, head: torch.Tensor) -> np.ndarray:
        """The frame's head (``head``, a view kept with the frame), in pinned host memory."""
        self.pinned.copy_(head, non_blocking=True)
        self.done.record()
        self.wait()
        self.pending = False
        return self.host

    def wait(self) -> None:
        """Wait for the last recorded copy: spin for :data:`SPIN_S` (a job that follows another arrives
        within it), then poll every :data:`POLL_S` until :data:`POLL_FOR_S`, then block.

        Why not block at once: a blocking event wakes the thread through the driver's interrupt, later
        than a spinning one notices.  Why not spin for ever: an idle follower sits here between jobs, and
        a spinning wait would burn a CPU core the whole time."""
        done = self.done
        started = time.perf_counter()
        while not done.query():
            waited = time.perf_counter() - started
            if waited >= POLL_FOR_S:
                done.synchronize()
                return
            if waited >= SPIN_S:
                time.sleep(POLL_S)


def to_host(buf: torch.Tensor) -> bytes:
    """A received frame's bytes.  On a GPU, wait with a *blocking* event first: an idle follower sits
    here between jobs, and a plain stream synchronisation would spin a CPU core the whole time."""
    if buf.device.type == "cuda":
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()
    return buf.cpu().numpy().tobytes()


#: Frames grow in steps of this many bytes (a region's size rounded up), so near sizes share a frame.
INLINE_GRAIN = 4096


def next_capacity(capacity: int, inline: torch.Tensor | None, inline_max: int) -> int:
    """The next frame's size: room for this job's region (its shape will likely repeat), or the same."""
    if inline is None or not inline.numel():
        return capacity
    if inline.numel() > inline_max:
        return FRAME_BYTES
    return FRAME_BYTES + -(-inline.numel() // INLINE_GRAIN) * INLINE_GRAIN


def checked_capacity(value: Any, inline_max: int) -> int:
    """A next-frame size from the leader's header, within what a leader can announce."""
    return _announced(value, FRAME_BYTES, FRAME_BYTES + inline_max + INLINE_GRAIN, "frame")


def checked_carrier(value: Any, most: int) -> int:
    """A next-carrier size from the leader's header, within what a leader can announce."""
    return _announced(value, 1, most, "carrier")


def _announced(value: Any, least: int, most: int, what: str) -> int:
    size = int(value)
    if not least <= size <= most:
        raise ValueError(f"next {what} of {size} bytes from the leader")
    return size
