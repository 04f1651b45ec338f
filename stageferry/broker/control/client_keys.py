"""The keys a client may write, held to their bounds after the fact: size, and a TTL.

A client's ACL user may ``SET`` its cancel flags (``<p>:req-cancel:ID``), "submitted" markers
(``<p>:req-submitted:ID``) and uploads (``<p>:upload:ID:*``), and Redis ACLs bound neither the value
nor the TTL of a ``SET``: a client could leave a 16 MiB cancel flag that never expires.  What ACLs cannot
bound is bounded by how the stages read those keys and by this sweep:

* read bounded: a stage only ``EXISTS`` a cancel flag or a marker, and ``STRLEN``s an upload before it
  ``GET``s it (:mod:`stageferry.stages.entry.media`); nothing else a client writes is read;
* swept: the first stage's leader walks the three patterns with ``SCAN`` (a bounded ``COUNT`` a step, the
  cursor kept between steps) and, for each key found, deletes it when it is longer than its bound and
  gives it its bound TTL when it has none or a longer one (:class:`KeyBound`).  A deleted upload leaves its
  job to be rejected as a missing upload; a deleted flag or marker is one that no stageferry client
  writes.

One sweep every :data:`SWEEP_EVERY_S` is enough for the whole deployment, not one per first-stage replica:
before each sweep a replica takes the turn (``SET NX`` on ``<p>:client-keys:sweep`` for that long) and
skips the sweep when another replica holds it.  (Eight replicas each sweeping a keyspace of a few hundred
thousand request keys kept ``SCAN`` running all the time: about 0.8 ms of Redis a step.)  A replica that
dies mid-sweep leaves the turn to expire; the next sweep starts over from the cursors' start.

Memory as a whole is bounded by Redis itself: the shipped config sets ``maxmemory`` with
``noeviction`` (docs/security.md, "Redis memory").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.errors import ControlPlaneError

log = structlog.get_logger(__name__)

#: Keys looked at per ``SCAN`` step, and the pause between steps of one sweep and between sweeps.
SCAN_COUNT = 500
STEP_PAUSE_S = 0.05
SWEEP_EVERY_S = 30.0
#: What a cancel flag or a "submitted" marker may hold (stageferry writes ``1`` or the stage's name).
FLAG_MAX_BYTES = 64


@dataclass(frozen=True, slots=True)
class KeyBound:
    """One pattern of client-written keys and its bounds."""

    pattern: str
    max_bytes: int
    ttl_s: int


@dataclass(frozen=True, slots=True)
class Swept:
    """What one step did: keys looked at, given a TTL, deleted (too large, or not a string)."""

    scanned: int
    expired: int
    deleted: int
    done: bool  #: the step ended a full pass over its pattern


def client_key_bounds(keys: Keys, *, request_ttl_s: int, max_upload_bytes: int) -> tuple[KeyBound, ...]:
    """The bounds of every key a client's ACL user may write (``stageferry.acl``)."""
    return (
        KeyBound(keys.cancel("*"), FLAG_MAX_BYTES, request_ttl_s),
        KeyBound(keys.submitted("*"), FLAG_MAX_BYTES, request_ttl_s),
        KeyBound(keys.upload_prefix() + "*", max_upload_bytes, request_ttl_s),
    )


class ClientKeySweeper:
    """Walks the client-written keys (see the module docstring); run by the first stage's leader."""

    def __init__(
        self,
        redis: aioredis.Redis,
        bounds: Sequence[KeyBound],
        *,
        count: int = SCAN_COUNT,
        turn: str | None = None,
        holder: str = "",
    ) -> None:
        self._redis = redis
        self.bounds = tuple(bounds)
        self._count = count
        self._cursors = [0] * len(self.bounds)
        #: The key whose ``SET NX`` gives one replica the next sweep (None: sweep every time, alone).
        self._turn = turn
        self._holder = holder or "sweeper"

    async def step(self, index: int) -> Swept:
        """One ``SCAN`` step over pattern ``index``, and the fixes of what it found (three round trips)."""
        bound = self.bounds[index]
        with translated():
            cursor, found = await self._redis.scan(self._cursors[index], match=bound.pattern, count=self._count)
            self._cursors[index] = int(cursor)
            if not found:
                return Swept(0, 0, 0, done=int(cursor) == 0)
            async with self._redis.pipeline(transaction=False) as pipe:
                for key in found:
                    pipe.pttl(key)
                    pipe.strlen(key)
                replies = await pipe.execute(raise_on_error=False)
            expired = deleted = 0
            async with self._redis.pipeline(transaction=False) as pipe:
                for i, key in enumerate(found):
                    pttl, size = replies[2 * i], replies[2 * i + 1]
                    if isinstance(size, Exception) or (isinstance(size, int) and size > bound.max_bytes):
                        pipe.delete(key)
                        deleted += 1
                    elif isinstance(pttl, int) and (pttl == -1 or pttl > bound.ttl_s * 1000):
                        pipe.expire(key, bound.ttl_s)
                        expired += 1
                if expired or deleted:
                    await pipe.execute(raise_on_error=False)
        if expired or deleted:
            log.warning("client_keys.bounded", pattern=bound.pattern, expired=expired, deleted=deleted)
        return Swept(len(found), expired, deleted, done=int(cursor) == 0)

    async def sweep(self) -> Swept:
        """One full pass over every pattern (pausing :data:`STEP_PAUSE_S` between steps); the totals."""
        scanned = expired = deleted = 0
        for index in range(len(self.bounds)):
            while True:
                swept = await self.step(index)
                scanned, expired, deleted = scanned + swept.scanned, expired + swept.expired, deleted + swept.deleted
                if swept.done:
                    break
                await anyio.sleep(STEP_PAUSE_S)
        return Swept(scanned, expired, deleted, done=True)

    async def my_turn(self, every_s: float) -> bool:
        """Whether this replica sweeps now: it took the turn for ``every_s`` (or there is no turn key)."""
        if self._turn is None:
            return True
        with translated():
            return bool(await self._redis.set(self._turn, self._holder, nx=True, px=int(every_s * 1000)))

    async def run(self, every_s: float = SWEEP_EVERY_S) -> None:
        """Sweep every ``every_s`` until cancelled, when it is this replica's turn; Redis trouble is logged
        and waited out, never raised (the sweep must not stop the stage)."""
        while True:
            try:
                if await self.my_turn(every_s):
                    await self.sweep()
            except ControlPlaneError as exc:
                log.warning("client_keys.sweep_failed", error=exc.message)
            await anyio.sleep(every_s)


@dataclass(frozen=True, slots=True)
class Upload:
    """An upload as the stage read it: its length, and its bytes unless it is longer than the reader's
    bound (``data`` None) or gone (``size`` 0)."""

    size: int
    data: bytes | None


async def read_upload(redis: aioredis.Redis, key: str, max_bytes: int) -> Upload:
    """An upload's bytes, at most ``max_bytes`` of them, in one command: ``GETRANGE key 0 max_bytes``
    reads one byte past the bound, so a value longer than it is known without being read whole — also
    one a client wrote between a length check and the read (the length is asked for, for the refusal's
    message, only then)."""
    with translated():
        data = await redis.getrange(key, 0, max_bytes)
        if len(data) <= max_bytes:
            return Upload(len(data), bytes(data))
        return Upload(max(int(await redis.strlen(key)), max_bytes + 1), None)


__all__ = ["ClientKeySweeper", "KeyBound", "Swept", "Upload", "client_key_bounds", "read_upload"]
