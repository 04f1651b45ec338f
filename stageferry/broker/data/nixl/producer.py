"""Producer side of the NIXL data plane: put a payload into a leased pool slot, and let it go again.

Who calls what, and when (the producer leader only):

* :meth:`Producer.put` — once per hop, after the model returned the payload.  Small payloads, and any
  that cannot take the NIXL path (NIXL unavailable, pool exhausted, forced), go inline.  Otherwise the
  payload is packed into one slot per memory kind and put under a lease
  (:mod:`stageferry.broker.data.nixl.leases`); the returned :class:`Outgoing` holds the envelope's
  :class:`~stageferry.schemas.NixlPayload`.  From then on the slots belong to the lease: the caller hands
  the envelope on (the consumer's READ, resend request or drop frees them; so does the lease running out
  unclaimed), or calls :meth:`Producer.abandon` if the hand-off did not happen.
* :meth:`Producer.run_notifications` and :meth:`Producer.run_resends` — background loops started by the
  connector: the first is the one consumer of NIXL notifications in the process (a READ's release
  notification settles its lease), the second answers consumers that could not READ (the bytes inline,
  or a refusal), then settles the lease.

A model may also write its output straight into pool slots (:meth:`Stagings.stage`, before the put;
:mod:`stageferry.broker.data.nixl.staged_outputs`): the put then takes the staged slots, copies only the
tensors the model made elsewhere, and puts the same slots under the lease.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import time

import anyio
import structlog

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Outgoing, Payload
from stageferry.broker.data.inline import THREAD_ABOVE
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import Lease, LeaseTable
from stageferry.broker.data.nixl.staged_outputs import Staging, Stagings
from stageferry.broker.data.payload_codec import PackPlan, pack_into, plan_payload
from stageferry.broker.data.pool import Slot
from stageferry.errors import (
    ControlPlaneError,
    HandshakeError,
    ManifestError,
    PayloadTooLargeError,
    PayloadUnavailableError,
    PoolExhaustedError,
)
from stageferry.schemas import DeviceKind, Manifest, NixlPayload, Transport
from stageferry.schemas.nixl import (
    ResendAction,
    ResendRequest,
    Sealer,
    encode_resend_reply,
    released_token,
)

log = structlog.get_logger(__name__)

#: How often the notification loop drains NIXL's queue while any lease is held ...
_NOTIF_POLL_S = 0.002
#: ... and, with none held, the longest it waits for a lease before it looks anyway.
_IDLE_POLL_S = 0.05


class Producer:
    """The put side of one leader's connector; leases are kept in the shared :class:`LeaseTable`."""

    def __init__(self, endpoint: Endpoint, leases: LeaseTable, stagings: Stagings) -> None:
        self._ep = endpoint
        self._leases = leases
        self._stagings = stagings
        nixl = Transport.NIXL.value  # the put's metric series, looked up once instead of on every put
        self._puts = metrics.PUTS.labels(nixl)
        self._put_bytes = metrics.BYTES.labels("put", nixl)
        self._sealer = Sealer(endpoint.seal_key)  # signs every lease (lease_seal, the key's pads hashed once)
        self._put_seconds = metrics.TRANSFER_SECONDS.labels(nixl, "put")
        self._new_lease = anyio.Event()  # set by each new lease: the idle notification loop polls again at once

    async def put(self, key: str, payload: Payload, *, force_inline: bool = False) -> Outgoing:
        """See the module docstring; raises :class:`PayloadTooLargeError` above ``max_payload_bytes`` and
        :class:`PayloadUnavailableError` when only NIXL could carry it and NIXL is not usable.

        A staging for ``key`` is used if the payload has its layout; otherwise it is released once the
        payload is packed elsewhere (its tensors may be the staged views)."""
        staging = self._stagings.pop(key)
        try:
            return await self._put(key, payload, force_inline, staging)
        finally:
            if staging is not None and not staging.taken:
                self._stagings.free(staging, reason="unused")

    async def _put(self, key: str, payload: Payload, force_inline: bool, staging: Staging | None) -> Outgoing:
        ep = self._ep
        started = time.perf_counter()
        plan = plan_payload(payload)
        manifest = plan.manifest
        total = manifest.total_bytes
        if total > ep.config.max_payload_bytes:
            raise PayloadTooLargeError(
                "payload above max_payload_bytes", bytes=total, limit=ep.config.max_payload_bytes
            )
        if total <= ep.config.inline_max_bytes:
            return await ep.inline.encode(payload)
        reason = "forced" if force_inline else ep.unavailable_reason
        if reason is None and staging is not None and staging.manifest == manifest:
            return await self._put_staged(key, plan, staging, started)
        slots: dict[DeviceKind, Slot] = {}
        if reason is None:
            try:
                slots = await self.acquire(manifest)
            except PoolExhaustedError:
                reason = "pool_exhausted"
            except ManifestError:
                reason = "no_pool_for_device"
        if reason is not None:
            return await self._inline_fallback(payload, reason)
        try:
            buffers = {kind: slot.span for kind, slot in slots.items()}
            if total < THREAD_ABOVE:  # a thread hop costs more than copying this much here
                pack_into(plan, buffers)
            else:
                await anyio.to_thread.run_sync(pack_into, plan, buffers)
        except BaseException:
            ep.pools.release_all(slots)  # type: ignore[union-attr]
            raise
        return self._leased(key, manifest, slots, started)

    async def _put_staged(self, key: str, plan: PackPlan, staging: Staging, started: float) -> Outgoing:
        """The put of a payload the model wrote into ``staging``: copy what it made elsewhere, lease.
        The staging's slots are this put's from here on (released on failure, leased on success)."""
        ep = self._ep
        staging.taken = True
        try:
            if plan.manifest.total_bytes < THREAD_ABOVE or all(
                staging.is_staged(spec, src)
                for spec, src in zip(plan.manifest.tensors, plan.tensors, strict=True)
                if spec.nbytes
            ):
                copied = staging.fill(plan)
            else:
                copied = await anyio.to_thread.run_sync(staging.fill, plan)
        except BaseException:
            ep.pools.release_all(staging.slots)  # type: ignore[union-attr]
            raise
        ep.counters.staged_puts += 1
        ep.counters.staged_copies += copied
        outgoing = self._leased(key, plan.manifest, staging.slots, started)
        return dataclasses.replace(outgoing, staged=True, copied=copied)

    def _leased(self, key: str, manifest: Manifest, slots: dict[DeviceKind, Slot], started: float) -> Outgoing:
        """Put filled ``slots`` under a lease and count the put."""
        ep = self._ep
        total = manifest.total_bytes
        ref = self.lease(key, manifest, slots)
        seconds = time.perf_counter() - started
        ep.counters.puts += 1
        self._puts.inc()
        self._put_bytes.inc(total)
        self._put_seconds.observe(seconds)  # the pool published its usage as the slots were taken
        return Outgoing(ref=ref, blob=None, transport=Transport.NIXL, nbytes=total, seconds=seconds)

    async def acquire(self, manifest: Manifest) -> dict[DeviceKind, Slot]:
        """One pool slot per region of ``manifest``, waiting up to ``pool_wait`` (back-pressure).

        The caller owns the slots until it passes them to :meth:`lease` (or releases them to the pool)."""
        assert self._ep.pools is not None
        return await self._ep.pools.acquire_regions(manifest, timeout=self._ep.timeouts.pool_wait)

    def lease(self, key: str, manifest: Manifest, slots: dict[DeviceKind, Slot]) -> NixlPayload:
        """Put filled ``slots`` under a lease and describe them for the envelope (sealed regions, expiry).

        The lease table owns the slots afterwards."""
        ep = self._ep
        assert ep.agent is not None
        held: Lease = self._leases.hold(key, manifest, slots)
        self._new_lease.set()
        regions = [slots[r.device].remote_region() for r in manifest.regions]
        metadata = base64.b64encode(ep.agent.metadata()).decode() if ep.direct else None
        return NixlPayload(
            manifest=manifest,
            agent=ep.name,
            incarnation=ep.incarnation,
            token=held.token,
            regions=regions,
            lease_expires_at=held.expires_at,
            agent_metadata_b64=metadata,
            seal=self._sealer.seal(ep.name, held.token, regions),
        )

    def abandon(self, outgoing: Outgoing) -> None:
        """The envelope for ``outgoing`` was never handed on: its lease is freed by the expiry loop."""
        if isinstance(outgoing.ref, NixlPayload):
            self._leases.abandon(outgoing.ref.token)

    async def _inline_fallback(self, payload: Payload, reason: str) -> Outgoing:
        """Inline up to the fallback cap; above it NIXL was needed and is not there."""
        try:
            outgoing = await self._ep.inline.encode(payload, fallback_reason=reason)
        except PayloadTooLargeError as exc:
            log.warning("payload.inline_fallback_too_large", reason=reason, details=exc.details)
            raise PayloadUnavailableError(
                f"payload too large for inline fallback ({reason})", reason=reason, **exc.details
            ) from exc
        self._ep.counters.fallback(reason)  # counted once it happened
        log.warning("payload.inline_fallback", reason=reason)
        return outgoing

    # ------------------------------------------------------------------ background loops

    async def run_notifications(self) -> None:
        """The one consumer of NIXL notifications in this process; runs until cancelled.  It drains every
        ``_NOTIF_POLL_S`` while a lease is held; with none, it waits for the next lease (or
        ``_IDLE_POLL_S``).  A first put after an idle spell used to wait out that idle sleep before its
        release was seen: its slot stayed taken up to 50 ms after the READ, and a put that needed it
        waited as long (issue 20: 42 ms Ref2VA copy puts once a pool of four slots was busy)."""
        agent = self._ep.agent
        assert agent is not None
        while True:
            if len(self._leases):
                await anyio.sleep(_NOTIF_POLL_S)
            else:
                with anyio.move_on_after(_IDLE_POLL_S):
                    await self._new_lease.wait()
                self._new_lease = anyio.Event()
            tokens = [
                token
                for messages in agent.drain_notifs().values()
                for message in messages
                if (token := released_token(message)) is not None
            ]
            if tokens:  # every READ this drain found, marked released in one round trip
                await self._leases.settle(*tokens, reason="read_done")

    async def run_resends(self) -> None:
        """Answer consumers that could not READ: send the bytes inline (or refuse), then free the slot."""
        ep = self._ep
        stream = ep.keys.resend(ep.name)
        last = "$"
        while True:
            try:
                with translated():
                    reply = await ep.redis.xread({stream: last}, block=1000, count=16)
            except ControlPlaneError as exc:
                log.warning("nixl.resend_read_failed", error=exc.message)
                await anyio.sleep(0.5)
                continue
            for _s, entries in reply or []:
                for eid, fields in entries:
                    last = eid.decode()
                    await self._answer_resend(fields)
            with contextlib.suppress(ControlPlaneError), translated():
                if reply:
                    await ep.redis.xtrim(stream, minid=last)

    async def _answer_resend(self, fields: dict[bytes, bytes]) -> None:
        """Serve one request; a malformed one or one of another protocol version is logged and skipped
        (its lease, if any, runs out on its own)."""
        try:
            request = ResendRequest.from_fields(fields)
        except HandshakeError as exc:  # ProtocolMismatchError included
            log.warning("nixl.resend_request_refused", code=exc.code, error=exc.message)
            return
        token = request.token
        lease = self._leases.get(token)
        if request.action is ResendAction.DROP or lease is None:
            await self._leases.settle(token, reason="dropped_by_consumer")
            if request.action is ResendAction.RESEND:
                await self._reply(token, None)
            return
        blob = None
        if lease.nbytes <= self._ep.config.inline_fallback_max_bytes:
            blob = await anyio.to_thread.run_sync(lease.concat)
        await self._reply(token, blob)
        await self._leases.settle(token, reason="resent_inline")

    async def _reply(self, token: str, blob: bytes | None) -> None:
        """Answer a resend request: the payload's bytes, or ``None`` for a refusal."""
        ep = self._ep
        key = ep.keys.resend_reply(token)
        with contextlib.suppress(ControlPlaneError), translated():
            async with ep.redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, encode_resend_reply(blob))
                pipe.expire(key, int(ep.timeouts.resend) + 5)
                await pipe.execute()
