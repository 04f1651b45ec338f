"""The READ of one payload: post a READ per region, claim the lease meanwhile, wait, release the producer.

:class:`Reader` is the transfer half of :class:`~stageferry.broker.data.nixl.consumer.Consumer` (which
validates, takes slots and unpacks); :func:`claim` is the lease's claim as the consumer sees it (won here,
or by the stage's stream read already).  The order of duties and why reading before the claim is won is
safe: :meth:`Reader.read`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import anyio
import structlog

from stageferry.broker.data.nixl.agent import XferState
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import claim as claim_lease
from stageferry.broker.data.nixl.peers import Peer, Peers
from stageferry.broker.data.nixl.releases import Releases
from stageferry.broker.data.nixl.resend import discard
from stageferry.broker.data.pool import Slot
from stageferry.errors import ControlPlaneError, PayloadUnavailableError, TransferError
from stageferry.failpoints import CONSUMER_READ_POSTED, failpoint
from stageferry.schemas import DeviceKind, MemKind, NixlPayload, RegionSpec, RemoteRegion
from stageferry.schemas.nixl import release_notification

log = structlog.get_logger(__name__)
#: Peers whose transport was logged, remembered at most (each restarted producer is a new name).
_TRANSPORTS_REMEMBERED = 1024

T = TypeVar("T")


#: How long :meth:`Reader._wait_all` yields without sleeping, and how long it then sleeps between looks.
#: An event-loop sleep is never shorter than a millisecond (asyncio's epoll selector rounds its timeout
#: up to whole milliseconds), so a shorter POLL_S would still cost 1 ms: a READ that ends just after the
#: spin gave up paid that much on top of the hop (the hop's p99 on the GPU host, issue 20).  The spin
#: covers what a READ of a hop's payload takes once posted (VRAM over cuda_ipc: 0.1–0.3 ms for 65 MB).
SPIN_S = 0.002
POLL_S = 0.001
#: First, the READ wait polls this long without going back to the event loop at all: a small READ
#: (VRAM over cuda_ipc: tens of µs) is then seen DONE in the same turn, without a loop round of its own.
HOLD_S = 0.0001


class Beside(Protocol):
    """Regions the caller moves itself while the READs run (the same-GPU copy,
    :class:`~stageferry.broker.data.nixl.same_gpu.ArenaCopy`), already under way: :meth:`Reader.read`
    posts no READ for them and releases the producer only once they are done too."""

    def covers(self, index: int) -> bool:
        """Whether the region at ``index`` of the manifest is moved by this copy."""
        ...

    async def wait(self) -> None:
        """Return once the copy is done; :class:`TransferError` if it failed; a cancelled wait still ends
        only once nothing writes into our slots any more."""
        ...


def lane_spans(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``lanes`` near-equal pieces of ``nbytes`` (4 KiB-aligned cuts; fewer pieces
    when the region is too small for that many)."""
    step = max(4096, -(-nbytes // max(1, lanes) // 4096) * 4096)
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)] or [(0, 0)]


def mem_kind_of(device: DeviceKind) -> MemKind:
    return MemKind.VRAM if device is DeviceKind.CUDA else MemKind.DRAM


async def claim(ep: Endpoint, ref: NixlPayload, claimed: bool | None = None) -> None:
    """Claim ``ref``'s lease (see :func:`stageferry.broker.data.nixl.leases.claim`), unless the stream
    read did (``claimed`` True; False: it found the lease taken)."""
    if claimed is None:
        await claim_lease(ep, ref)
    elif not claimed:
        raise PayloadUnavailableError("payload lease expired or already claimed", token=ref.token)


async def _settle(beside: Beside | None) -> None:
    """Wait (shielded) until ``beside`` no longer writes into our slots, whatever its outcome (a failure is
    the caller's to raise, or was raised already: never one that skips the rest of the clean-up)."""
    if beside is not None:
        with anyio.CancelScope(shield=True):
            try:
                await beside.wait()
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.debug("nixl.beside_settled", error=str(exc)[:200])


class _Steps:
    """µs between marks, into ``into`` (nothing when it is None)."""

    __slots__ = ("_into", "_last")

    def __init__(self, into: dict[str, int] | None) -> None:
        self._into, self._last = into, time.perf_counter()

    def mark(self, name: str) -> None:
        if self._into is not None:
            now = time.perf_counter()
            self._into[name] = round((now - self._last) * 1e6)
            self._last = now


class Reader:
    """The READs of one leader's consumer."""

    def __init__(self, endpoint: Endpoint, peers: Peers) -> None:
        self._ep = endpoint
        self._peers = peers
        self.releases = Releases(endpoint)
        self._transport_logged: set[str] = set()
        self._transport_due: dict[str, NixlPayload] = {}  # peers READ from, not yet logged (log_transport)
        self.wakeups = 0  #: times a READ wait went back to the event loop (benchmarks show it per hop)

    async def read(
        self,
        ref: NixlPayload,
        peer: Peer,
        slots: dict[DeviceKind, Slot],
        claimed: bool | None = None,
        meanwhile: Callable[[], T] | None = None,
        beside: Beside | None = None,
        steps: dict[str, int] | None = None,
    ) -> T | None:
        """Claim ``ref``'s lease while READing its regions into ``slots`` (ours, already taken), then
        release the producer's slot.  Regions ``beside`` covers are not READ: that copy runs meanwhile,
        is waited for after the READs and before the release; if it fails, :class:`TransferError` is
        raised with the claim won and nothing released (the caller READs the payload instead).  The hop
        waits for the longer of the claim's round trip and the READs, not for their sum; with ``claimed``
        (the stream read's claim, :func:`claim`) there is no round trip.
        Once the claim is won, ``meanwhile()`` runs while the READs do (the unpack: views over our slots,
        which need no bytes yet) and its result is returned; if it raises, the READs are waited for first,
        so no READ still writes into the slots the caller then gives back.

        In order: post one READ per non-empty region, all at once and without a notification; claim
        (Redis ``SET NX``) while they run; wait until every READ is DONE; only then queue the producer's
        release (:class:`~stageferry.broker.data.nixl.releases.Releases`: a notification sent on the event
        loop's next turn, off the get's path), so the release is sent once, by the claim's winner, after the
        bytes arrived.  Why reading before the claim is won is safe: a READ changes nothing on the producer;
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
        resend frees the slot, perhaps under the winner's READ.

        ``steps``, when given, gets each step's µs: ``post``, ``claim``, ``views`` (``meanwhile``), ``wait``
        (the READs, then ``beside``) and ``release``."""
        agent = self._ep.agent
        assert agent is not None
        pairs = [
            (spec, remote)
            for i, (spec, remote) in enumerate(zip(ref.manifest.regions, ref.regions, strict=True))
            if spec.nbytes and not (beside is not None and beside.covers(i))
        ]
        if not pairs and beside is None:  # zero-size payload: nothing to READ, release the producer explicitly
            await claim(self._ep, ref, claimed)
            await discard(self._ep, ref)
            return meanwhile() if meanwhile is not None else None
        deadline = time.monotonic() + self._ep.timeouts.transfer
        # Claimed already and one READ: it carries the release itself (NIXL sends it once the bytes are
        # here).  Several READs each send their own notification on completion, so those are released
        # by one notification after the last of them instead.
        carried = release_notification(ref.token) if claimed is True and len(pairs) == 1 and beside is None else b""
        handles: list[object] = []
        clock = _Steps(steps)
        post_failed: TransferError | None = None
        won = False  # the claim is ours: only then may the producer be released
        ended = False  # every READ was seen DONE: their handles are kept for a READ of the same regions
        try:
            try:
                for spec, remote in pairs:
                    handles.append(self._post(spec, remote, slots[spec.device], peer, carried))
            except TransferError as exc:  # raised once the claim is ours: only its winner may ask for a resend
                post_failed = exc
            failpoint(CONSUMER_READ_POSTED)  # fault injection: die with the READs in flight
            clock.mark("post")
            try:
                await claim(self._ep, ref, claimed)
            except (PayloadUnavailableError, ControlPlaneError):
                try:  # our slots go back to the pool: no READ may still be writing into them
                    await self._wait_all(handles, deadline)
                except TransferError:
                    self._peers.forget(peer.name)
                raise
            won = True
            clock.mark("claim")
            if post_failed is not None:
                # READs posted before the one that failed still write into our slots, which go back to the
                # pool once this is raised: they end first (a failed one too: the caller drops the peer).
                with contextlib.suppress(TransferError):
                    await self._wait_all(handles, deadline)
                raise post_failed
            made = None
            if meanwhile is not None:
                try:
                    made = meanwhile()
                except BaseException:  # the caller's error is the one raised, after the READs ended
                    await _settle(beside)  # the producer's slot is read until then
                    await self._end_reads(ref, peer, handles, deadline, released=bool(carried))
                    raise
            clock.mark("views")
            await self._wait_all(handles, deadline)
            ended = True
            if beside is not None:
                await beside.wait()  # a failure: raised with the claim won, nothing released
            clock.mark("wait")
        except anyio.get_cancelled_exc_class():
            await _settle(beside)
            if await self._settle_cancelled(peer, handles, deadline) and won and not carried and not post_failed:
                self.releases.send(ref, peer.name)  # now, or its slot waits for the lease to expire
            raise
        except BaseException:  # whatever is raised, the copy beside has ended first: the slots go back
            await _settle(beside)
            raise
        finally:
            for handle in handles:
                (agent.recycle if ended else agent.release)(handle)
        self._ep.counters.reads += 1
        if not carried:  # sent on the loop's next turn: nothing after the get waits for it (nixl.releases)
            self.releases.soon(ref, peer.name)
        clock.mark("release")
        if handles and peer.name not in self._transport_logged:
            self._transport_due[peer.name] = ref
        return made

    def log_transport(self) -> None:
        """Log, once per peer, which UCX transport its READs took (``nixl.transport``; a warning when VRAM
        went over TCP).  Diagnostics, so the consumer calls this once a get's block ended, off the request's
        path: inside the READ it cost the first hop 0.25–1 ms on the CPU box (issue 39)."""
        agent = self._ep.agent
        due, self._transport_due = self._transport_due, {}
        for name, ref in due.items():
            if agent is None or name in self._transport_logged:
                continue
            try:
                transport = agent.transport_info(name)
                vram = any(r.mem_kind is MemKind.VRAM for r in ref.regions)
                level = "warning" if vram and transport and "tcp" in transport.lower() else "info"
                getattr(log, level)(
                    "nixl.transport", peer=name, transport=transport or "unknown (set UCX_PROTO_INFO=y)"
                )
            except Exception:  # noqa: BLE001 - diagnostics: never the get's failure; the next get tries again
                self._transport_due.setdefault(name, ref)
                continue
            if len(self._transport_logged) >= _TRANSPORTS_REMEMBERED:  # one name per producer incarnation:
                self._transport_logged.clear()  # bounded; a peer logged again after this many is harmless
            self._transport_logged.add(name)

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
            self.releases.send(ref, peer.name)

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
