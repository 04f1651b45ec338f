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

Memory: at most one payload's slots are held ready, per consumer.  They are never taken while anybody waits
on a pool (:meth:`~stageferry.broker.data.pool.PoolSet.take_regions_now`); they go back before a get of
another shape takes slots of its own, and whenever a put, a staging or a get would otherwise wait on the
pool set, which a stage's input and output edges share (``PoolSet.on_pressure``, wired by the connector),
so a ready payload never makes anyone wait.  They are released at shutdown.  The connector's resources
count them apart (``ready_slots``), so an idle leader's ``pool_slots_in_use`` is still 0.
``DataPlaneConfig.ready_slots = false`` turns it off.

Who calls: the consumer (:meth:`ReadySlots.take` per get, :meth:`ReadySlots.want` when a get's block ends),
the connector (:meth:`ReadySlots.run` among its background loops, :meth:`ReadySlots.drop` at shutdown).
Event-loop thread only, like the pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.payload_codec import unpack
from stageferry.broker.data.payload_validation import checked_key
from stageferry.broker.data.pool import Slot
from stageferry.schemas import DeviceKind, Manifest

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Ready:
    """Slots taken for one payload of a shape, and its views over them."""

    key: bytes
    slots: dict[DeviceKind, Slot]
    payload: Any

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
        """The ready payload if ``manifest`` (validated) has its structure, else ``None`` — and then the ready
        slots, if any, are back in the pool, so the caller's own acquire never waits on them."""
        ready, self._ready = self._ready, None
        if ready is None:
            return None
        if checked_key(manifest) == ready.key:
            self.hits += 1
            return ready
        self._release(ready)
        return None

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

    async def run(self) -> None:
        """Make what :meth:`want` asked for, whenever the event loop gets to it; runs until cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                manifest, self._wanted = self._wanted, None
                if manifest is not None and self._ready is None and self.enabled:
                    self._make(manifest)
        finally:
            self.drop()

    def _make(self, manifest: Manifest) -> None:
        pools = self._ep.pools
        key = checked_key(manifest)
        if pools is None or key is None:
            return
        slots = pools.take_regions_now(manifest)
        if slots is None:  # the pool is busy: nothing is taken from a get that needs it
            return
        try:
            payload = unpack(manifest, {kind: slot.view for kind, slot in slots.items()}, copy=False)
        except Exception as exc:  # a get will take slots itself; this loop must not end the connector's
            pools.release_all(slots)
            log.warning("nixl.ready_failed", error=str(exc)[:200])
            return
        self._ready = Ready(key, slots, payload)
        self.made += 1

    def _release(self, ready: Ready) -> None:
        if self._ep.pools is not None:
            self._ep.pools.release_all(ready.slots)
