"""The same-GPU fast path: a payload whose producer is on our own GPU is copied device to device.

On one GPU a NIXL READ (UCX's cuda_ipc under it) was measured at 7–9× a ``torch`` copy on that GPU
(106 GB/s against ~770 GB/s on the H200, issue 39).  This path skips the transport for such payloads:

* producer side, at start-up (:func:`export_arena`): the CUDA pool's arena is exported once with torch's
  own CUDA IPC export and published in the agent record (``gpu_uuid`` and ``cuda_ipc``:
  :class:`~stageferry.schemas.cuda_ipc.CudaIpcArena`);
* consumer side, when the producer's agent is loaded (:func:`open_arena`, from
  :mod:`~stageferry.broker.data.nixl.peers`): only if the record's ``gpu_uuid`` is the UUID of our own GPU,
  the arena is mapped once (CUDA IPC) and kept with the peer;
* per payload (:class:`SameGpu`, called by the consumer): each non-empty region that is VRAM on both
  sides and lies inside the mapped arena is copied on a stream of ours (made when the first arena was mapped)
  into our pool slot, after the same checks as a READ (manifest, arenas, seal, freshness); the rest of
  the payload (a pipeline's small host-memory ``layout``) is READ over NIXL meanwhile, and the producer
  is released once both are done, as after a READ.  :class:`ArenaCopy` is what
  :meth:`~stageferry.broker.data.nixl.reads.Reader.read` waits for beside its READs (its ``beside``).
  The copy is queued with the CUDA runtime's own calls (:mod:`~stageferry.broker.data.nixl.cuda_runtime`:
  ``cudaMemcpyAsync`` and an event, 0.06 ms of host time in a connector's process where torch's stream,
  views, ``copy_`` and event took 0.15–0.19 ms); where torch's runtime is not a shared library the arena
  is not mapped (a :class:`HandshakeError` below) and the peer is READ.

Selected only when both sides are on one GPU UUID; any failure falls back to the NIXL READ: a record
whose handle does not parse or cannot be opened (another container's ``/dev/shm``, no CUDA) is a
:class:`HandshakeError`, logged once (``nixl.same_gpu_unavailable``), and the peer is read over NIXL; a
copy that fails is a :class:`TransferError`, logged (``nixl.same_gpu_fallback``), and the READ follows.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
import torch

from stageferry.broker.data.nixl.cuda_runtime import CudaRuntime, EventPool, RuntimeCopy
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.pool import Slot
from stageferry.errors import HandshakeError, TransferError
from stageferry.schemas import DeviceKind, MemKind, NixlPayload
from stageferry.schemas.cuda_ipc import GPU_UUID, CudaIpcArena

log = structlog.get_logger(__name__)

#: How the copy is waited for: polled without yielding this long, then yielding, then sleeping POLL_S.
#: A 65 MB copy takes about 0.05 ms of GPU time on an H200, so the hold covers every hop's copy; a yield
#: to a loop with the connector's tasks on it costs more than the copy (issue 39).
HOLD_S, SPIN_S, POLL_S = 0.0005, 0.002, 0.001
#: The size of :meth:`SameGpu.prime`'s copy, between the two halves of a scratch buffer of ours a device.
PRIME_BYTES = 4096


def gpu_uuid(device: torch.device | None) -> str | None:
    """``GPU-<uuid>`` of ``device`` (what ``nvidia-smi -L`` prints), or None without a GPU."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    except (RuntimeError, AttributeError, AssertionError):  # an old driver, or no UUID to read
        return None
    if not re.fullmatch(GPU_UUID, uuid):  # what the record accepts; anything else: no same-GPU path
        log.warning("nixl.gpu_uuid_unreadable", device=str(device))
        return None
    return uuid


def export_arena(buffer: torch.Tensor, uuid: str) -> CudaIpcArena:
    """Export a CUDA pool's arena for consumers on the same GPU (torch's CUDA IPC export, once).
    Raises ``RuntimeError`` where CUDA IPC is not possible (e.g. expandable segments)."""
    storage = buffer.untyped_storage()
    _device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
    return CudaIpcArena(
        gpu_uuid=uuid,
        address=buffer.data_ptr(),
        length=buffer.numel() * buffer.element_size(),
        tensor_offset=buffer.data_ptr() - storage.data_ptr(),
        handle=bytes(handle).hex(),
        storage_size=int(size),
        storage_offset=int(offset),
        ref_counter_handle=bytes(ref_handle).hex(),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b"").hex(),
        event_sync_required=bool(event_sync),
    )


@dataclass(eq=False, slots=True)
class IpcArena:
    """A producer's CUDA pool arena mapped into this process; regions are addressed as the producer's."""

    spec: CudaIpcArena
    view: torch.Tensor
    """The arena's bytes (uint8, on our GPU)."""
    base: int = field(init=False)
    """Our device address of the arena's first byte."""
    stream: int = 0
    """The stream its copies are queued on: ours, one per device (a copy never queues behind the model's
    kernels)."""
    events: EventPool | None = None
    """Events for those copies' completion (the stream's)."""
    scratch: int = 0
    """Our device address of ``2 * PRIME_BYTES`` bytes of ours on that device (:meth:`SameGpu.prime`), 0
    for none."""
    device: int = 0
    """The index of that device."""

    def __post_init__(self) -> None:
        self.base = self.view.data_ptr()

    def offset(self, address: int, length: int) -> int | None:
        """Where the producer's region ``[address, address + length)`` starts in the arena, None if it is
        not wholly inside it."""
        start = address - self.spec.address
        if start < 0 or length < 0 or start + length > self.spec.length:
            return None
        return start

    def region(self, address: int, length: int) -> torch.Tensor | None:
        """The bytes of the producer's region ``[address, address + length)``, None if outside the arena."""
        start = self.offset(address, length)
        return None if start is None else self.view[start : start + length]


def open_arena(spec: CudaIpcArena, device: torch.device | None) -> IpcArena:
    """Map a producer's exported arena on ``device`` (ours, of the same GPU UUID; None: the current one);
    once per peer.  :class:`HandshakeError` when CUDA cannot open it (no CUDA here, another ``/dev/shm``)."""
    try:
        torch.cuda._lazy_init()
        index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        storage: Any = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            index,
            bytes.fromhex(spec.handle),
            spec.storage_size,
            spec.storage_offset,
            bytes.fromhex(spec.ref_counter_handle),
            spec.ref_counter_offset,
            bytes.fromhex(spec.event_handle),
            spec.event_sync_required,
        )
        if spec.tensor_offset + spec.length > storage.nbytes():
            raise HandshakeError("cuda_ipc arena lies outside its exported storage", length=spec.length)
        if CudaRuntime.loaded() is None:  # the copy is queued with its calls (cuda_runtime)
            raise HandshakeError("torch's CUDA runtime is not a shared library here: no same-GPU copy")
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
        view = torch._utils._rebuild_tensor(typed, spec.tensor_offset, (spec.length,), (1,))  # type: ignore[attr-defined]
        # the copy's stream and first event, made when the first peer is loaded: not on its first payload
        runtime = CudaRuntime.loaded()
        assert runtime is not None
        stream, events, scratch = _copy_stream(runtime, index)
    except HandshakeError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/TypeError/AssertionError here
        raise HandshakeError(f"cannot open the producer's CUDA IPC arena: {type(exc).__name__}: {exc}") from exc
    return IpcArena(spec, view, stream, events, scratch.data_ptr(), index)


_streams: dict[int, tuple[int, EventPool, torch.Tensor]] = {}
_streams_lock = threading.Lock()


def _copy_stream(runtime: CudaRuntime, index: int) -> tuple[int, EventPool, torch.Tensor]:
    """The stream the same-GPU copies on device ``index`` are queued on, their events and the scratch bytes
    :meth:`SameGpu.prime` copies: made once per process and device (a peer loaded again maps its arena
    again, not another stream).  ``RuntimeError`` from the runtime."""
    with _streams_lock:
        if index not in _streams:
            runtime.set_device(index)
            events = EventPool(runtime)
            stream = runtime.stream()
            events.put(runtime.event())
            scratch = torch.zeros(2 * PRIME_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
            _streams[index] = (stream, events, scratch)
        return _streams[index]


def warm_copy(arena: IpcArena, slot: Slot, nbytes: int, timeout: float) -> bool:
    """Copy the arena's first ``nbytes`` into ``slot`` and wait up to ``timeout`` (blocking, a few µs): the
    first copy through a newly mapped arena, done when the peer is loaded
    (:mod:`~stageferry.broker.data.nixl.peers`), so a payload's copy is not the first.  True once it ended;
    False when that cannot be known (not ended in time, or the runtime failed once it was queued): then
    ``slot`` may still be written and must not be reused.  ``RuntimeError`` if it could not be queued."""
    runtime = CudaRuntime.loaded()
    if runtime is None or arena.events is None:
        return True
    runtime.set_device(slot.device_id)
    event = arena.events.take()
    try:
        runtime.copy(slot.view.data_ptr(), arena.base, min(nbytes, arena.spec.length, slot.nbytes), arena.stream)
    except RuntimeError:
        arena.events.put(event)
        raise
    try:
        runtime.record(event, arena.stream)
        done, deadline = RuntimeCopy(event, arena.events), time.monotonic() + timeout
        while not done.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0001)
    except RuntimeError:
        return False
    return True


@dataclass(eq=False, slots=True)
class ArenaCopy:
    """One payload's queued copy: the regions it moves (their index in the manifest) and its completion;
    the ``beside`` of :meth:`~stageferry.broker.data.nixl.reads.Reader.read`, which READs the rest."""

    owner: SameGpu
    regions: frozenset[int]
    done: RuntimeCopy
    error: TransferError | None = None
    """Why it failed, once :meth:`wait` raised (the consumer then READs the whole payload instead)."""
    ended: bool = False

    def covers(self, index: int) -> bool:
        return index in self.regions

    async def wait(self) -> None:
        """See :meth:`SameGpu.wait`; once it has returned or raised, again returns or raises at once."""
        if self.error is not None:
            raise TransferError(self.error.message) from self.error
        if self.ended:
            return
        try:
            await self.owner.wait(self.done)
        except TransferError as exc:
            self.error = exc
            raise
        self.ended = True


class SameGpu:
    """The consumer's same-GPU copy (see the module docstring); one per connector."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self.copies = 0  #: payloads copied this way (tests and benchmarks read it)
        self.primed = 0  #: :meth:`prime` copies queued

    def prime(self, ref: NixlPayload, arena: IpcArena | None) -> None:
        """Queue :data:`PRIME_BYTES` between the two halves of our scratch on the arena's stream, as the first
        step of a get of a payload with VRAM regions from a producer whose arena is mapped.

        The first copy a process queues after waiting for a payload is the slow one, whatever it copies:
        inside gets on H100s, 18–28 µs of host time for the payload's ``cudaMemcpyAsync`` against 5 µs for
        a second one right after it.  Queued here first, this one takes that time and the payload's copy
        7–13 µs; the whole 1 MiB get was 21–38 µs shorter under MPS and 116–131 µs shorter without it
        (``benchmarks/same_gpu_launch.py``, ``as_is`` against ``no_prime``, round 19).  Where it is queued
        matters: after the manifest's checks instead, the get was 15–25 µs *longer* under MPS, and from a
        thread of its own longer still.  Nothing of the payload is read (its descriptors are not checked
        yet) and nothing is waited for: the payload's copy is queued behind this one on the same stream.
        A runtime error is left to that copy's launch, which reports it and falls back."""
        runtime = CudaRuntime.loaded()
        if runtime is None or arena is None or not arena.scratch or not self._ep.config.same_gpu_copy:
            return
        if not any(r.mem_kind is MemKind.VRAM for r in ref.regions):
            return
        with contextlib.suppress(RuntimeError):
            runtime.set_device(arena.device)
            runtime.copy(arena.scratch, arena.scratch + PRIME_BYTES, PRIME_BYTES, arena.stream)
            self.primed += 1

    def regions(self, ref: NixlPayload, arena: IpcArena | None, slots: dict[DeviceKind, Slot]) -> frozenset[int]:
        """The regions of ``ref`` the copy can take: the path is on, the peer's arena is mapped, and the
        region is non-empty, VRAM on both sides and inside the arena.  Empty: READ it all."""
        if arena is None or not self._ep.config.same_gpu_copy or DeviceKind.CUDA not in slots:
            return frozenset()
        return frozenset(
            i
            for i, (s, r) in enumerate(zip(ref.manifest.regions, ref.regions, strict=True))
            if s.nbytes
            and s.device is DeviceKind.CUDA
            and r.mem_kind is MemKind.VRAM
            and arena.offset(r.address, r.length) is not None
        )

    def launch(
        self,
        ref: NixlPayload,
        arena: IpcArena | None,
        slots: dict[DeviceKind, Slot],
        regions: frozenset[int] | None = None,
    ) -> ArenaCopy:
        """Queue the copy of every region :meth:`regions` names (``regions``, when the caller has them
        already) into our slot on the arena's stream (the CUDA runtime's calls); what is returned says which
        regions and when they are done.  :class:`TransferError` if it cannot be queued."""
        rt = CudaRuntime.loaded()
        if rt is None or arena is None or arena.events is None:  # open_arena maps nothing without it
            raise TransferError("same-GPU copy failed: no CUDA runtime to queue it with")
        if regions is None:
            regions = self.regions(ref, arena, slots)
        local = slots[DeviceKind.CUDA]
        copies = []  # (source address, bytes): every region checked before anything is queued
        for i in sorted(regions):
            spec, remote = ref.manifest.regions[i], ref.regions[i]
            start = arena.offset(remote.address, remote.length)
            if start is None or spec.nbytes > remote.length or spec.nbytes > local.nbytes:
                raise TransferError("same-GPU copy failed: a region does not fit its arena or our slot")
            copies.append((arena.base + start, spec.nbytes))
        try:
            rt.set_device(local.device_id)
            event = arena.events.take()  # before any copy: a copy is never queued without its completion
        except RuntimeError as exc:  # the runtime's status, translated once here
            raise TransferError(f"same-GPU copy failed: {exc}") from exc
        queued = False
        try:
            for src, nbytes in copies:
                rt.copy(local.address, src, nbytes, arena.stream)
                queued = True
            rt.record(event, arena.stream)
        except RuntimeError as exc:
            # The caller READs into the same slot next, and gives it back on failure: a copy queued already
            # must have ended first (its event was not recorded, so only the stream can tell).
            if queued:
                with contextlib.suppress(RuntimeError):  # a failed stream: the context is lost anyway
                    rt.synchronize_stream(arena.stream)
            arena.events.put(event)
            raise TransferError(f"same-GPU copy failed: {exc}") from exc
        return ArenaCopy(self, regions, RuntimeCopy(event, arena.events))

    async def wait(self, done: RuntimeCopy) -> None:
        """Return once the copy :meth:`launch` queued is done; :class:`TransferError` if it outlives the
        transfer timeout or the runtime reports an error (translated here, once); a cancelled wait still
        waits (shielded) for the copy, so nothing writes into slots given back."""
        try:
            await self._wait(done, time.monotonic() + self._ep.timeouts.transfer)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), contextlib.suppress(RuntimeError):
                await anyio.to_thread.run_sync(done.synchronize)
            raise
        except RuntimeError as exc:  # the runtime's status (cudaEventQuery / cudaEventSynchronize)
            raise TransferError(f"same-GPU copy failed: {exc}") from exc
        self.copies += 1

    async def copy(self, ref: NixlPayload, arena: IpcArena, slots: dict[DeviceKind, Slot]) -> None:
        """:meth:`launch` then :meth:`wait`: the bytes are there when it returns (for any stream)."""
        await self.launch(ref, arena, slots).wait()

    async def _wait(self, done: RuntimeCopy, deadline: float) -> None:
        started = time.monotonic()
        while not done.query():
            now = time.monotonic()
            if now < started + HOLD_S:
                continue
            if now > deadline:
                await anyio.to_thread.run_sync(done.synchronize)  # it must end before the slots go back
                raise TransferError("same-GPU copy timed out", seconds=self._ep.timeouts.transfer)
            await anyio.sleep(0 if now < started + SPIN_S else POLL_S)
