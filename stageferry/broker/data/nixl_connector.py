"""The NIXL connector: payloads wait in the producer's registered pool; the consumer READs them.

Producer side (:meth:`NixlConnector.put`): pack the payload into one slot per memory kind of the
pre-registered pool and describe it in the envelope; a *lease* keeps the slot until

* the consumer's READ completes — its notification ``sf-release:<token>`` frees the slot;
* the consumer asks for it inline instead (the resend stream) or drops it — freed after answering;
* the lease runs out *unclaimed* — freed; the producer marks the claim key ``expired`` atomically, so a
  late consumer finds it gone (and recomputes) instead of reading freed memory.  A claimed slot is kept
  until the consumer's claim key expires (the consumer died mid-READ) or its notification arrives.

Consumer side (:meth:`NixlConnector.get`): validate the manifest and descriptors, make sure the
producer's agent is loaded (from Redis, or the envelope in ``direct`` mode; a restarted producer has
a new incarnation and is re-added), claim the payload, READ into the consumer's own pool, unpack as
zero-copy views.  On handshake or transfer failure the producer is asked to resend inline (up to
``inline_fallback_max_bytes``); if the producer is gone, :class:`PayloadUnavailableError` sends the
request back to be recomputed.

Threading: the NIXL agent is not thread-safe; every agent call happens on the event-loop thread (each
is a short, non-blocking call), memory copies run in worker threads.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import redis.asyncio as aioredis
import structlog
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data import metrics
from stageferry.broker.data.connector import Connector, Incoming, Outgoing, Payload
from stageferry.broker.data.inline import THREAD_ABOVE, InlineConnector
from stageferry.broker.data.nixl_agent import NixlAgent, XferState
from stageferry.broker.data.payload_codec import (
    pack_into,
    plan_payload,
    unpack,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.broker.data.pool import PoolSet, Slot
from stageferry.config import DataPlaneConfig, MetadataMode, Timeouts
from stageferry.errors import (
    ControlPlaneError,
    DataPlaneError,
    HandshakeError,
    ManifestError,
    PayloadTooLargeError,
    PayloadUnavailableError,
    PoolExhaustedError,
    TransferError,
)
from stageferry.failpoints import CONSUMER_READ_POSTED, failpoint
from stageferry.schemas import (
    DeviceKind,
    InlinePayload,
    MemKind,
    NixlPayload,
    PayloadRef,
    RemoteRegion,
    Transport,
)

log = structlog.get_logger(__name__)

RELEASE_TAG = b"sf-release:"
#: A freed payload's claim key outlives its lease by this much more than the claim timeout, so that a
#: consumer whose clock runs behind the producer's still finds it gone (and recomputes).
GONE_SLACK_S = 60.0
_NOTIF_POLL_S = 0.002
_LEASE_SCAN_S = 0.25


@dataclass(slots=True)
class Lease:
    """A payload held for a consumer, until released or expired unclaimed."""

    token: str
    slots: dict[DeviceKind, Slot]
    nbytes: int
    expires_at: float
    key: str
    order: tuple[DeviceKind, ...]
    #: Why the slot is to be freed, once its claim key says ``released`` (see ``_settle``).
    settled: str | None = None


@dataclass(frozen=True, slots=True)
class Peer:
    """A producer agent this consumer has loaded."""

    name: str
    incarnation: str
    arenas: tuple[RemoteRegion, ...]
    metadata: bytes
    seal_key: bytes


@dataclass(slots=True)
class Counters:
    """What tests and benchmarks count (not timings)."""

    puts: int = 0
    gets: int = 0
    reads: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)


class NixlConnector(Connector):
    """Both sides of the NIXL data plane for one leader process (one agent, one pool set)."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        stage: str,
        replica: str,
        config: DataPlaneConfig,
        timeouts: Timeouts,
        cuda_device: torch.device | None = None,
        agent: NixlAgent | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.stage = stage
        self.config = config
        self.timeouts = timeouts
        self.incarnation = uuid.uuid4().hex[:16]
        self._seal_key = secrets.token_bytes(32)  # signs this incarnation's descriptors (see lease_seal)
        self.name = f"{stage}-{replica}-{self.incarnation[:8]}"
        self.cuda_device = cuda_device
        self.inline = InlineConnector(
            max_bytes=config.inline_fallback_max_bytes,
            max_payload_bytes=config.max_payload_bytes,
            cuda_device=cuda_device,
        )
        self.agent = agent
        self.pools: PoolSet | None = None
        self.unavailable_reason: str | None = None
        self.leases: dict[str, Lease] = {}
        self.peers: dict[str, Peer] = {}
        self.counters = Counters()
        self._peer_lock = anyio.Lock()
        self._transport_logged: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create the agent and register the pools once (at start-up, not per request).

        If NIXL cannot be loaded the connector still works, inline only, and says why once."""
        try:
            if self.agent is None:
                self.agent = NixlAgent(self.name, backends=self.config.nixl_backends)
            self.pools = PoolSet.from_config(self.config, registrar=self.agent, cuda_device=self.cuda_device)
            metrics.watch_resources(self.resources)
        except DataPlaneError as exc:
            self.agent, self.pools = None, None
            self.unavailable_reason = exc.code
            metrics.HANDSHAKE_FAILURES.labels("agent_unavailable").inc()
            log.error("nixl.unavailable", error=exc.message, fallback="inline")

    def resources(self) -> dict[str, float]:
        """What this process holds right now; at rest: no leases, no slots, one registration per pool."""
        agent, pools = self.agent, self.pools
        return {
            "leases": len(self.leases),
            "pool_slots_in_use": pools.slots_in_use if pools else 0,
            "pool_bytes_in_use": pools.bytes_in_use if pools else 0,
            "pools": len(pools.pools) if pools else 0,
            "registrations": agent.registrations if agent else 0,
            "registered_bytes": agent.registered_bytes if agent else 0,
            "open_handles": agent.open_handles() if agent else 0,
            "remote_agents": len(agent.remotes()) if agent else 0,
        }

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Background duties: agent record heartbeat, notifications, lease expiry, resend requests."""
        if self.agent is None:
            task_status.started()
            return
        await self._publish_record()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            tg.start_soon(self._drain_notifications)
            tg.start_soon(self._expire_leases)
            tg.start_soon(self._serve_resends)
            tg.start_soon(self._sweep_peers)
            task_status.started()

    async def aclose(self) -> None:
        """Drop the agent record, free every lease, release remotes and pools (NIXL's clean-up order)."""
        if self.agent is None:
            return
        with contextlib.suppress(ControlPlaneError), translated():
            await self.redis.delete(self.keys.agent(self.name))
        for token in list(self.leases):
            self._free(token, reason="shutdown")
        for remote in list(self.agent.remotes()):
            self.agent.remove_remote(remote)
        if self.pools is not None:
            self.pools.close()
        self.agent.close()
        self.agent = None

    # ------------------------------------------------------------------ producer side

    async def put(self, key: str, payload: Payload, *, force_inline: bool = False) -> Outgoing:
        started = time.perf_counter()
        plan = plan_payload(payload)
        manifest = plan.manifest
        total = manifest.total_bytes
        if total > self.config.max_payload_bytes:
            raise PayloadTooLargeError(
                "payload above max_payload_bytes", bytes=total, limit=self.config.max_payload_bytes
            )
        if total <= self.config.inline_max_bytes:
            return await self.inline.encode(payload)
        reason = "forced" if force_inline else self.unavailable_reason
        if reason is None:
            assert self.pools is not None
            try:
                slots = await self.pools.acquire_regions(manifest, timeout=self.timeouts.pool_wait)
            except PoolExhaustedError:
                reason = "pool_exhausted"
            except ManifestError:
                reason = "no_pool_for_device"
        if reason is not None:
            return await self._inline_fallback(payload, reason)
        try:
            buffers = {kind: slot.view for kind, slot in slots.items()}
            if total < THREAD_ABOVE:  # a thread hop costs more than copying this much here
                pack_into(plan, buffers)
            else:
                await anyio.to_thread.run_sync(pack_into, plan, buffers)
        except BaseException:
            self.pools.release_all(slots)  # type: ignore[union-attr]
            raise
        token = f"{key}.{uuid.uuid4().hex[:12]}"
        expires = time.time() + self.timeouts.lease
        self.leases[token] = Lease(
            token=token,
            slots=slots,
            nbytes=total,
            expires_at=expires,
            key=key,
            order=tuple(r.device for r in manifest.regions),
        )
        regions = [slots[r.device].remote_region() for r in manifest.regions]
        metadata = base64.b64encode(self.agent.metadata()).decode() if self._direct else None  # type: ignore[union-attr]
        ref = NixlPayload(
            manifest=manifest,
            agent=self.name,
            incarnation=self.incarnation,
            token=token,
            regions=regions,
            lease_expires_at=expires,
            agent_metadata_b64=metadata,
            seal=lease_seal(self._seal_key, self.name, token, regions),
        )
        seconds = time.perf_counter() - started
        self.counters.puts += 1
        metrics.PUTS.labels(Transport.NIXL.value).inc()
        metrics.BYTES.labels("put", Transport.NIXL.value).inc(total)
        metrics.TRANSFER_SECONDS.labels(Transport.NIXL.value, "put").observe(seconds)
        self._publish_pool_usage()
        return Outgoing(ref=ref, blob=None, transport=Transport.NIXL, nbytes=total, seconds=seconds)

    async def _inline_fallback(self, payload: Payload, reason: str) -> Outgoing:
        """Inline up to the fallback cap; above it NIXL was needed and is not there."""
        try:
            outgoing = await self.inline.encode(payload, fallback_reason=reason)
        except PayloadTooLargeError as exc:
            log.warning("payload.inline_fallback_too_large", reason=reason, details=exc.details)
            raise PayloadUnavailableError(
                f"payload too large for inline fallback ({reason})", reason=reason, **exc.details
            ) from exc
        self.counters.fallbacks[reason] = self.counters.fallbacks.get(reason, 0) + 1  # counted once it happened
        log.warning("payload.inline_fallback", reason=reason)
        return outgoing

    def abandon(self, outgoing: Outgoing) -> None:
        """Free an unpublished payload — through the lease loop, which first marks its token gone: after
        a lost reply the hand-off may have been published after all."""
        if isinstance(outgoing.ref, NixlPayload) and outgoing.ref.token in self.leases:
            self.leases[outgoing.ref.token].settled = "abandoned"

    @property
    def _direct(self) -> bool:
        return self.config.metadata_mode is MetadataMode.DIRECT

    async def _settle(self, token: str, *, reason: str) -> None:
        """Free a slot that a consumer is done with (READ complete, sent inline, dropped), but mark its
        claim key ``released`` first: the envelope naming it may be delivered again (its consumer died
        after the READ, before acknowledging), and that consumer must find the payload gone instead of
        claiming anew and READing memory that now holds another payload.  If Redis is away the slot
        stays held; the lease loop retries."""
        lease = self.leases.get(token)
        if lease is None:
            return
        lease.settled = reason
        if await self._mark_gone(lease, b"released", overwrite=True):
            self._free(token, reason=reason)

    async def _mark_gone(self, lease: Lease, value: bytes, *, overwrite: bool) -> bool:
        """Set the lease's claim key to ``value`` until no consumer may still try it (the lease's end
        plus slack); with ``overwrite`` False only if nobody claimed it.  False if not set."""
        ttl_ms = int((max(0.0, lease.expires_at - time.time()) + self.timeouts.claim + GONE_SLACK_S) * 1000)
        try:
            with translated():
                return bool(await self.redis.set(self.keys.claim(lease.token), value, nx=not overwrite, px=ttl_ms))
        except ControlPlaneError as exc:
            log.warning("payload.mark_gone_failed", error=exc.message)
            return False

    def _free(self, token: str, *, reason: str) -> bool:
        lease = self.leases.pop(token, None)
        if lease is None:
            return False
        if self.pools is not None:
            self.pools.release_all(lease.slots)
        log.debug("payload.slot_freed", token=token, reason=reason, bytes=lease.nbytes)
        self._publish_pool_usage()
        return True

    def _publish_pool_usage(self) -> None:
        if self.pools is not None:
            for kind, pool in self.pools.pools.items():
                metrics.POOL_BYTES_IN_USE.labels(kind.value).set(pool.bytes_in_use)

    async def _publish_record(self) -> None:
        assert self.agent is not None and self.pools is not None
        record = {
            "name": self.name,
            "stage": self.stage,
            "incarnation": self.incarnation,
            "metadata": self.agent.metadata(),
            "arenas": json.dumps([a.model_dump(mode="json") for a in self.pools.arenas()]),
            "seal_key": self._seal_key.hex(),
            "started_at": str(time.time()),
        }
        key = self.keys.agent(self.name)
        with translated():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record)
                pipe.pexpire(key, int(self.config.agent_ttl_s * 1000))
                await pipe.execute()

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(self.config.agent_heartbeat_s)
            try:
                with translated():
                    alive = await self.redis.pexpire(self.keys.agent(self.name), int(self.config.agent_ttl_s * 1000))
                if not alive:  # Redis restarted without our record
                    await self._publish_record()
            except ControlPlaneError as exc:
                log.warning("nixl.heartbeat_failed", error=exc.message)

    async def _drain_notifications(self) -> None:
        """The one consumer of NIXL notifications in this process."""
        assert self.agent is not None
        while True:
            await anyio.sleep(_NOTIF_POLL_S if self.leases else 0.05)
            for _remote, messages in self.agent.drain_notifs().items():
                for message in messages:
                    if message.startswith(RELEASE_TAG):
                        await self._settle(message[len(RELEASE_TAG) :].decode(errors="replace"), reason="read_done")

    async def _expire_leases(self) -> None:
        """Free leases that ran out unclaimed (a claimed one waits for its claim to expire), and settled
        ones whose claim key could not be marked yet."""
        while True:
            await anyio.sleep(_LEASE_SCAN_S)
            now = time.time()
            for token, lease in list(self.leases.items()):
                if lease.settled is not None:
                    if await self._mark_gone(lease, b"released", overwrite=True):
                        self._free(token, reason=lease.settled)
                elif lease.expires_at <= now and await self._mark_gone(lease, b"expired", overwrite=False):
                    self._free(token, reason="lease_expired")

    async def _serve_resends(self) -> None:
        """Answer consumers that could not READ: send the bytes inline (or refuse), then free the slot."""
        stream = self.keys.resend(self.name)
        last = "$"
        while True:
            try:
                with translated():
                    reply = await self.redis.xread({stream: last}, block=1000, count=16)
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
                    await self.redis.xtrim(stream, minid=last)

    async def _answer_resend(self, fields: dict[bytes, bytes]) -> None:
        token = fields.get(b"token", b"").decode(errors="replace")
        action = fields.get(b"action", b"resend")
        lease = self.leases.get(token)
        if action != b"resend" or lease is None:
            await self._settle(token, reason="dropped_by_consumer")
            if action == b"resend":
                await self._reply(token, b"")
            return
        blob = b""
        if lease.nbytes <= self.config.inline_fallback_max_bytes:
            blob = await anyio.to_thread.run_sync(_concat_regions, lease)
        await self._reply(token, blob)
        await self._settle(token, reason="resent_inline")

    async def _reply(self, token: str, blob: bytes) -> None:
        key = self.keys.resend_reply(token)
        with contextlib.suppress(ControlPlaneError), translated():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, b"\x01" + blob if blob else b"\x00")
                pipe.expire(key, int(self.timeouts.resend) + 5)
                await pipe.execute()

    # ------------------------------------------------------------------ consumer side

    @contextlib.asynccontextmanager
    async def get(self, ref: PayloadRef, blob: bytes | None, *, key: str) -> AsyncIterator[Incoming]:
        slots: dict[DeviceKind, Slot] = {}
        try:
            incoming, slots = await self._fetch(ref, blob, key)
            self._count_get(incoming)
            yield incoming
        finally:
            if slots and self.pools is not None:
                if DeviceKind.CUDA in slots:  # kernels queued on the payload must finish before reuse
                    await anyio.to_thread.run_sync(torch.cuda.synchronize, slots[DeviceKind.CUDA].view.device)
                self.pools.release_all(slots)

    async def _fetch(self, ref: PayloadRef, blob: bytes | None, key: str) -> tuple[Incoming, dict[DeviceKind, Slot]]:
        """The payload and the local slots it lives in (empty when it came inline)."""
        if isinstance(ref, InlinePayload):
            return await self.inline.decode(ref, blob), {}
        if not isinstance(ref, NixlPayload):
            raise ManifestError(f"cannot fetch a {ref.kind!r} payload", kind=ref.kind)
        validate_manifest(ref.manifest, max_payload_bytes=self.config.max_payload_bytes)
        if self.agent is None or self.pools is None:
            return await self._resend_inline(ref, reason=self.unavailable_reason or "nixl_unavailable"), {}
        started = time.perf_counter()
        try:
            peer = await self._ensure_peer(ref)
        except HandshakeError as exc:
            metrics.HANDSHAKE_FAILURES.labels(exc.code).inc()
            log.warning("nixl.handshake_failed", key=key, error=exc.message)
            return await self._resend_inline(ref, reason="handshake_failed"), {}
        except TimeoutError:
            metrics.HANDSHAKE_FAILURES.labels("timeout").inc()
            return await self._resend_inline(ref, reason="handshake_timeout"), {}
        validate_remote_regions(ref.manifest, ref.regions, peer.arenas)
        if not hmac.compare_digest(ref.seal, lease_seal(peer.seal_key, ref.agent, ref.token, ref.regions)):
            # In the producer's pool but not what it leased under this token: another request's slot.
            raise ManifestError("descriptors are not the ones the producer leased", agent=ref.agent, token=ref.token)
        await self._claim(ref)
        try:
            slots = await self.pools.acquire_regions(ref.manifest, timeout=self.timeouts.pool_wait)
        except PoolExhaustedError:
            return await self._resend_inline(ref, reason="pool_exhausted"), {}
        try:
            await self._read(ref, peer, slots)
            payload = unpack(ref.manifest, {kind: slot.view for kind, slot in slots.items()}, copy=False)
        except TransferError as exc:
            metrics.TRANSFER_FAILURES.labels(exc.code).inc()
            log.warning("nixl.read_failed", key=key, error=exc.message, peer=peer.name)
            # Drop the peer on any failure, a timeout too, and before the slots go back to the pool: its
            # endpoint may be broken (a cut link) and must not deliver late bytes into a reused slot; the
            # next payload from it re-adds it from fresh metadata.
            self._forget_peer(peer.name)
            self.pools.release_all(slots)
            return await self._resend_inline(ref, reason="transfer_failed"), {}
        except BaseException:
            self.pools.release_all(slots)
            raise
        seconds = time.perf_counter() - started
        regions = {kind: slot.view for kind, slot in slots.items()}  # a TP group fans these out as they are
        incoming = Incoming(
            payload=payload,
            transport=Transport.NIXL,
            nbytes=ref.manifest.total_bytes,
            seconds=seconds,
            manifest=ref.manifest,
            regions=regions,
        )
        return incoming, slots

    def _count_get(self, incoming: Incoming) -> None:
        """Count a get; inline gets are counted by the inline connector's metrics already."""
        self.counters.gets += 1
        if incoming.transport is Transport.NIXL:
            metrics.GETS.labels(Transport.NIXL.value).inc()
            metrics.BYTES.labels("get", Transport.NIXL.value).inc(incoming.nbytes)
            metrics.TRANSFER_SECONDS.labels(Transport.NIXL.value, "get").observe(incoming.seconds)

    async def discard(self, ref: PayloadRef) -> None:
        """Tell the producer that a payload will never be read (the request was settled meanwhile)."""
        if isinstance(ref, NixlPayload):
            with contextlib.suppress(ControlPlaneError), translated():
                await self._ask_producer(ref, "drop")

    async def _ask_producer(self, ref: NixlPayload, action: str) -> None:
        """Post a resend/drop request; the stream expires once no lease could still need it, so a
        producer that died leaves nothing behind in Redis."""
        stream = self.keys.resend(ref.agent)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(stream, {"token": ref.token, "action": action})
            pipe.expire(stream, int(self.timeouts.lease + self.timeouts.resend) + 60)
            await pipe.execute()

    async def _ensure_peer(self, ref: NixlPayload) -> Peer:
        """The producer's agent, loaded once per incarnation; metadata only from our own prefix.

        A name that does not carry its incarnation, or envelope metadata that differs from the agent's
        record, is a hostile or corrupted descriptor (:class:`ManifestError`); a well-formed agent
        without a record has gone away (:class:`PayloadUnavailableError`: recompute)."""
        if not ref.agent.endswith(f"-{ref.incarnation[:8]}"):
            raise ManifestError("agent name does not match its incarnation", agent=ref.agent)
        claimed = None if ref.agent_metadata_b64 is None else _b64(ref.agent_metadata_b64)
        if ref.agent_metadata_b64 is not None and claimed is None:
            raise ManifestError("agent metadata is not base64", agent=ref.agent)
        peer = self.peers.get(ref.agent)
        if peer is None or peer.incarnation != ref.incarnation:
            async with self._peer_lock:
                peer = self.peers.get(ref.agent)
                if peer is None or peer.incarnation != ref.incarnation:
                    peer = await self._load_peer(ref)
        if claimed is not None and claimed != peer.metadata:
            raise ManifestError("envelope metadata differs from the registered agent", agent=ref.agent)
        return peer

    async def _load_peer(self, ref: NixlPayload) -> Peer:
        if ref.agent in self.peers:
            self._forget_peer(ref.agent)
        with anyio.fail_after(self.timeouts.handshake):
            record = await self._agent_record(ref.agent)
        if record is None:
            raise PayloadUnavailableError("producer agent is gone", agent=ref.agent)
        if record.get(b"name") != ref.agent.encode() or record.get(b"incarnation") != ref.incarnation.encode():
            raise ManifestError("agent record does not match the envelope", agent=ref.agent)
        metadata = record[b"metadata"]
        arenas = _parse_arenas(record.get(b"arenas", b"[]"))
        try:
            seal_key = bytes.fromhex(record.get(b"seal_key", b"").decode())
        except ValueError:
            seal_key = b""
        if len(seal_key) != 32:
            raise ManifestError("agent record has no valid seal key", agent=ref.agent)
        assert self.agent is not None
        try:
            name = self.agent.add_remote(metadata)
        except DataPlaneError as exc:
            raise HandshakeError(f"cannot load agent {ref.agent}: {exc.message}", agent=ref.agent) from exc
        if name != ref.agent:
            self.agent.remove_remote(name)
            raise HandshakeError("agent metadata names another agent", agent=ref.agent, metadata_name=name)
        peer = Peer(name=name, incarnation=ref.incarnation, arenas=arenas, metadata=metadata, seal_key=seal_key)
        self.peers[name] = peer
        return peer

    async def _sweep_peers(self) -> None:
        """Forget producers whose record is gone (they exited or died): remote agents return to baseline."""
        while True:
            await anyio.sleep(self.config.agent_ttl_s)
            for name in list(self.peers):
                try:
                    with translated():
                        alive = await self.redis.exists(self.keys.agent(name))
                except ControlPlaneError:
                    break
                if not alive:
                    log.info("nixl.peer_gone", peer=name)
                    self._forget_peer(name)

    async def _agent_record(self, name: str) -> dict[bytes, bytes] | None:
        with translated():
            record = await self.redis.hgetall(self.keys.agent(name))
        if not record or b"metadata" not in record:
            return None
        return record

    def _forget_peer(self, name: str) -> None:
        self.peers.pop(name, None)
        if self.agent is not None:
            self.agent.remove_remote(name)

    async def _claim(self, ref: NixlPayload) -> None:
        """Claim before reading, so the producer never frees the slot under our READ.

        Around the lease's end the claim key arbitrates (the producer marks it ``expired`` only if
        nobody claimed it).  Its markers ``expired``/``released`` outlive the lease by at least
        ``GONE_SLACK_S``; later than half that past the lease, a missing key no longer proves anything,
        so the payload counts as gone."""
        if time.time() > ref.lease_expires_at + GONE_SLACK_S / 2:
            raise PayloadUnavailableError("payload lease ran out long ago", token=ref.token)
        with translated():
            ok = await self.redis.set(
                self.keys.claim(ref.token), self.name.encode(), nx=True, px=int(self.timeouts.claim * 1000)
            )
        if not ok:
            raise PayloadUnavailableError("payload lease expired or already claimed", token=ref.token)

    async def _read(self, ref: NixlPayload, peer: Peer, slots: dict[DeviceKind, Slot]) -> None:
        """READ every non-empty region; the last READ carries the release notification."""
        assert self.agent is not None
        pairs = [(spec, remote) for spec, remote in zip(ref.manifest.regions, ref.regions, strict=True) if spec.nbytes]
        deadline = time.monotonic() + self.timeouts.transfer
        for i, (spec, remote) in enumerate(pairs):
            local = slots[spec.device]
            notif = RELEASE_TAG + ref.token.encode() if i == len(pairs) - 1 else b""
            handle = self.agent.start_read(
                [(local.address, spec.nbytes, local.device_id)],
                mem_kind_of(spec.device),
                [(remote.address, remote.length, remote.device_id)],
                remote.mem_kind,
                peer.name,
                notif,
            )
            failpoint(CONSUMER_READ_POSTED)  # fault injection: die with the READ in flight
            try:
                await self._wait_done(handle, deadline)
            finally:
                self.agent.release(handle)
        self.counters.reads += 1
        if peer.name not in self._transport_logged:
            self._transport_logged.add(peer.name)
            transport = self.agent.transport_info(peer.name)
            vram = any(r.mem_kind is MemKind.VRAM for r in ref.regions)
            level = "warning" if vram and transport and "tcp" in transport.lower() else "info"
            getattr(log, level)(
                "nixl.transport", peer=peer.name, transport=transport or "unknown (set UCX_PROTO_INFO=y)"
            )
        if not pairs:  # zero-size payload: nothing to READ, release the producer explicitly
            await self.discard(ref)

    async def _wait_done(self, handle: object, deadline: float) -> None:
        """Poll to completion: spin (yielding) briefly for small payloads, then sleep-poll."""
        assert self.agent is not None
        spins = 0
        while self.agent.poll(handle) is not XferState.DONE:
            if time.monotonic() > deadline:
                raise TransferError("READ timed out", seconds=self.timeouts.transfer)
            spins += 1
            await anyio.sleep(0 if spins < 200 else 0.0005)

    async def _resend_inline(self, ref: NixlPayload, *, reason: str) -> Incoming:
        """Ask the producer to send the payload inline; it is gone if nobody answers in time."""
        started = time.perf_counter()
        reply_key = self.keys.resend_reply(ref.token)
        with translated():
            await self._ask_producer(ref, "resend")
            reply = await self.redis.blpop([reply_key], timeout=self.timeouts.resend)
        if not reply or reply[1][:1] != b"\x01":
            raise PayloadUnavailableError("producer could not resend the payload", reason=reason, agent=ref.agent)
        metrics.FALLBACKS.labels(reason).inc()
        self.counters.fallbacks[reason] = self.counters.fallbacks.get(reason, 0) + 1
        log.warning("payload.inline_fallback", reason=reason, side="consumer")
        inline_ref = InlinePayload(manifest=ref.manifest, blob_bytes=len(reply[1]) - 1, fallback_reason=reason)
        incoming = await self.inline.decode(inline_ref, reply[1][1:])
        return Incoming(
            payload=incoming.payload,
            transport=Transport.INLINE,
            nbytes=incoming.nbytes,
            seconds=time.perf_counter() - started,
            fallback_reason=reason,
        )


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return None


def mem_kind_of(device: DeviceKind) -> MemKind:
    return MemKind.VRAM if device is DeviceKind.CUDA else MemKind.DRAM


def _concat_regions(lease: Lease) -> bytes:
    """The slot bytes in manifest order (the inline form), for a resend."""
    parts = [lease.slots[k].view.cpu().numpy().tobytes() for k in lease.order]
    return b"".join(parts)


def _parse_arenas(raw: bytes) -> tuple[RemoteRegion, ...]:
    try:
        items = json.loads(raw)
        if not isinstance(items, list) or len(items) > 8:
            raise ValueError("arenas must be a short list")
        return tuple(RemoteRegion.model_validate(item) for item in items)
    except ValueError as exc:
        raise HandshakeError(f"agent record has invalid arenas: {exc}") from exc


def lease_seal(key: bytes, agent: str, token: str, regions: list[RemoteRegion]) -> str:
    """The producer's HMAC over a lease: its agent, token and exact regions (address, length, device, kind).

    The consumer checks it with the key from the producer's agent record (readable only by stages under
    the ACL), so a forged or shifted descriptor that still lies inside the producer's pool — another
    request's slot — is refused before any READ."""
    body = json.dumps(
        [agent, token, [[r.address, r.length, r.device_id, r.mem_kind.value] for r in regions]], separators=(",", ":")
    )
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
