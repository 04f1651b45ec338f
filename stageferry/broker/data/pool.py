"""Bounded, pre-registered memory pools: where payloads wait for a READ, and where READs land.

Each :class:`MemoryPool` allocates one uint8 tensor (host DRAM or one GPU's memory) at start-up and
registers it with NIXL once; payload regions are slots carved out of it by
:class:`~stageferry.broker.data.arena_allocator.ArenaAllocator`, so no
request pays for memory registration.  A full pool is back-pressure: :meth:`MemoryPool.acquire` waits,
bounded by a timeout, then raises :class:`~stageferry.errors.PoolExhaustedError`.

Ownership: whoever acquires a slot must release it (the producer on READ notification or lease expiry,
the consumer when its payload context exits).  Pools are single-threaded: call them from the event loop
thread that owns them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import anyio
import structlog
import torch

from stageferry.broker.data.arena_allocator import DEFAULT_ALIGNMENT, ArenaAllocator
from stageferry.broker.data.metrics import POOL_BYTES_IN_USE
from stageferry.broker.data.payload_codec import TORCH_DTYPE, Span, TypedViews
from stageferry.config import DataPlaneConfig
from stageferry.errors import ManifestError, PoolExhaustedError
from stageferry.schemas.payload import MEM_KIND_OF, DeviceKind, Manifest, RemoteRegion

log = structlog.get_logger(__name__)


class Registrar(Protocol):
    """Registers memory for remote access once; :class:`stageferry.broker.data.nixl.agent.NixlAgent` is one."""

    def register(self, tensor: torch.Tensor) -> object:
        """Register a contiguous tensor; the returned handle is what :meth:`deregister` takes."""
        ...

    def deregister(self, handle: object) -> None: ...


@dataclass(frozen=True, slots=True, eq=False)
class Slot:
    """One acquired region of a pool: ``nbytes`` at byte ``offset`` of the pool's arena (``typed``), valid
    until released.

    Taking, cutting and giving back a slot runs no torch op: its bytes as a tensor (:attr:`view`) are made
    on first use, and a payload's views are made over :attr:`span` (in a process that has idled, the first
    call of a torch op costs 30–130 µs: see :class:`~stageferry.broker.data.payload_codec.TypedViews`).

    Identity matters (``eq=False``): a pool only frees the very slot object it handed out, so a stale
    copy released twice cannot free someone else's reuse of the same offset.
    """

    kind: DeviceKind
    offset: int
    nbytes: int
    address: int
    device_id: int
    typed: TypedViews = field(repr=False)  # the pool's arena as each dtype
    _view: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def view(self) -> torch.Tensor:
        """The slot's bytes: a contiguous uint8 tensor exactly ``nbytes`` long (made once, on first use)."""
        view = self._view
        if view is None:
            arena, first = self.typed.typed(torch.uint8)
            view = arena.as_strided((self.nbytes,), (1,), first + self.offset)
            object.__setattr__(self, "_view", view)  # a cache: the slot's fields never change
        return view

    @property
    def device(self) -> torch.device:
        """The device the slot's memory is on."""
        return self.typed.tensor.device

    @property
    def span(self) -> Span:
        """This slot in its pool's arena: what :func:`~stageferry.broker.data.payload_codec.unpack` makes
        views over without a torch op of its own (:class:`~stageferry.broker.data.payload_codec.TypedViews`)."""
        return Span(self.typed, self.offset, self.nbytes)

    def remote_region(self) -> RemoteRegion:
        """The wire form of this slot, for a NIXL descriptor."""
        return RemoteRegion(
            mem_kind=MEM_KIND_OF[self.kind], address=self.address, length=self.nbytes, device_id=self.device_id
        )


class _Waiter:
    __slots__ = ("event", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.event: anyio.Event | None = None


class MemoryPool:
    """One registered arena of one device kind, handing out slots first-come, first-served.

    Waiters are served in FIFO order (a large request is not starved by a stream of small ones); the
    price is that small requests queue behind a large one at the head, for at most their timeout.
    """

    def __init__(
        self,
        kind: DeviceKind,
        capacity: int,
        *,
        device: torch.device,
        registrar: Registrar | None,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> None:
        if (device.type == "cuda") != (kind is DeviceKind.CUDA):
            raise ValueError(f"a {kind} pool cannot live on {device}")
        self.kind = kind
        self._alloc = ArenaAllocator(capacity, alignment)
        self._buffer = torch.empty(self._alloc.capacity, dtype=torch.uint8, device=device)
        self._typed = TypedViews(self._buffer, TORCH_DTYPE.values())  # every dtype's view, made now
        self._address = self._buffer.data_ptr()
        self.device_id = self._buffer.get_device() if kind is DeviceKind.CUDA else 0
        self._registrar = registrar
        self._handle = registrar.register(self._buffer) if registrar is not None else None
        self._slots: dict[int, Slot] = {}
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        self._gauge = POOL_BYTES_IN_USE.labels(kind=kind.value)  # bound once: every take and release sets it
        log.info(
            "pool.created",
            kind=kind.value,
            capacity=self.capacity,
            device=str(device),
            registered=registrar is not None,
        )

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def buffer(self) -> torch.Tensor:
        """The whole arena (what a same-GPU consumer maps: :mod:`stageferry.broker.data.nixl.same_gpu`)."""
        return self._buffer

    @property
    def slots_in_use(self) -> int:
        return self._alloc.live

    @property
    def bytes_in_use(self) -> int:
        """Bytes reserved, counting each slot's alignment padding."""
        return self._alloc.bytes_in_use

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def arena(self) -> RemoteRegion:
        """The whole registered arena, as producers advertise it (consumers check descriptors against it)."""
        return RemoteRegion(
            mem_kind=MEM_KIND_OF[self.kind],
            address=self._buffer.data_ptr(),
            length=self.capacity,
            device_id=self.device_id,
        )

    async def acquire(self, nbytes: int, *, timeout: float) -> Slot:  # noqa: ASYNC109 - ends in a typed error
        """A slot of ``nbytes``; waits up to ``timeout`` seconds for releases, then PoolExhaustedError.

        A request larger than the pool fails at once.  Cancellation while waiting takes nothing.
        """
        if self._closed:
            raise PoolExhaustedError("pool is closed", kind=self.kind.value)
        if nbytes > self.capacity:
            raise PoolExhaustedError(
                "payload region larger than the whole pool", kind=self.kind.value, nbytes=nbytes, capacity=self.capacity
            )
        slot = self.take_now(nbytes)
        if slot is not None:
            return slot
        waiter = _Waiter(nbytes)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(timeout):
                while not self._closed:
                    if self._waiters[0] is waiter:
                        slot = self._try_take(nbytes)
                        if slot is not None:
                            return slot
                    waiter.event = anyio.Event()
                    await waiter.event.wait()
        finally:
            self._waiters.remove(waiter)
            self._wake_head()
        log.warning(
            "pool.exhausted",
            kind=self.kind.value,
            nbytes=nbytes,
            timeout=timeout,
            bytes_in_use=self.bytes_in_use,
            slots_in_use=self.slots_in_use,
            closed=self._closed,
        )
        why = "pool closed while waiting" if self._closed else "no pool slot freed in time"
        raise PoolExhaustedError(
            why,
            kind=self.kind.value,
            nbytes=nbytes,
            timeout=timeout,
            bytes_in_use=self.bytes_in_use,
            capacity=self.capacity,
        )

    def take_now(self, nbytes: int) -> Slot | None:
        """A slot of ``nbytes`` if one is free and nobody is waiting ahead, else ``None`` (never waits);
        :meth:`acquire` says why not (closed, too large) and waits."""
        if self._closed or self._waiters or nbytes > self.capacity:
            return None
        return self._try_take(nbytes)

    def held_bytes(self, slot: Slot) -> int:
        """What ``slot`` adds to :attr:`bytes_in_use` (its size rounded to the alignment); 0 once released."""
        return self._alloc.size_of(slot.offset) if self._slots.get(slot.offset) is slot else 0

    def shrink(self, slot: Slot, nbytes: int) -> Slot:
        """``slot`` cut to its first ``nbytes`` (at most its size): the tail goes back to the pool (and may
        wake a waiter) and a new slot object of that size is returned, which is the one to release; ``slot``
        itself is then stale.  A slot no longer live is returned as it is."""
        if self._slots.get(slot.offset) is not slot or nbytes >= slot.nbytes:
            return slot
        self._alloc.shrink(slot.offset, nbytes)
        cut = Slot(
            kind=slot.kind,
            offset=slot.offset,
            nbytes=nbytes,
            address=slot.address,
            device_id=slot.device_id,
            typed=slot.typed,
        )
        self._slots[slot.offset] = cut
        self._publish()
        self._wake_head()
        return cut

    def release(self, slot: Slot) -> bool:
        """Free ``slot`` and wake the next waiter; True if freed.

        Releasing a slot that is no longer live (already released, or from another pool) is ignored and
        returns False: lease expiry and READ completion may both try, and only the first counts.
        """
        if self._slots.get(slot.offset) is not slot:
            log.debug("pool.release.stale", kind=self.kind.value, offset=slot.offset)
            return False
        del self._slots[slot.offset]
        self._alloc.free(slot.offset)
        self._publish()
        self._wake_head()
        return True

    def close(self) -> None:
        """Deregister the arena (idempotent) and fail every waiter; live slots are reported, not freed."""
        if self._closed:
            return
        self._closed = True
        if self.slots_in_use:
            log.warning("pool.close.live_slots", kind=self.kind.value, slots=self.slots_in_use)
        for waiter in self._waiters:
            if waiter.event is not None:
                waiter.event.set()
        if self._registrar is not None:
            self._registrar.deregister(self._handle)
            self._handle = None
        log.info("pool.closed", kind=self.kind.value)

    def _try_take(self, nbytes: int) -> Slot | None:
        offset = self._alloc.allocate(nbytes)
        if offset is None:
            return None
        slot = Slot(
            kind=self.kind,
            offset=offset,
            nbytes=nbytes,
            address=self._address + offset,
            device_id=self.device_id,
            typed=self._typed,
        )
        self._slots[offset] = slot
        self._publish()
        return slot

    def _wake_head(self) -> None:
        if self._waiters and self._waiters[0].event is not None:
            self._waiters[0].event.set()

    def _publish(self) -> None:
        self._gauge.set(self._alloc.bytes_in_use)


class PoolSet:
    """One :class:`MemoryPool` per configured device kind; acquires a payload's regions all-or-nothing."""

    def __init__(self, pools: Mapping[DeviceKind, MemoryPool]) -> None:
        for kind, pool in pools.items():
            if pool.kind is not kind:
                raise ValueError(f"pool of kind {pool.kind} filed under {kind}")
        self.pools: dict[DeviceKind, MemoryPool] = dict(pools)
        #: Called before anyone waits on a pool: gives back slots held only ahead of need (a consumer's
        #: ready payload, :mod:`stageferry.broker.data.nixl.ready`), so they never make a put, a staging
        #: or a get wait.
        self.on_pressure: Callable[[], None] = lambda: None

    @classmethod
    def from_config(
        cls, config: DataPlaneConfig, *, registrar: Registrar | None, cuda_device: torch.device | None = None
    ) -> PoolSet:
        """CPU pool always; a CUDA pool when a GPU is present and ``gpu_pool_bytes`` > 0."""
        pools = {
            DeviceKind.CPU: MemoryPool(
                DeviceKind.CPU, config.cpu_pool_bytes, device=torch.device("cpu"), registrar=registrar
            )
        }
        if config.gpu_pool_bytes > 0 and torch.cuda.is_available():
            device = cuda_device or torch.device("cuda", torch.cuda.current_device())
            pools[DeviceKind.CUDA] = MemoryPool(
                DeviceKind.CUDA, config.gpu_pool_bytes, device=device, registrar=registrar
            )
        return cls(pools)

    @property
    def capacity(self) -> int:
        return sum(p.capacity for p in self.pools.values())

    @property
    def slots_in_use(self) -> int:
        return sum(p.slots_in_use for p in self.pools.values())

    @property
    def bytes_in_use(self) -> int:
        return sum(p.bytes_in_use for p in self.pools.values())

    def arenas(self) -> list[RemoteRegion]:
        return [p.arena() for p in self.pools.values()]

    async def acquire_regions(
        self,
        manifest: Manifest,
        *,
        timeout: float,  # noqa: ASYNC109 - ends in PoolExhaustedError
    ) -> dict[DeviceKind, Slot]:
        """A slot for every region of ``manifest`` within ``timeout`` overall, or none at all.

        The clock starts at the first region that has to wait (the regions taken before it took no time).
        On PoolExhaustedError, cancellation or any other failure, the slots already taken are released.
        ManifestError if the manifest needs a kind this process has no pool for.
        """
        kinds = [r.device for r in manifest.regions]
        if len(set(kinds)) != len(kinds):
            raise ManifestError("two regions of the same device kind", devices=[k.value for k in kinds])
        missing = [k.value for k in kinds if k not in self.pools]
        if missing:
            raise ManifestError("payload needs memory this process has no pool for", missing=missing)
        deadline: float | None = None
        taken: dict[DeviceKind, Slot] = {}
        try:
            for region in manifest.regions:
                pool = self.pools[region.device]
                slot = pool.take_now(region.nbytes)
                if slot is None:
                    self.on_pressure()
                    slot = pool.take_now(region.nbytes)
                if slot is None:
                    if deadline is None:
                        deadline = anyio.current_time() + timeout
                    slot = await pool.acquire(region.nbytes, timeout=max(0.0, deadline - anyio.current_time()))
                taken[region.device] = slot
        except BaseException:
            self.release_all(taken.values())
            raise
        return taken

    def held_bytes(self, slots: Iterable[Slot]) -> int:
        """What live ``slots`` add to :attr:`bytes_in_use` (their sizes rounded to the pools' alignment)."""
        return sum(self.pools[slot.kind].held_bytes(slot) for slot in slots)

    def take_regions_now(self, manifest: Manifest) -> dict[DeviceKind, Slot] | None:
        """A slot for every region of ``manifest`` if each is free now and nobody waits on any pool, else ``None``
        with nothing taken (never waits).  The manifest is a checked one (one region per device kind)."""
        return self.take_sized_now({region.device: region.nbytes for region in manifest.regions})

    def take_sized_now(self, sizes: Mapping[DeviceKind, int]) -> dict[DeviceKind, Slot] | None:
        """A slot of ``sizes[kind]`` bytes in each kind's pool if each is free now and nobody waits on any
        pool, else ``None`` with nothing taken (never waits)."""
        if any(pool.waiting for pool in self.pools.values()):
            return None
        taken: dict[DeviceKind, Slot] = {}
        for kind, nbytes in sizes.items():
            pool = self.pools.get(kind)
            slot = pool.take_now(nbytes) if pool is not None else None
            if slot is None:
                self.release_all(taken)
                return None
            taken[kind] = slot
        return taken

    def release_all(self, slots: Mapping[DeviceKind, Slot] | Iterable[Slot]) -> None:
        """Release every slot (from :meth:`acquire_regions`, or any iterable); stale ones are ignored."""
        # concrete types first: the first ``isinstance(a_list, Mapping)`` of a process walks the ABC's
        # subclasses (≈ 0.1 ms, paid inside a get)
        for slot in (
            slots if isinstance(slots, list | tuple) else slots.values() if isinstance(slots, Mapping) else slots
        ):
            self.pools[slot.kind].release(slot)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
