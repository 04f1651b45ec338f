"""Producer leases: which pool slots are held for which consumer, until when, and the claim key that
arbitrates the end of each.

A put leaves the payload in pool slots under a *lease* (token, slots, expiry).  The slots are freed when

* the consumer is done with them — its READ notification arrived, it asked for an inline resend, or it
  dropped the payload: :meth:`LeaseTable.settle`;
* the lease ran out *unclaimed*: the expiry loop (:meth:`LeaseTable.run_expiry`);
* the producer never published the envelope: :meth:`LeaseTable.abandon` (freed by the expiry loop);
* the process shuts down: :meth:`LeaseTable.free_all`.

The **claim key** ``<prefix>:nixl:claim:<token>`` is the one place producer and consumer meet about a
lease.  A consumer sets it (``SET NX``, with its claim timeout) before reading: :func:`claim`.  Before
freeing, the producer marks it ``released`` (overwriting a claim: the READ is over) or ``expired`` (only
if nobody claimed it), for longer than any consumer may still try; so a late or repeated consumer finds
the payload gone and recomputes, instead of READing memory that now holds another payload.  If Redis is
away the mark fails and the slot stays held; the expiry loop retries.

Behind Sentinel (``wait_replicas``) both sides of that meeting wait for a replica (``WAIT``, on the
connection that wrote): a claim or a mark that a failover could lose would let the new master answer a
consumer "unclaimed" for a slot its producer has already freed and filled with another payload (seen in
the failover soak: a READ of another request's bytes).  A claim not on a replica counts as refused (the
payload is recomputed); a mark not on a replica leaves the slot held, and the expiry loop tries again.

Memory: while a lease exists its slots belong to it (the consumer READs them); once freed they are back
in the pool.  Who calls: the producer (hold, settle, abandon), the consumer (claim), the connector (the
expiry loop, shutdown).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import anyio
import structlog

from stageferry.broker.control.redis_conn import durability_of, translated
from stageferry.broker.control.replication import exchange, wait_command
from stageferry.broker.control.resp_link import run_pipeline
from stageferry.broker.control.streams import LeaseClaim
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.pool import Slot
from stageferry.errors import ControlPlaneError, PayloadUnavailableError
from stageferry.schemas import DeviceKind, Manifest, NixlPayload

log = structlog.get_logger(__name__)

#: A freed payload's claim key outlives its lease by this much more than the claim timeout, so that a
#: consumer whose clock runs behind the producer's still finds it gone (and recomputes).
GONE_SLACK_S = 60.0
_LEASE_SCAN_S = 0.25


@dataclass(frozen=True, slots=True)
class _Mark:
    """What a freed lease's claim key is set to, and on what condition."""

    value: bytes
    condition: tuple[str, ...]  #: ``("NX",)``: only if nobody claimed the lease
    reason: str  #: why the slot is freed, when the lease was not settled


#: A consumer is done with the payload: overwrites its claim (the READ is over).
_RELEASED = _Mark(b"released", (), "released")
#: The lease ran out: only if nobody claimed it.
_EXPIRED = _Mark(b"expired", ("NX",), "lease_expired")


@dataclass(slots=True)
class Lease:
    """A payload held for a consumer, until released or expired unclaimed."""

    token: str
    slots: dict[DeviceKind, Slot]
    nbytes: int
    expires_at: float
    key: str
    order: tuple[DeviceKind, ...]
    #: Why the slot is to be freed, once its claim key says ``released`` (see ``settle``).
    settled: str | None = None

    def concat(self) -> bytes:
        """The slot bytes in manifest order (the inline form), for a resend; copies, so run it in a thread."""
        return b"".join(self.slots[k].view.cpu().numpy().tobytes() for k in self.order)


class LeaseTable:
    """The producer's leases, keyed by token.  Event-loop thread only."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, token: object) -> bool:
        return token in self._leases

    def get(self, token: str) -> Lease | None:
        return self._leases.get(token)

    def hold(self, key: str, manifest: Manifest, slots: dict[DeviceKind, Slot]) -> Lease:
        """Put packed ``slots`` under a new lease for the hop ``key``; the table owns them from now on."""
        token = f"{key}.{os.urandom(6).hex()}"  # 48 random bits, as uuid4().hex[:12] gave
        lease = Lease(
            token=token,
            slots=slots,
            nbytes=manifest.total_bytes,
            expires_at=time.time() + self._ep.timeouts.lease,
            key=key,
            order=tuple(r.device for r in manifest.regions),
        )
        self._leases[token] = lease
        return lease

    def abandon(self, token: str) -> None:
        """Free an unpublished payload — through the expiry loop, which first marks its token gone: after
        a lost reply the hand-off may have been published after all."""
        if token in self._leases:
            self._leases[token].settled = "abandoned"

    async def settle(self, *tokens: str, reason: str) -> None:
        """Free slots that consumers are done with (READ complete, sent inline, dropped), but mark each
        claim key ``released`` first: the envelope naming it may be delivered again (its consumer died
        after the READ, before acknowledging), and that consumer must find the payload gone instead of
        claiming anew and READing memory that now holds another payload.  The marks of all ``tokens`` go
        in one round trip (a notification drain settles every READ it found).  If Redis is away a slot
        stays held; the expiry loop retries."""
        leases = [lease for token in tokens if (lease := self._leases.get(token)) is not None]
        for lease in leases:
            lease.settled = reason
        await self._free_marked([(lease, _RELEASED) for lease in leases])

    async def run_expiry(self) -> None:
        """Free leases that ran out unclaimed (a claimed one waits for its claim to expire), and settled
        ones whose claim key could not be marked yet.  Runs until cancelled."""
        while True:
            await anyio.sleep(_LEASE_SCAN_S)
            await self.scan()

    async def scan(self) -> None:
        """One pass of the expiry loop over every lease (its marks in one round trip)."""
        now = time.time()
        due = [
            (lease, _RELEASED if lease.settled is not None else _EXPIRED)
            for lease in self._leases.values()
            if lease.settled is not None or lease.expires_at <= now
        ]
        await self._free_marked(due)

    def free(self, token: str, *, reason: str) -> bool:
        """Give the lease's slots back to the pool now, without touching its claim key."""
        lease = self._leases.pop(token, None)
        if lease is None:
            return False
        if self._ep.pools is not None:
            self._ep.pools.release_all(lease.slots)
        log.debug("payload.slot_freed", token=token, reason=reason, bytes=lease.nbytes)
        return True  # the pool published its usage as it took the slots back

    def free_all(self, *, reason: str) -> None:
        for token in list(self._leases):
            self.free(token, reason=reason)

    async def _free_marked(self, due: list[tuple[Lease, _Mark]]) -> None:
        """Mark each lease's claim key as its :data:`_Mark` says, then free the leases whose mark was set
        (an ``expired`` mark is not set over a consumer's claim: that lease waits for the claim to end)."""
        if not due:
            return
        for (lease, mark), marked in zip(due, await self._mark_gone(due), strict=True):
            if marked:
                self.free(lease.token, reason=lease.settled or mark.reason)

    async def _mark_gone(self, due: list[tuple[Lease, _Mark]]) -> list[bool]:
        """Set each lease's claim key to its mark until no consumer may still try it (the lease's end plus
        slack), all in one round trip over the endpoint's link; which marks were set (none if Redis is
        away)."""
        ep = self._ep
        now = time.time()
        commands = []
        for lease, mark in due:
            ttl_ms = int((max(0.0, lease.expires_at - now) + ep.timeouts.claim + GONE_SLACK_S) * 1000)
            commands.append(("SET", ep.keys.claim(lease.token), mark.value, "PX", ttl_ms, *mark.condition))
        durability = durability_of(ep.redis)
        try:
            with translated():
                if durability.on:
                    *replies, acked = await exchange(
                        ep.link, ep.redis, [*commands, wait_command(durability)], block_s=durability.timeout_ms / 1000
                    )
                    if not isinstance(acked, int) or acked < durability.replicas:
                        log.warning("payload.mark_gone_unreplicated", replicas=acked, leases=len(due))
                        return [False] * len(due)  # the slots stay held; the expiry loop marks them again
                else:
                    replies = await run_pipeline(ep.link, ep.redis, commands, block_s=0.0)
        except ControlPlaneError as exc:
            log.warning("payload.mark_gone_failed", error=exc.message)
            return [False] * len(due)
        for reply in replies:
            if isinstance(reply, Exception):  # refused (an ACL, OOM): the lease stays held, the scan retries
                log.warning("payload.mark_gone_failed", error=str(reply))
        return [reply is not None and not isinstance(reply, Exception) for reply in replies]


def claim_on_read(endpoint: Endpoint) -> LeaseClaim:
    """The same claim as :func:`claim`, taken by the stage's stream read for each new entry naming a
    lease (:class:`~stageferry.broker.control.streams.LeaseClaim`): one round trip fewer per hop.  The
    worker then passes the outcome to the get (``claimed=``), which checks freshness as :func:`claim` does."""
    ep = endpoint
    return LeaseClaim(prefix=ep.keys.claim(""), holder=ep.name, ttl_ms=int(ep.timeouts.claim * 1000))


async def claim(endpoint: Endpoint, ref: NixlPayload) -> None:
    """Consumer side: claim ``ref``'s lease before reading, so the producer never frees the slot under
    our READ.

    Around the lease's end the claim key arbitrates (the producer marks it ``expired`` only if nobody
    claimed it).  Its markers ``expired``/``released`` outlive the lease by at least ``GONE_SLACK_S``;
    later than half that past the lease, a missing key no longer proves anything, so the payload counts
    as gone (:class:`PayloadUnavailableError`, as when the claim is refused)."""
    check_fresh(ref)
    ep = endpoint
    durability = durability_of(ep.redis)
    with translated():
        if durability.on:  # on a replica before the READ (see the module docstring)
            set_nx = ("SET", ep.keys.claim(ref.token), ep.name.encode(), "NX", "PX", int(ep.timeouts.claim * 1000))
            reply, acked = await exchange(
                ep.link, ep.redis, [set_nx, wait_command(durability)], block_s=durability.timeout_ms / 1000
            )
            if isinstance(reply, Exception):
                raise reply
            ok = reply is not None and isinstance(acked, int) and acked >= durability.replicas
        else:
            ok = await ep.redis.set(
                ep.keys.claim(ref.token), ep.name.encode(), nx=True, px=int(ep.timeouts.claim * 1000)
            )
    if not ok:
        raise PayloadUnavailableError("payload lease expired or already claimed", token=ref.token)


def check_fresh(ref: NixlPayload) -> None:
    """Raise :class:`PayloadUnavailableError` when ``ref``'s lease ended so long ago that its claim key
    proves nothing any more (see :func:`claim`); the consumer checks this before posting a READ too."""
    if time.time() > ref.lease_expires_at + GONE_SLACK_S / 2:
        raise PayloadUnavailableError("payload lease ran out long ago", token=ref.token)
