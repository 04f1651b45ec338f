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
  See :meth:`~stageferry.broker.data.nixl.reads.Reader.read` for why reading before the claim is won is safe.
  Inside the block ``incoming.payload`` and ``incoming.regions`` are views of our pool slots; on exit the
  slots go back to the pool (after a CUDA synchronize, so queued kernels finish first).  Nothing may
  keep a view past the block.  A get cancelled with READs in flight gives its slots back only once no
  READ can still write into them (:meth:`~stageferry.broker.data.nixl.reads.Reader.read`).
* A producer on our own GPU (same GPU UUID, its CUDA arena mapped): the CUDA regions are copied device to
  device instead of READ, with the same checks, claim and release (:meth:`Consumer._copy_or_read`,
  :mod:`stageferry.broker.data.nixl.same_gpu`); any failure there falls back to the READ.
* On handshake or transfer failure the producer is asked to resend inline (:mod:`stageferry.broker.data.nixl.resend`,
  up to ``inline_fallback_max_bytes``); if it cannot, :class:`PayloadUnavailableError` sends the request
  back to be recomputed.  Descriptors that fail validation raise :class:`ManifestError` before any
  native call.
* :meth:`Consumer.discard` — the request was settled meanwhile: tell the producer to drop the payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import structlog
import torch

from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Incoming
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import check_fresh
from stageferry.broker.data.nixl.peers import Peer, Peers
from stageferry.broker.data.nixl.reads import Reader, claim, mem_kind_of
from stageferry.broker.data.nixl.ready import ReadySlots
from stageferry.broker.data.nixl.resend import discard, resend_inline
from stageferry.broker.data.nixl.same_gpu import ArenaCopy, SameGpu
from stageferry.broker.data.nixl.ucx_log import transport_names
from stageferry.broker.data.payload_codec import unpack, validate_manifest, validate_remote_regions
from stageferry.broker.data.pool import Slot
from stageferry.errors import (
    HandshakeError,
    ManifestError,
    PoolExhaustedError,
    ProtocolMismatchError,
    TransferError,
)
from stageferry.schemas import DeviceKind, InlinePayload, MemKind, NixlPayload, PayloadRef, Transport

__all__ = ["Consumer", "mem_kind_of"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


def _where(kind: MemKind, device_id: int) -> str:
    return f"VRAM:{device_id}" if kind is MemKind.VRAM else kind.value


class _Get(contextlib.AbstractAsyncContextManager[Incoming]):
    """One :meth:`Consumer.get`: the payload on entry, the clean-up on exit (a class of its own rather than
    ``asynccontextmanager``, whose generator machinery was 8 µs of a CPU-box get before its first step)."""

    __slots__ = ("_blob", "_claimed", "_consumer", "_incoming", "_key", "_ref", "_slots")

    def __init__(self, consumer: Consumer, ref: PayloadRef, blob: bytes | None, key: str, claimed: bool | None):
        self._consumer, self._ref, self._blob, self._key, self._claimed = consumer, ref, blob, key, claimed
        self._incoming: Incoming | None = None
        self._slots: dict[DeviceKind, Slot] = {}

    async def __aenter__(self) -> Incoming:
        try:
            self._incoming, self._slots = await self._consumer._fetch(self._ref, self._blob, self._key, self._claimed)
        except BaseException:
            await self._consumer._end(self._ref, None, {})
            raise
        return self._incoming

    async def __aexit__(self, *exc_info: object) -> None:
        incoming, slots, self._incoming, self._slots = self._incoming, self._slots, None, {}
        await self._consumer._end(self._ref, incoming, slots)


class Consumer:
    """The get side of one leader's connector."""

    def __init__(self, endpoint: Endpoint, peers: Peers) -> None:
        self._ep = endpoint
        self._peers = peers
        self.ready = ReadySlots(endpoint)
        self.same_gpu = SameGpu(endpoint)
        self.reader = Reader(endpoint, peers)
        nixl = Transport.NIXL.value  # the metrics' children, looked up once (as the producer's)
        self._gets = metrics.GETS.labels(nixl)
        self._get_bytes = metrics.BYTES.labels("get", nixl)
        self._get_seconds = metrics.TRANSFER_SECONDS.labels(nixl, "get")

    def get(
        self, ref: PayloadRef, blob: bytes | None, *, key: str, claimed: bool | None = None
    ) -> contextlib.AbstractAsyncContextManager[Incoming]:
        """See the module docstring."""
        return _Get(self, ref, blob, key, claimed)

    async def _end(self, ref: PayloadRef, incoming: Incoming | None, slots: dict[DeviceKind, Slot]) -> None:
        """After a get's block (or its failure): count it, give the slots back, log the transport."""
        if incoming is not None:  # counted once the block ended: off the payload's way to the stage
            self._count_get(incoming)
        pools = self._ep.pools
        if slots and pools is not None:
            if DeviceKind.CUDA in slots:  # kernels queued on the payload must finish before reuse
                with anyio.CancelScope(shield=True):  # a cancelled block still waits, or the slots leak
                    await anyio.to_thread.run_sync(torch.cuda.synchronize, slots[DeviceKind.CUDA].device)
            pools.release_all(slots)
            if isinstance(ref, NixlPayload):  # the next payload of this shape, made while we are idle
                self.ready.want(ref.manifest)
        self.reader.log_transport()  # once per peer: after the block, off the request's path

    async def claim(self, ref: NixlPayload, claimed: bool | None = None) -> None:
        """Claim ``ref``'s lease unless the stream read did (:func:`~stageferry.broker.data.nixl.reads.claim`)."""
        await claim(self._ep, ref, claimed)

    async def discard(self, ref: PayloadRef) -> None:
        """Tell the producer that a payload will never be read (the request was settled meanwhile)."""
        await discard(self._ep, ref)

    async def resend_inline(self, ref: NixlPayload, *, reason: str) -> Incoming:
        """Ask the producer to send the payload inline (:func:`~stageferry.broker.data.nixl.resend.resend_inline`)."""
        return await resend_inline(self._ep, ref, reason=reason)

    async def _claimed_resend(self, ref: NixlPayload, claimed: bool | None, reason: str) -> Incoming:
        """The payload sent inline, once its lease is ours: a consumer that lost the claim must not ask its
        producer for it (as :meth:`~stageferry.broker.data.nixl.reads.Reader.read` claims before it asks)."""
        await self.claim(ref, claimed)
        return await self.resend_inline(ref, reason=reason)

    @property
    def wakeups(self) -> int:
        """Times a READ wait went back to the event loop (benchmarks show it per hop)."""
        return self.reader.wakeups

    async def _fetch(
        self, ref: PayloadRef, blob: bytes | None, key: str, claimed: bool | None
    ) -> tuple[Incoming, dict[DeviceKind, Slot]]:
        """The payload and the local slots it lives in (empty when it came inline)."""
        ep = self._ep
        if isinstance(ref, InlinePayload):
            return await ep.inline.decode(ref, blob), {}
        if not isinstance(ref, NixlPayload):
            raise ManifestError(f"cannot fetch a {ref.kind!r} payload", kind=ref.kind)
        started = time.perf_counter()
        known = self._peers.loaded(ref.agent)  # first of all (SameGpu.prime): the copy's path woken meanwhile
        if known is not None and known.ipc is not None:
            self.same_gpu.prime(ref, known.ipc)
        primed = time.perf_counter()
        validate_manifest(ref.manifest, max_payload_bytes=ep.config.max_payload_bytes)
        if claimed is False:  # the stream read found the lease taken: not ours to read, nor to ask for
            await self.claim(ref, claimed)
        if ep.agent is None or ep.pools is None:
            return await self._claimed_resend(ref, claimed, ep.unavailable_reason or "nixl_unavailable"), {}
        pools = ep.pools
        validated = time.perf_counter()
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
            return await self._claimed_resend(ref, claimed, "handshake_failed"), {}
        except TimeoutError:
            metrics.HANDSHAKE_FAILURES.labels("timeout").inc()
            return await self._claimed_resend(ref, claimed, "handshake_timeout"), {}
        found = time.perf_counter()
        validate_remote_regions(ref.manifest, ref.regions, peer.arenas)
        if not hmac.compare_digest(ref.seal, peer.sealer.seal(ref.agent, ref.token, ref.regions)):
            # In the producer's pool but not what it leased under this token: another request's slot.
            raise ManifestError("descriptors are not the ones the producer leased", agent=ref.agent, token=ref.token)
        check_fresh(ref)
        checked = time.perf_counter()
        ready = self.ready.take(ref.manifest)  # slots (and views, for this very structure) made while idle
        if ready is not None:
            slots = ready.slots
        else:
            try:
                slots = await pools.acquire_regions(ref.manifest, timeout=ep.timeouts.pool_wait)
            except PoolExhaustedError:
                await self.claim(ref, claimed)  # ours before its producer is asked for it inline
                return await self.resend_inline(ref, reason="pool_exhausted"), {}
        if ready is not None and ready.has_views:
            views = ready.views
        else:
            spans = {kind: slot.span for kind, slot in slots.items()}
            views = functools.partial(unpack, ref.manifest, spans, copy=False)
        taken = time.perf_counter()
        steps: dict[str, int] = {}
        try:  # claims the lease, and makes the payload's views over our slots, while the READs run
            payload, copy = await self._copy_or_read(ref, peer, slots, claimed, meanwhile=views, steps=steps)
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
        ended = time.perf_counter()
        seconds = ended - started
        regions = {kind: slot.view for kind, slot in slots.items()}  # a TP group fans these out as they are
        incoming = Incoming(
            payload=payload,
            transport=Transport.NIXL,
            nbytes=ref.manifest.total_bytes,
            seconds=seconds,
            manifest=ref.manifest,
            regions=regions,
            route=self._route(ref, peer, slots, copy),
        )
        # Logged on the loop's next turn (the stage's model runs in a thread of its own by then): rendering
        # the line is 20 µs warm on the CPU box, on the request's path when logged here.
        made = "views" if ready is not None and ready.has_views else "slots" if ready is not None else None
        marks = (started, primed, validated, found, checked, taken, ended)
        asyncio.get_running_loop().call_soon(self._log_get, key, incoming, peer, marks, steps, made, claimed is True)
        return incoming, slots

    def _log_get(
        self,
        key: str,
        incoming: Incoming,
        peer: Peer,
        marks: tuple[float, ...],
        steps: dict[str, int],
        ready: str | None,
        claimed: bool,
    ) -> None:
        """The get's ``payload.get`` line, from the instants :meth:`_fetch` marked."""
        started, primed, validated, found, checked, taken, ended = marks
        log.info(
            "payload.get",
            key=key,
            transport=Transport.NIXL.value,
            bytes=incoming.nbytes,
            seconds=round(incoming.seconds, 6),
            peer=peer.name,
            source=peer.address,  # the producer's advertised IP, and ours: both ends of the hop
            destination=self._ep.address,
            route=incoming.route,
            # where the hop's time went, in µs: the same-GPU copy's prime, the manifest, the peer, the
            # descriptors' checks, our slots (made ahead: ``ready``), the claim (by the stream read already:
            # ``claimed``), bytes and release
            steps_us={
                "prime": round((primed - started) * 1e6),
                "manifest": round((validated - primed) * 1e6),
                "peer": round((found - validated) * 1e6),
                "checks": round((checked - found) * 1e6),
                "slots": round((taken - checked) * 1e6),
                "move": round((ended - taken) * 1e6),
                **steps,  # the move's own steps (Reader.read)
            },
            ready=ready,
            claimed=claimed,
        )

    async def _copy_or_read(
        self,
        ref: NixlPayload,
        peer: Peer,
        slots: dict[DeviceKind, Slot],
        claimed: bool | None,
        meanwhile: Callable[[], T] | None = None,
        steps: dict[str, int] | None = None,
    ) -> tuple[T | None, ArenaCopy | None]:
        """:meth:`Reader.read`, with the same-GPU copy (:mod:`~stageferry.broker.data.nixl.same_gpu`) of
        the regions it can take queued first and waited for beside the READs of the rest; the copy, if it
        was used.  A copy that cannot be queued or fails is logged and the whole payload READ, with the
        claim already ours in the second case."""
        copy: ArenaCopy | None = None
        regions = self.same_gpu.regions(ref, peer.ipc, slots)
        if regions:
            launched = time.perf_counter()
            try:
                copy = self.same_gpu.launch(ref, peer.ipc, slots, regions)
            except TransferError as exc:
                self._fell_back(ref, peer, exc)
            if steps is not None:
                steps["launch"] = round((time.perf_counter() - launched) * 1e6)
        try:
            made = await self.reader.read(ref, peer, slots, claimed, meanwhile=meanwhile, beside=copy, steps=steps)
        except TransferError as exc:
            if copy is None or exc is not copy.error:  # a READ's failure (the copy's too, maybe): the caller's
                raise
            self._fell_back(ref, peer, exc)
            return await self.reader.read(ref, peer, slots, True, meanwhile=meanwhile), None
        if copy is not None:
            self._ep.counters.same_gpu += 1
        return made, copy

    @staticmethod
    def _fell_back(ref: NixlPayload, peer: Peer, exc: TransferError) -> None:
        log.warning("nixl.same_gpu_fallback", peer=peer.name, token=ref.token, error=exc.message, fallback="nixl")

    def _route(self, ref: NixlPayload, peer: Peer, slots: dict[DeviceKind, Slot], copy: ArenaCopy | None) -> str:
        """Each region's memory on both sides and what moved it: the UCX transport that READ it (``?`` when
        UCX did not say) or the same-GPU copy: ``VRAM:0→VRAM:1 cuda_ipc, DRAM→DRAM cma``, ``DRAM→DRAM cma,
        VRAM:0→VRAM:0 same-gpu copy``.  Kept per peer and layout once every transport is known (a peer
        loaded again starts afresh).  The layout is keyed by the remote regions alone (checked already: each
        one's memory kind is its manifest region's device, its length that region's size) and the regions
        copied: our slots' devices are this connector's, fixed."""
        layout = (tuple([(r.mem_kind, r.device_id, r.length > 0) for r in ref.regions]), copy and copy.regions)
        known = peer.routes.get(layout)
        if known is not None:
            return known
        agent = self._ep.agent
        assert agent is not None
        pairs = [
            (i, spec, remote)
            for i, (spec, remote) in enumerate(zip(ref.manifest.regions, ref.regions, strict=True))
            if spec.nbytes
        ]
        copied = {i for i, _, _ in pairs if copy is not None and copy.covers(i)}
        parts = []
        for i, spec, remote in pairs:
            kind, local = mem_kind_of(spec.device), slots[spec.device]
            if i in copied:
                names = ["same-gpu copy"]
            else:
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
            self._gets.inc()
            self._get_bytes.inc(incoming.nbytes)
            self._get_seconds.observe(incoming.seconds)
