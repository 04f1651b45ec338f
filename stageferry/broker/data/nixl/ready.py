"""Receive buffers posted ahead: the slots and views of the next payload, made while the consumer is idle.

A stage's payloads repeat a few shapes.  Once a get of a shape has given its slots back, the consumer takes
slots for one more payload of that shape and makes the payload's views over them (what
:func:`~stageferry.broker.data.payload_codec.unpack` returns: tensors are views, which need no bytes), from a
background task that runs while the event loop has nothing else to do — typically while the worker waits
for its next entry.  When the next ref arrives with a manifest of the same structure, the get skips taking
slots and unpacking (≈ 0.15 ms of a T2VA hop on the device, ``benchmarks/RESULTS.md`` §14) and READs
straight into the ready slots.  This is what MPI and NCCL do with pre-posted receives.

What stays the same: every ref is validated as before (manifest, descriptors, seal, lease) before any READ;
a ready payload is used only for a manifest whose :func:`~stageferry.broker.data.payload_validation.
structure_key` — everything the views depend on: tree, dtypes, shapes, offsets, region sizes — equals the
one it was made for.  The views are fresh objects, made after the previous payload's block ended, so
nothing of an earlier request is handed on.

Slots that outlive their shape: a payload's structure changes with what it carries (the text states' length
follows the prompt), so the next get often has another structure than the ready one.  Its views are then
useless, but its slots are not: a ready payload's slots are taken a size class larger than its regions
(the next power of two, at most an eighth of the pool, never less than the region), and a get whose regions
all fit them READs into them and makes only its views (``reused``) instead of giving them back and taking
its own.  A get takes them cut to its regions (:meth:`~stageferry.broker.data.pool.MemoryPool.shrink`):
the rest is back in the pool while its block runs.  Likewise the first get: after the rehearsal, a
consumer with an upstream stage holds one slot of a sixteenth of each pool (``ahead``), so that get takes
no slot either.

Memory: at most one payload's slots are held ready, per consumer.  They are never taken while anybody waits
on a pool (:meth:`~stageferry.broker.data.pool.PoolSet.take_regions_now`); they go back before a get of
another shape takes slots of its own, and whenever a put, a staging or a get would otherwise wait on the
pool set, which a stage's input and output edges share (``PoolSet.on_pressure``, wired by the connector),
so a ready payload never makes anyone wait.  They are released at shutdown.  The connector's resources
count them apart (``ready_slots``), so an idle leader's ``pool_slots_in_use`` is still 0.
``DataPlaneConfig.ready_slots = false`` turns it off.

Rehearsal: a consumer's first get has no payload made ready (no shape was seen yet) and would also be the
first to run the get's code at all — taking slots, the structure key, the unpack into views — whose
first call costs several times a later one (Python and torch build what they cache: 184 µs against
20 µs for a T2VA unpack on the CPU box; a first hop's slots and views 0.12 and 0.37 ms against 0.005 and
0.003 ms ready, issue 39).  So :meth:`ReadySlots.run` first runs that code once on a small payload of the
usual leaf kinds in each pool (:func:`rehearsal_payload`), with the get's checks (manifest, descriptors
against our own arenas, seal), then gives its slots back.

Who calls: the consumer (:meth:`ReadySlots.take` per get, :meth:`ReadySlots.want` when a get's block ends),
the connector (:meth:`ReadySlots.run` among its background loops, :meth:`ReadySlots.drop` at shutdown).
Event-loop thread only, like the pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog
import torch

from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.payload_codec import unpack, validate_manifest, validate_remote_regions
from stageferry.broker.data.payload_plan import plan_payload
from stageferry.broker.data.payload_validation import checked_key
from stageferry.broker.data.pool import Slot
from stageferry.schemas import DeviceKind, Manifest
from stageferry.schemas.nixl import lease_seal

log = structlog.get_logger(__name__)


def rehearsal_payload(devices: dict[DeviceKind, torch.device]) -> dict[str, Any]:
    """A small payload with the leaf kinds a stage's payloads carry (the dtypes, nesting and metadata of
    the reference encoder's), one copy on each of ``devices``."""

    def leaves(on: torch.device) -> dict[str, Any]:
        return {
            "hidden": torch.zeros(1, 4, 8, dtype=torch.bfloat16, device=on),
            "latents": torch.zeros(1, 2, 2, 4, dtype=torch.float32, device=on),
            "half": torch.zeros(4, dtype=torch.float16, device=on),
            "ids": torch.zeros(1, 4, dtype=torch.int64, device=on),
            "roles": torch.zeros(4, dtype=torch.int32, device=on),
            "mask": torch.zeros(4, dtype=torch.bool, device=on),
            "bytes": torch.zeros(16, dtype=torch.uint8, device=on),
            "empty": torch.zeros(0, 3, device=on),
            "list": [torch.zeros(2, device=on), torch.zeros(2, device=on)],
            "meta": {"name": "rehearsal", "n": 1, "scale": 0.5, "shape": [1, 2], "flag": True},
        }

    return {kind.value: leaves(on) for kind, on in devices.items()}


#: A ready slot is at most this share of its pool, or its region's size if larger (see the module docstring).
SIZE_CLASS_SHARE = 8
#: The first get's slot, held from the rehearsal on by a consumer with an upstream stage: this share of each pool.
AHEAD_SHARE = 16
#: The smallest size class (a host region of a few integers still gets a slot that a longer one fits).
MIN_SIZE_CLASS = 64 << 10


def size_class(nbytes: int, capacity: int) -> int:
    """The ready slot for a region of ``nbytes`` in a pool of ``capacity``: the next power of two (at least
    :data:`MIN_SIZE_CLASS`), at most ``capacity // SIZE_CLASS_SHARE``, never less than ``nbytes``."""
    rounded = max(MIN_SIZE_CLASS, 1 << max(0, nbytes - 1).bit_length())
    return max(nbytes, min(rounded, capacity // SIZE_CLASS_SHARE))


@dataclass(slots=True)
class Ready:
    """Slots held for the next payload and, when its structure is known, its views over them (``key`` and
    ``payload``; ``None`` for slots alone, whose views the get makes)."""

    key: bytes | None
    slots: dict[DeviceKind, Slot]
    payload: Any = None

    @property
    def has_views(self) -> bool:
        return self.key is not None

    def views(self) -> Any:
        """The payload's views over the slots (what the get's unpack would have made)."""
        return self.payload


class ReadySlots:
    """At most one :class:`Ready` payload of the last shape a get used (see the module docstring)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._ready: Ready | None = None
        self._wanted: Manifest | None = None
        self._wake = anyio.Event()
        self.hits = 0  #: gets that found their payload ready
        self.reused = 0  #: gets of another structure that READ into the ready slots (their views made then)
        self.made = 0  #: ready payloads made

    @property
    def enabled(self) -> bool:
        return self._ep.config.ready_slots

    @property
    def slots(self) -> int:
        return len(self._ready.slots) if self._ready is not None else 0

    @property
    def nbytes(self) -> int:
        """Pool bytes the ready slots hold (rounded as the pools count them)."""
        pools = self._ep.pools
        return pools.held_bytes(self._ready.slots.values()) if self._ready is not None and pools else 0

    def take(self, manifest: Manifest) -> Ready | None:
        """For ``manifest`` (validated): the ready payload if it has its structure; else the ready slots alone
        if its regions fit them (:attr:`Ready.has_views` false: the caller unpacks); else ``None`` — and then
        the ready slots, if any, are back in the pool, so the caller's own acquire never waits on them."""
        ready, self._ready = self._ready, None
        pools = self._ep.pools
        if ready is None or pools is None:
            return None
        wanted = {region.device: region.nbytes for region in manifest.regions}
        if ready.has_views and checked_key(manifest) == ready.key:
            self.hits += 1
        elif all(kind in ready.slots and ready.slots[kind].nbytes >= n for kind, n in wanted.items()):
            pools.release_all([slot for kind, slot in ready.slots.items() if kind not in wanted])
            self.reused += 1
            ready = Ready(None, {kind: ready.slots[kind] for kind in wanted})
        else:
            self._release(ready)
            return None
        # the get holds them for its whole block: each cut to its region, the rest back in the pool now, so
        # the size class up never makes a put or a staging of the block wait (nor lets a view reach past it)
        ready.slots = {kind: pools.pools[kind].shrink(slot, wanted[kind]) for kind, slot in ready.slots.items()}
        return ready

    def want(self, manifest: Manifest) -> None:
        """A get of ``manifest`` ended and gave its slots back: have the next payload of its shape ready."""
        if self.enabled and self._ready is None:
            self._wanted = manifest
            self._wake.set()

    def drop(self) -> None:
        """Give the ready slots back (shutdown, or the pool is needed)."""
        ready, self._ready, self._wanted = self._ready, None, None
        if ready is not None:
            self._release(ready)

    async def run(self, *, ahead: bool = False) -> None:
        """Rehearse (module docstring), with ``ahead`` (a consumer with an upstream stage) hold the first get's
        slots, then make what :meth:`want` asked for, whenever the event loop gets to it; runs until
        cancelled."""
        try:
            self.rehearse()
            if ahead:
                self.hold_ahead()
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                manifest, self._wanted = self._wanted, None
                if manifest is not None and self._ready is None and self.enabled:
                    self._make(manifest)
        finally:
            self.drop()

    def rehearse(self) -> bool:
        """Run a get's local steps once on :func:`rehearsal_payload` in our pools (slots taken, structure key,
        unpacked into views, slots given back); whether it ran (not: no pools, a pool busy, or it failed,
        which is logged and harms nothing: the first get runs these steps itself)."""
        pools = self._ep.pools
        if pools is None or not self.enabled:
            return False
        devices: dict[DeviceKind, torch.device] = {}
        if DeviceKind.CPU in pools.pools:
            devices[DeviceKind.CPU] = torch.device("cpu")
        if DeviceKind.CUDA in pools.pools and self._ep.cuda_device is not None:
            devices[DeviceKind.CUDA] = self._ep.cuda_device
        try:
            manifest = plan_payload(rehearsal_payload(devices)).manifest
        except Exception as exc:  # noqa: BLE001 - a warm-up: the connector runs on without it
            log.warning("nixl.rehearsal_failed", error=str(exc)[:200])
            return False
        ready = self._ready
        try:
            self._make(manifest, count=False)
            made = self._ready
            if made is not None and made is not ready:  # and a get's checks on its slots, and their cut
                regions = [made.slots[r.device].remote_region() for r in manifest.regions]
                validate_manifest(manifest, max_payload_bytes=self._ep.config.max_payload_bytes)
                validate_remote_regions(manifest, regions, pools.arenas())
                lease_seal(b"rehearsal", "rehearsal", "rehearsal", regions)
                made.slots = {k: pools.pools[k].shrink(slot, slot.nbytes // 2) for k, slot in made.slots.items()}
        except Exception as exc:  # noqa: BLE001 - a warm-up: the loop and the connector run on without it
            log.warning("nixl.rehearsal_failed", error=str(exc)[:200])
        made, self._ready = self._ready, ready
        if made is None or made is ready:
            return False
        self._release(made)
        return True

    def hold_ahead(self) -> bool:
        """Hold a slot of ``capacity // AHEAD_SHARE`` in each pool for the first get (slots alone, no views:
        its structure is not known yet); whether they were taken (not: turned off, something held ready
        already, or a pool is busy)."""
        pools = self._ep.pools
        if pools is None or not self.enabled or self._ready is not None:
            return False
        slots = pools.take_sized_now({kind: pool.capacity // AHEAD_SHARE for kind, pool in pools.pools.items()})
        if slots is None:
            return False
        self._ready = Ready(None, slots)
        return True

    def _make(self, manifest: Manifest, *, count: bool = True) -> None:
        pools = self._ep.pools
        key = checked_key(manifest)
        if pools is None or key is None or any(r.device not in pools.pools for r in manifest.regions):
            return
        # a size class up, so that a payload of another structure that fits finds slots ready (``reused``)
        sizes = {r.device: size_class(r.nbytes, pools.pools[r.device].capacity) for r in manifest.regions}
        slots = pools.take_sized_now(sizes) if count else None
        slots = slots or pools.take_regions_now(manifest)
        if slots is None:  # the pool is busy: nothing is taken from a get that needs it
            return
        try:
            payload = unpack(manifest, {kind: slot.span for kind, slot in slots.items()}, copy=False)
        except Exception as exc:  # a get will take slots itself; this loop must not end the connector's
            pools.release_all(slots)
            log.warning("nixl.ready_failed", error=str(exc)[:200])
            return
        self._ready = Ready(key, slots, payload)
        self.made += count

    def _release(self, ready: Ready) -> None:
        if self._ep.pools is not None:
            self._ep.pools.release_all(ready.slots)
