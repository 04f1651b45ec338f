"""Staged outputs: pool slots handed to a producer model to write its payload into, so the put copies nothing.

A model asks for its output tensors with a template (:mod:`stageferry.broker.data.staging`); the leader's
NIXL connector plans the template's manifest, acquires its slots (waiting on the pool like a put) and
answers with typed views over the slots at their planned offsets: a :class:`Staging`, filed under the
hop's key.  The model writes its results into them (``out=`` forms, ``copy_``) and returns the payload;
:meth:`Stagings.pop` then hands the staging to the put, which uses it if the payload's manifest is the
staged one — it copies only the tensors the model made elsewhere and puts the same slots under a lease — and else
frees it once the payload is packed elsewhere.

Memory: a staged slot is owned by its staging until the put takes it (then by the lease) or it is
released — the model raised, the request was settled without a put (cancelled, failed), the put went
inline or the manifest differed (:meth:`Stagings.release`, called by the put and by the stage worker once
the request is done with, whatever happened) — and in any case by the expiry
(:meth:`Stagings.scan`, from the connector's background loop): at the request's deadline, or
``timeouts.request`` after staging for a request without one.  A model asks for its output once the shapes
are known, near its end; the stage worker releases the staging as soon as the model has returned, so the
expiry only frees what a bug left behind.

Who calls: the producer (stage, pop, free), the stage worker through the connector (release), the connector
(expiry loop, shutdown).  Event-loop thread only, like the pools; a model thread reaches
:meth:`Stagings.stage` through ``anyio.from_thread``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import anyio
import structlog
import torch

from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.payload_codec import TORCH_DTYPE, unpack
from stageferry.broker.data.payload_plan import PackPlan, plan_payload
from stageferry.broker.data.pool import Slot
from stageferry.broker.data.staging import Template, describe, materialize
from stageferry.errors import ManifestError, PoolExhaustedError
from stageferry.schemas import DeviceKind, Manifest, TensorSpec

log = structlog.get_logger(__name__)

_SCAN_S = 0.5


@dataclass(slots=True)
class Staging:
    """Slots handed to a model for the hop ``key``, laid out as ``manifest`` says."""

    key: str
    manifest: Manifest
    slots: dict[DeviceKind, Slot]
    expires_at: float
    #: Set by the put that leases these very slots (the lease owns them from then on).
    taken: bool = False

    def view(self, spec: TensorSpec) -> torch.Tensor:
        """The staged tensor ``spec`` describes (what the model was handed)."""
        buf = self.slots[spec.device].view
        return buf[spec.offset : spec.offset + spec.nbytes].view(TORCH_DTYPE[spec.dtype]).view(tuple(spec.shape))

    def is_staged(self, spec: TensorSpec, src: torch.Tensor) -> bool:
        """Whether ``src`` is the staged tensor of ``spec`` (what :meth:`view` returns, or a view equal
        to it): same place, dtype, shape and a contiguous layout.  Decided without making the view."""
        buf = self.slots[spec.device].view
        return (
            src.data_ptr() == buf.data_ptr() + spec.offset
            and src.device == buf.device
            and src.dtype == TORCH_DTYPE[spec.dtype]
            and src.shape == tuple(spec.shape)
            and src.is_contiguous()
        )

    def fill(self, plan: PackPlan) -> int:
        """Copy into the slots the tensors of ``plan`` (same manifest) that are not already the staged
        ones; the number copied.  CUDA slots are synchronised afterwards: a NIXL READ waits on no stream."""
        copied = 0
        with torch.no_grad():
            for spec, src in zip(plan.manifest.tensors, plan.tensors, strict=True):
                if spec.nbytes == 0 or self.is_staged(spec, src):
                    continue
                self.view(spec).copy_(src)
                copied += 1
        for slot in self.slots.values():
            if slot.kind is DeviceKind.CUDA:
                torch.cuda.synchronize(slot.device)
        return copied


class Stagings:
    """The producer's stagings, one per hop key at most."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._staged: dict[str, Staging] = {}

    def __len__(self) -> int:
        return len(self._staged)

    def __contains__(self, key: object) -> bool:
        return key in self._staged

    async def stage(
        self, key: str, template: Template, *, force_inline: bool = False, deadline: float | None = None
    ) -> Any:
        """The output tensors for ``template``: views over fresh pool slots, or ordinary tensors when the
        payload would not travel over NIXL (inline-sized, too large, NIXL unusable, forced inline) or no
        slot freed within ``pool_wait``.  Asked again for the same hop, ordinary tensors too: the first
        answer stays staged (the model may still be writing into it) until the put or the release."""
        ep = self._ep
        if key in self._staged:
            log.warning("payload.staging_asked_twice", key=key)
            return materialize(template)
        plan = plan_payload(describe(template))
        total = plan.manifest.total_bytes
        if (
            force_inline
            or ep.pools is None
            or ep.unavailable_reason is not None
            or total <= ep.config.inline_max_bytes
            or total > ep.config.max_payload_bytes
        ):
            return materialize(template)
        try:
            slots = await ep.pools.acquire_regions(plan.manifest, timeout=ep.timeouts.pool_wait)
        except (PoolExhaustedError, ManifestError) as exc:
            log.info("payload.staging_refused", key=key, code=exc.code, error=exc.message)
            return materialize(template)
        expires_at = deadline if deadline is not None else time.time() + ep.timeouts.request
        try:
            payload = unpack(plan.manifest, {kind: slot.span for kind, slot in slots.items()}, copy=False)
        except BaseException:
            ep.pools.release_all(slots)
            raise
        self._staged[key] = Staging(key=key, manifest=plan.manifest, slots=slots, expires_at=expires_at)
        ep.counters.stagings += 1  # the pool published its usage as it handed out the slots
        return payload

    def pop(self, key: str) -> Staging | None:
        """The staging for ``key``, removed from the table: the caller (the put) owns it from now on and
        either puts its slots under a lease (setting ``taken``) or hands it to :meth:`free`."""
        return self._staged.pop(key, None)

    def release(self, key: str, *, reason: str) -> bool:
        """Give the staging for ``key`` (if any) back to the pool; True if there was one."""
        staging = self._staged.pop(key, None)
        if staging is None:
            return False
        self.free(staging, reason=reason)
        return True

    async def run_expiry(self) -> None:
        """Free stagings past their expiry; runs until cancelled."""
        while True:
            await anyio.sleep(_SCAN_S)
            self.scan()

    def scan(self, now: float | None = None) -> None:
        """One pass of the expiry loop."""
        now = time.time() if now is None else now
        for key, staging in list(self._staged.items()):
            if staging.expires_at <= now:
                log.warning("payload.staging_expired", key=key, bytes=staging.manifest.total_bytes)
                self.release(key, reason="expired")

    def free_all(self, *, reason: str) -> None:
        for key in list(self._staged):
            self.release(key, reason=reason)

    def free(self, staging: Staging, *, reason: str) -> None:
        """Give ``staging``'s slots back to the pool."""
        if self._ep.pools is not None:
            self._ep.pools.release_all(staging.slots)
        log.debug("payload.staging_freed", key=staging.key, reason=reason, bytes=staging.manifest.total_bytes)
