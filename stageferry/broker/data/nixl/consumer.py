"""Consumer side of the NIXL data plane: claim a payload, READ it into our own pool, unpack it.

Who calls what, and when (the consumer leader only):

* ``async with consumer.get(ref, blob, key=..., claimed=...) as incoming`` — once per envelope.  In
  order: validate the manifest; make sure the producer's agent is loaded
  (:mod:`stageferry.broker.data.nixl.peers`); check the descriptors lie in the producer's arenas and carry
  its seal; take slots of our own pool (or those made ready for this shape while we were idle, views
  included: :mod:`stageferry.broker.data.nixl.ready`); post a READ per region, all at once, and claim the
  lease (:func:`stageferry.broker.data.nixl.leases.claim`) while they run — unless the stage's stream read
  claimed it already (``claimed=True``, :func:`~stageferry.broker.data.nixl.leases.claim_on_read`; False:
  it found the lease taken, and the payload counts as gone); once the claim is won, unpack as zero-copy
  views over our slots while the READs still run (views need no bytes, and nothing sees them before
  the READs are DONE); once every READ is DONE, notify the producer (the release that frees its slot).
  See :meth:`Consumer.read` for why reading before the claim is won is safe.
  Inside the block ``incoming.payload`` and ``incoming.regions`` are views of our pool slots; on exit the
  slots go back to the pool (after a CUDA synchronize, so queued kernels finish first).  Nothing may
  keep a view past the block.  A get cancelled with READs in flight gives its slots back only once no
  READ can still write into them (:meth:`Consumer._settle_cancelled`).
* A producer on our own GPU (same GPU UUID, its CUDA arena mapped): the CUDA regions are copied device to
  device instead of READ, with the same checks, claim and release (:meth:`Consumer._copy_or_read`,
  :mod:`stageferry.broker.data.nixl.same_gpu`); any failure there falls back to the READ.
* On handshake or transfer failure the producer is asked to resend inline (:meth:`Consumer.resend_inline`,
  up to ``inline_fallback_max_bytes``); if it cannot, :class:`PayloadUnavailableError` sends the request
  back to be recomputed.  Descriptors that fail validation raise :class:`ManifestError` before any
  native call.
* :meth:`Consumer.discard` — the request was settled meanwhile: tell the producer to drop the payload.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
import structlog
import torch

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Incoming
from stageferry.broker.data.nixl.agent import XferState
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import check_fresh, claim
from stageferry.broker.data.nixl.peers import Peer, Peers
from stageferry.broker.data.nixl.ready import ReadySlots
from stageferry.broker.data.nixl.same_gpu import SameGpu, copied_route
from stageferry.broker.data.nixl.ucx_log import transport_names
from stageferry.broker.data.payload_codec import unpack, validate_manifest, validate_remote_regions
from stageferry.broker.data.pool import Slot
from stageferry.errors import (
    ControlPlaneError,
    HandshakeError,
    ManifestError,
    PayloadUnavailableError,
    PoolExhaustedError,
    ProtocolMismatchError,
    TransferError,
)
from stageferry.failpoints import CONSUMER_READ_POSTED, failpoint
from stageferry.schemas import (
    DeviceKind,
    InlinePayload,
    MemKind,
    NixlPayload,
    PayloadRef,
    RegionSpec,
    RemoteRegion,
    Transport,
)
from stageferry.schemas.nixl import (
    ResendAction,
    ResendRequest,
    decode_resend_reply,
    lease_seal,
    release_notification,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")


#: How long :meth:`Consumer._wait_all` yields without sleeping, and how long it then sleeps between looks.
#: An event-loop sleep is never shorter than a millisecond (asyncio's epoll selector rounds its timeout
#: up to whole milliseconds), so a shorter POLL_S would still cost 1 ms: a READ that ends just after the
#: spin gave up paid that much on top of the hop (the hop's p99 on the GPU host, issue 20).  The spin
#: covers what a READ of a hop's payload takes once posted (VRAM over cuda_ipc: 0.1–0.3 ms for 65 MB).
SPIN_S = 0.002
POLL_S = 0.001
#: First, the READ wait polls this long without going back to the event loop at all: a small READ
#: (VRAM over cuda_ipc: tens of µs) is then seen DONE in the same turn, without a loop round of its own.
HOLD_S = 0.0001


def lane_spans(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``lanes`` near-equal pieces of ``nbytes`` (4 KiB-aligned cuts; fewer pieces
    when the region is too small for that many)."""
    step = max(4096, -(-nbytes // max(1, lanes) // 4096) * 4096)
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)] or [(0, 0)]


def mem_kind_of(device: DeviceKind) -> MemKind:
    return MemKind.VRAM if device is DeviceKind.CUDA else MemKind.DRAM


def _where(kind: MemKind, device_id: int) -> str:
    return f"VRAM:{device_id}" if kind is MemKind.VRAM else kind.value


class Consumer:
    """The get side of one leader's connector."""

    def __init__(self, endpoint: Endpoint, peers: Peers) -> None:
        self._ep = endpoint
        self._peers = peers
        self.ready = ReadySlots(endpoint)
        self.same_gpu = SameGpu(endpoint)
        self._transport_logged: set[str] = set()
        self.wakeups = 0  #: times a READ wait went back to the event loop (benchmarks show it per hop)

    @contextlib.asynccontextmanager
    async def get(
        self, ref: PayloadRef, blob: bytes | None, *, key: str, claimed: bool | None = None
    ) -> AsyncIterator[Incoming]:
        """See the module docstring."""
        slots: dict[DeviceKind, Slot] = {}
        try:
            incoming, slots = await self._fetch(ref, blob, key, claimed)
            self._count_get(incoming)
            yield incoming
        finally:
            pools = self._ep.pools
            if slots and pools is not None:
                if DeviceKind.CUDA in slots:  # kernels queued on the payload must finish before reuse
                    with anyio.CancelScope(shield=True):  # a cancelled block still waits, or the slots leak
                        await anyio.to_thread.run_sync(torch.cuda.synchronize, slots[DeviceKind.CUDA].view.device)
                pools.release_all(slots)
                if isinstance(ref, NixlPayload):  # the next payload of this shape, made while we are idle
                    self.ready.want(ref.manifest)

    async def claim(self, ref: NixlPayload, claimed: bool | None = None) -> None:
        """Claim ``ref``'s lease (see :func:`stageferry.broker.data.nixl.leases.claim`), unless the stream
        read did (``claimed`` True; False: it found the lease taken)."""
        if claimed is None:
            await claim(self._ep, ref)
        elif not claimed:
            raise PayloadUnavailableError("payload lease expired or already claimed", token=ref.token)

    async def discard(self, ref: PayloadRef) -> None:
        """Tell the producer that a payload will never be read (the request was settled meanwhile)."""
        if isinstance(ref, NixlPayload):
            with contextlib.suppress(ControlPlaneError), translated():
                await self._ask_producer(ref, ResendAction.DROP)

    async def _fetch(
        self, ref: PayloadRef, blob: bytes | None, key: str, claimed: bool | None
    ) -> tuple[Incoming, dict[DeviceKind, Slot]]:
        """The payload and the local slots it lives in (empty when it came inline)."""
        ep = self._ep
        if isinstance(ref, InlinePayload):
            return await ep.inline.decode(ref, blob), {}
        if not isinstance(ref, NixlPayload):
            raise ManifestError(f"cannot fetch a {ref.kind!r} payload", kind=ref.kind)
        validate_manifest(ref.manifest, max_payload_bytes=ep.config.max_payload_bytes)
        if claimed is False:  # the stream read found the lease taken: not ours to read, nor to ask for
            await self.claim(ref, claimed)
        if ep.agent is None or ep.pools is None:
            return await self.resend_inline(ref, reason=ep.unavailable_reason or "nixl_unavailable"), {}
        pools = ep.pools
        started = time.perf_counter()
        try:
            peer = await self._peers.ensure(ref)
        except ProtocolMismatchError as exc:
            # Its resend service speaks another protocol too: no inline resend from it.  Raised on, the
            # request is computed again upstream and sent inline (which needs no side channel).
            metrics.HANDSHAKE_FAILURES.labels(exc.code).inc()
            log.error("nixl.protocol_mismatch", key=key, error=exc.message, **exc.details)
            raise
        except HandshakeError as exc:
            metrics.HANDSHAKE_FAILURES.labels(exc.code).inc()
            log.warning("nixl.handshake_failed", key=key, error=exc.message)
            return await self.resend_inline(ref, reason="handshake_failed"), {}
        except TimeoutError:
            metrics.HANDSHAKE_FAILURES.labels("timeout").inc()
            return await self.resend_inline(ref, reason="handshake_timeout"), {}
        validate_remote_regions(ref.manifest, ref.regions, peer.arenas)
        if not hmac.compare_digest(ref.seal, lease_seal(peer.seal_key, ref.agent, ref.token, ref.regions)):
            # In the producer's pool but not what it leased under this token: another request's slot.
            raise ManifestError("descriptors are not the ones the producer leased", agent=ref.agent, token=ref.token)
        check_fresh(ref)
        ready = self.ready.take(ref.manifest)  # slots and views made while idle, for this very structure
        if ready is not None:
            slots, views = ready.slots, ready.views
        else:
            try:
                slots = await pools.acquire_regions(ref.manifest, timeout=ep.timeouts.pool_wait)
            except PoolExhaustedError:
                await self.claim(ref, claimed)  # ours before its producer is asked for it inline
                return await self.resend_inline(ref, reason="pool_exhausted"), {}
            buffers = {kind: slot.view for kind, slot in slots.items()}
            views = functools.partial(unpack, ref.manifest, buffers, copy=False)
        try:  # claims the lease, and makes the payload's views over our slots, while the READs run
            payload, copied = await self._copy_or_read(ref, peer, slots, claimed, meanwhile=views)
        except TransferError as exc:
            metrics.TRANSFER_FAILURES.labels(exc.code).inc()
            log.warning("nixl.read_failed", key=key, error=exc.message, peer=peer.name)
            # Drop the peer on any failure, a timeout too, and before the slots go back to the pool: its
            # endpoint may be broken (a cut link) and must not deliver late bytes into a reused slot; the
            # next payload from it re-adds it from fresh metadata.
            self._peers.forget(peer.name)
            pools.release_all(slots)
            return await self.resend_inline(ref, reason="transfer_failed"), {}
        except BaseException:
            pools.release_all(slots)
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
            route=copied_route(ref, slots) if copied else self._route(ref, peer, slots),
        )
        log.info(
            "payload.get",
            key=key,
            transport=Transport.NIXL.value,
            bytes=incoming.nbytes,
            seconds=round(seconds, 6),
            peer=peer.name,
            source=peer.address,  # the producer's advertised IP, and ours: both ends of the hop
            destination=ep.address,
            route=incoming.route,
        )
        return incoming, slots

    async def _copy_or_read(
        self,
        ref: NixlPayload,
        peer: Peer,
        slots: dict[DeviceKind, Slot],
        claimed: bool | None,
        meanwhile: Callable[[], T] | None = None,
    ) -> tuple[T | None, bool]:
        """The same-GPU copy when the producer is on our GPU (:mod:`~stageferry.broker.data.nixl.same_gpu`),
        else :meth:`read`; whether it was copied.  The copy keeps the READ's order of duties: the claim
        first (won, or the stream read's), then the bytes, then ``meanwhile()``, then the release
        notification.  A copy that fails is logged and the READ follows, with the claim already ours."""
        if not self.same_gpu.usable(ref, peer.ipc, slots):
            return await self.read(ref, peer, slots, claimed, meanwhile=meanwhile), False
        assert peer.ipc is not None
        await self.claim(ref, claimed)
        try:
            done = self.same_gpu.launch(ref, peer.ipc, slots)
        except TransferError as exc:
            log.warning("nixl.same_gpu_fallback", peer=peer.name, token=ref.token, error=exc.message, fallback="nixl")
            return await self.read(ref, peer, slots, True, meanwhile=meanwhile), False
        made: T | None = None
        try:
            # The payload's views over our slots are made while the copy runs, as a READ makes them.
            made = meanwhile() if meanwhile is not None else None
            await self.same_gpu.wait(done)
        except TransferError as exc:
            log.warning("nixl.same_gpu_fallback", peer=peer.name, token=ref.token, error=exc.message, fallback="nixl")
            return await self.read(ref, peer, slots, True, meanwhile=meanwhile), False
        except BaseException:  # the copy has ended (shielded wait, or it never ran): free the producer's slot
            with anyio.CancelScope(shield=True), contextlib.suppress(ControlPlaneError):
                await self._release_producer(ref, peer)
            raise
        await self._release_producer(ref, peer)
        self._ep.counters.reads += 1
        self._ep.counters.same_gpu += 1
        return made, True

    def _route(self, ref: NixlPayload, peer: Peer, slots: dict[DeviceKind, Slot]) -> str:
        """Each region's memory on both sides and the UCX transport that READ it (``?`` when UCX did
        not say): ``VRAM:0→VRAM:1 cuda_ipc, DRAM→DRAM cma``.  Kept per peer and layout once every
        transport is known (a peer loaded again starts afresh)."""
        agent = self._ep.agent
        assert agent is not None
        pairs = [(spec, remote) for spec, remote in zip(ref.manifest.regions, ref.regions, strict=True) if spec.nbytes]
        layout = tuple((s.device, r.mem_kind, r.device_id, slots[s.device].device_id) for s, r in pairs)
        known = peer.routes.get(layout)
        if known is not None:
            return known
        parts = []
        for spec, remote in pairs:
            kind, local = mem_kind_of(spec.device), slots[spec.device]
            names = transport_names(agent.transport_info(peer.name, kind, remote.mem_kind)) or ["?"]
            where = _where(remote.mem_kind, remote.device_id), _where(kind, local.device_id)
            parts.append(f"{where[0]}→{where[1]} {'+'.join(names)}")
        route = ", ".join(parts)
        if not any(part.endswith(" ?") for part in parts):
            peer.routes[layout] = route
        return route

    def _count_get(self, incoming: Incoming) -> None:
        """Count a get; inline gets are counted by the inline connector's metrics already."""
        self._ep.counters.gets += 1
        if incoming.transport is Transport.NIXL:
            metrics.GETS.labels(Transport.NIXL.value).inc()
            metrics.BYTES.labels("get", Transport.NIXL.value).inc(incoming.nbytes)
            metrics.TRANSFER_SECONDS.labels(Transport.NIXL.value, "get").observe(incoming.seconds)

    async def read(
        self,
        ref: NixlPayload,
        peer: Peer,
        slots: dict[DeviceKind, Slot],
        claimed: bool | None = None,
        meanwhile: Callable[[], T] | None = None,
    ) -> T | None:
        """Claim ``ref``'s lease while READing all its regions into ``slots`` (ours, already taken), then
        release the producer's slot.  The hop waits for the longer of the claim's round trip and the READs,
        not for their sum; with ``claimed`` (the stream read's claim, :meth:`claim`) there is no round trip.
        Once the claim is won, ``meanwhile()`` runs while the READs do (the unpack: views over our slots,
        which need no bytes yet) and its result is returned; if it raises, the READs are waited for first,
        so no READ still writes into the slots the caller then gives back.

        In order: post one READ per non-empty region, all at once and without a notification; claim
        (Redis ``SET NX``) while they run; wait until every READ is DONE; only then notify the producer
        (:meth:`NixlAgent.notify`), so the release is sent once, by the claim's winner, after the bytes
        arrived.  Why reading before the claim is won is safe: a READ changes nothing on the producer;
        if the claim is won, the producer had not marked the claim key ``released``/``expired`` before it,
        and it frees a slot only after that mark, so the slot held this payload throughout; if the claim
        is lost, our copy is never unpacked nor handed on and nothing is notified.  A payload the stream
        read claimed already (``claimed`` True) in one region is the common case: its READ carries the
        release notification, which NIXL sends once the bytes are here, so no notify call follows the
        wait (if the wait times out anyway, the inline resend it asks for may find the lease settled and
        be refused: the request is computed again upstream).

        What overlaps: an asynchronous READ (VRAM over cuda_ipc; DRAM when UCX's progress thread moves it)
        runs during the claim's round trip.  On CPU, UCX's CMA copies inside the post call, so there the
        claim follows the copy; sending the claim first from a task of its own was measured slower
        (a task group and redis-py's send path cost more event-loop time than the wait they hide:
        ``benchmarks/results/issue20_hop``).

        Raises the claim's :class:`PayloadUnavailableError` / ``ControlPlaneError`` when it is lost (after
        the READs ended: they write into ``slots``; the peer is dropped if they failed), and
        :class:`TransferError` when a READ failed (to post or to complete) with the claim won (the caller
        drops the peer and asks for an inline resend, which settles the lease).  The claim is always
        settled first: a consumer that did not win it must never ask the producer for the payload, whose
        resend frees the slot, perhaps under the winner's READ."""
        agent = self._ep.agent
        assert agent is not None
        pairs = [(spec, remote) for spec, remote in zip(ref.manifest.regions, ref.regions, strict=True) if spec.nbytes]
        if not pairs:  # zero-size payload: nothing to READ, release the producer explicitly
            await self.claim(ref, claimed)
            await self.discard(ref)
            return meanwhile() if meanwhile is not None else None
        deadline = time.monotonic() + self._ep.timeouts.transfer
        # Claimed already and one READ: it carries the release itself (NIXL sends it once the bytes are
        # here).  Several READs each send their own notification on completion, so those are released
        # by one notification after the last of them instead.
        carried = release_notification(ref.token) if claimed is True and len(pairs) == 1 else b""
        handles: list[object] = []
        post_failed: TransferError | None = None
        won = False  # the claim is ours: only then may the producer be released
        try:
            try:
                for spec, remote in pairs:
                    handles.append(self._post(spec, remote, slots[spec.device], peer, carried))
            except TransferError as exc:  # raised once the claim is ours: only its winner may ask for a resend
                post_failed = exc
            failpoint(CONSUMER_READ_POSTED)  # fault injection: die with the READs in flight
            try:
                await self.claim(ref, claimed)
            except (PayloadUnavailableError, ControlPlaneError):
                try:  # our slots go back to the pool: no READ may still be writing into them
                    await self._wait_all(handles, deadline)
                except TransferError:
                    self._peers.forget(peer.name)
                raise
            won = True
            if post_failed is not None:
                raise post_failed
            made = None
            if meanwhile is not None:
                try:
                    made = meanwhile()
                except BaseException:  # the caller's error is the one raised, after the READs ended
                    await self._end_reads(ref, peer, handles, deadline, released=bool(carried))
                    raise
            await self._wait_all(handles, deadline)
        except anyio.get_cancelled_exc_class():
            if await self._settle_cancelled(peer, handles, deadline) and won and not carried and not post_failed:
                with anyio.CancelScope(shield=True), contextlib.suppress(ControlPlaneError):
                    await self._release_producer(ref, peer)  # or its slot waits for the lease to expire
            raise
        finally:
            for handle in handles:
                agent.release(handle)
        self._ep.counters.reads += 1
        if not carried:
            await self._release_producer(ref, peer)
        if peer.name not in self._transport_logged:
            self._transport_logged.add(peer.name)
            transport = agent.transport_info(peer.name)
            vram = any(r.mem_kind is MemKind.VRAM for r in ref.regions)
            level = "warning" if vram and transport and "tcp" in transport.lower() else "info"
            getattr(log, level)(
                "nixl.transport", peer=peer.name, transport=transport or "unknown (set UCX_PROTO_INFO=y)"
            )
        return made

    async def _end_reads(
        self, ref: NixlPayload, peer: Peer, handles: list[object], deadline: float, *, released: bool
    ) -> None:
        """Wait for READs whose payload will not be used (the claim is ours), then free the producer's slot
        unless the READ carried the release; a READ that failed drops the peer (no late bytes later)."""
        try:
            await self._wait_all(handles, deadline)
        except TransferError:
            self._peers.forget(peer.name)
            return
        if not released:
            with contextlib.suppress(ControlPlaneError):
                await self._release_producer(ref, peer)

    async def _settle_cancelled(self, peer: Peer, handles: list[object], deadline: float) -> bool:
        """The caller was cancelled with READs posted: before our slots go back to the pool, wait (shielded,
        up to the READs' deadline) until none can still write into them.  Releasing a handle only asks NIXL
        to cancel an active READ, so that alone proves nothing.  A READ that fails or outlives the deadline,
        or a wait cancelled again (a native ``Task.cancel`` breaks the shield), drops the peer: its endpoint
        closes, and nothing of it lands in a reused slot.  True when every READ was seen DONE."""
        try:
            with anyio.CancelScope(shield=True):
                await self._wait_all(handles, deadline)
        except (TransferError, anyio.get_cancelled_exc_class()):
            log.warning("nixl.read_abandoned", peer=peer.name, reads=len(handles))
            self._peers.forget(peer.name)
            return False
        return True

    def _post(self, spec: RegionSpec, remote: RemoteRegion, local: Slot, peer: Peer, notif: bytes = b"") -> object:
        """Post the READ of one region, with ``notif`` for the producer on completion.  A DRAM region of at least
        ``read_lane_min_bytes`` becomes ``read_lanes`` descriptors of one transfer (NIXL's UCX backend
        spreads them over its ``ucx_threads``)."""
        agent = self._ep.agent
        assert agent is not None
        kind = mem_kind_of(spec.device)
        config = self._ep.config
        lanes = 1
        if kind is MemKind.DRAM and remote.mem_kind is MemKind.DRAM and spec.nbytes >= config.read_lane_min_bytes:
            lanes = config.read_lanes
        spans = lane_spans(spec.nbytes, lanes)
        return agent.start_read(
            [(local.address + off, n, local.device_id) for off, n in spans],
            kind,
            [(remote.address + off, n, remote.device_id) for off, n in spans],
            remote.mem_kind,
            peer.name,
            notif,
        )

    async def _release_producer(self, ref: NixlPayload, peer: Peer) -> None:
        """Tell the producer its slot is free (claim won, bytes here); through Redis if NIXL cannot."""
        agent = self._ep.agent
        assert agent is not None
        try:
            agent.notify(peer.name, release_notification(ref.token))
        except TransferError as exc:
            log.warning("nixl.notify_failed", peer=peer.name, error=exc.message)
            await self.discard(ref)  # the same release, as a drop request the producer settles

    async def _wait_all(self, handles: list[object], deadline: float) -> None:
        """Poll until every READ is DONE: without yielding for ``HOLD_S``, then yielding without sleeping
        (a wake-up per turn of the event loop) within ``SPIN_S`` of the first look, then sleeping
        ``POLL_S`` between looks: a READ still running by then is a large one (or a slow link), whose
        end a millisecond later costs little next to its length."""
        agent = self._ep.agent
        assert agent is not None
        pending = handles
        started = time.monotonic()
        hold_until, spin_until = started + HOLD_S, started + SPIN_S
        while True:
            pending = [h for h in pending if agent.poll(h) is not XferState.DONE]
            if not pending:
                return
            now = time.monotonic()
            if now < hold_until:
                continue
            if now > deadline:
                raise TransferError("READ timed out", seconds=self._ep.timeouts.transfer)
            self.wakeups += 1
            await anyio.sleep(0 if now < spin_until else POLL_S)

    async def resend_inline(self, ref: NixlPayload, *, reason: str) -> Incoming:
        """Ask the producer to send the payload inline; it is gone if nobody answers in time."""
        ep = self._ep
        started = time.perf_counter()
        reply_key = ep.keys.resend_reply(ref.token)
        with translated():
            await self._ask_producer(ref, ResendAction.RESEND)
            reply = await ep.redis.blpop([reply_key], timeout=ep.timeouts.resend)
        blob = decode_resend_reply(reply[1] if reply else None)
        if blob is None:
            raise PayloadUnavailableError("producer could not resend the payload", reason=reason, agent=ref.agent)
        metrics.FALLBACKS.labels(reason).inc()
        ep.counters.fallback(reason)
        log.warning("payload.inline_fallback", reason=reason, side="consumer")
        inline_ref = InlinePayload(manifest=ref.manifest, blob_bytes=len(blob), fallback_reason=reason)
        incoming = await ep.inline.decode(inline_ref, blob)
        return Incoming(
            payload=incoming.payload,
            transport=Transport.INLINE,
            nbytes=incoming.nbytes,
            seconds=time.perf_counter() - started,
            fallback_reason=reason,
        )

    async def _ask_producer(self, ref: NixlPayload, action: ResendAction) -> None:
        """Post a resend/drop request; the stream expires once no lease could still need it, so a
        producer that died leaves nothing behind in Redis."""
        ep = self._ep
        stream = ep.keys.resend(ref.agent)
        async with ep.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(stream, ResendRequest(token=ref.token, action=action).to_fields())  # type: ignore[arg-type]
            pipe.expire(stream, int(ep.timeouts.lease + ep.timeouts.resend) + 60)
            await pipe.execute()
