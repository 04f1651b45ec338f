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

from stageferry.broker.control.redis_conn import translated
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

    async def settle(self, token: str, *, reason: str) -> None:
        """Free a slot that a consumer is done with (READ complete, sent inline, dropped), but mark its
        claim key ``released`` first: the envelope naming it may be delivered again (its consumer died
        after the READ, before acknowledging), and that consumer must find the payload gone instead of
        claiming anew and READing memory that now holds another payload.  If Redis is away the slot
        stays held; the expiry loop retries."""
        lease = self._leases.get(token)
        if lease is None:
            return
        lease.settled = reason
        if await self._mark_gone(lease, b"released", overwrite=True):
            self.free(token, reason=reason)

    async def run_expiry(self) -> None:
        """Free leases that ran out unclaimed (a claimed one waits for its claim to expire), and settled
        ones whose claim key could not be marked yet.  Runs until cancelled."""
        while True:
            await anyio.sleep(_LEASE_SCAN_S)
            await self.scan()

    async def scan(self) -> None:
        """One pass of the expiry loop over every lease."""
        now = time.time()
        for token, lease in list(self._leases.items()):
            if lease.settled is not None:
                if await self._mark_gone(lease, b"released", overwrite=True):
                    self.free(token, reason=lease.settled)
            elif lease.expires_at <= now and await self._mark_gone(lease, b"expired", overwrite=False):
                self.free(token, reason="lease_expired")

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

    async def _mark_gone(self, lease: Lease, value: bytes, *, overwrite: bool) -> bool:
        """Set the lease's claim key to ``value`` until no consumer may still try it (the lease's end
        plus slack); with ``overwrite`` False only if nobody claimed it.  False if not set."""
        ep = self._ep
        ttl_ms = int((max(0.0, lease.expires_at - time.time()) + ep.timeouts.claim + GONE_SLACK_S) * 1000)
        try:
            with translated():
                return bool(await ep.redis.set(ep.keys.claim(lease.token), value, nx=not overwrite, px=ttl_ms))
        except ControlPlaneError as exc:
            log.warning("payload.mark_gone_failed", error=exc.message)
            return False


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
    with translated():
        ok = await ep.redis.set(ep.keys.claim(ref.token), ep.name.encode(), nx=True, px=int(ep.timeouts.claim * 1000))
    if not ok:
        raise PayloadUnavailableError("payload lease expired or already claimed", token=ref.token)


def check_fresh(ref: NixlPayload) -> None:
    """Raise :class:`PayloadUnavailableError` when ``ref``'s lease ended so long ago that its claim key
    proves nothing any more (see :func:`claim`); the consumer checks this before posting a READ too."""
    if time.time() > ref.lease_expires_at + GONE_SLACK_S / 2:
        raise PayloadUnavailableError("payload lease ran out long ago", token=ref.token)
