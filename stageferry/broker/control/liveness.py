"""Replica liveness: who a replica is, how it says it is alive, and when it counts as alive.

A stage leader writes its heartbeat — the unix time, as text — into the hash
``<p>:stage:<stage>:workers`` (:meth:`Keys.workers`), under its replica id ``"<stage>-<replica>"``
(:func:`replica_id`, which is also its consumer name in the stage's consumer group), every
:data:`HEARTBEAT_EVERY_S`, and removes it when it drains.  A replica is *live* while its last heartbeat
is at most :data:`FRESH_S` old: a killed process drops out after that, a drained one at once.

Everyone who asks reads it through this module, with the same rule: ``stageferry up`` waiting for its
services, ``stageferry health`` (the container check), the gateway's ``/health``, the soak's cluster,
and the tests.  Nothing else writes the hash.  :func:`unheld_note` turns it into what a request's reader
needs to know while a stage is down mid-job: the status still says ``running`` (its last writer is gone),
so ``stageferry status`` and the gateway's video object add that no live worker holds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.errors import ControlPlaneError
from stageferry.schemas import RequestState, RequestStatus

log = structlog.get_logger(__name__)

#: How often a leader writes its heartbeat.
HEARTBEAT_EVERY_S = 2.0
#: A replica counts as live while its heartbeat is at most this old (a few missed beats are tolerated:
#: a leader busy in a long Redis retry is not dead yet).
FRESH_S = 10.0
#: The workers hash outlives its last writer by this much, so a stage that is gone leaves nothing behind.
_HASH_TTL_S = 3600


def replica_id(stage: str, replica: str) -> str:
    """The replica's id: its field in the workers hash and its consumer name in the stage's group."""
    return f"{stage}-{replica}"


def is_fresh(beat: bytes | str | float | None, *, now: float | None = None, fresh_s: float = FRESH_S) -> bool:
    """Whether one heartbeat value (as stored: unix seconds) is recent enough; junk is not."""
    if beat is None:
        return False
    try:
        at = float(beat)
    except ValueError:
        return False
    return (time.time() if now is None else now) - at <= fresh_s


def live_replicas(
    heartbeats: Mapping[bytes | str, bytes | str], *, now: float | None = None, fresh_s: float = FRESH_S
) -> list[str]:
    """The replica ids in a workers hash whose heartbeat is fresh."""
    now = time.time() if now is None else now
    return [
        name.decode() if isinstance(name, bytes) else name
        for name, value in heartbeats.items()
        if is_fresh(value, now=now, fresh_s=fresh_s)
    ]


async def live_by_stage(
    redis: aioredis.Redis, keys: Keys, stages: Sequence[str], *, fresh_s: float = FRESH_S
) -> dict[str, list[str]]:
    """Each stage's live replica ids, sorted (one round trip); :class:`ControlPlaneError` on Redis trouble."""
    with translated():
        async with redis.pipeline(transaction=False) as pipe:
            for stage in stages:
                pipe.hgetall(keys.workers(stage))
            hashes = await pipe.execute()
    now = time.time()
    return {s: sorted(live_replicas(h, now=now, fresh_s=fresh_s)) for s, h in zip(stages, hashes, strict=True)}


async def unheld_note(
    redis: aioredis.Redis, keys: Keys, status: RequestStatus, *, fresh_s: float = FRESH_S
) -> str | None:
    """For a request queued or running at a stage with no live replica, a sentence saying so (one round
    trip); ``None`` when a live worker can hold it, or the request has ended."""
    if status.state not in (RequestState.QUEUED, RequestState.RUNNING) or not status.stage:
        return None
    live = (await live_by_stage(redis, keys, [status.stage], fresh_s=fresh_s))[status.stage]
    if live:
        return None
    return (
        f"no live worker holds it: stage {status.stage!r} has no worker with a heartbeat in the last "
        f"{fresh_s:g} s; the request stays {status.state.value} and resumes when a worker of that stage is back"
    )


async def is_live(redis: aioredis.Redis, keys: Keys, stage: str, replica: str, *, fresh_s: float = FRESH_S) -> bool:
    """Whether this one replica of ``stage`` has a fresh heartbeat."""
    with translated():
        beat = await redis.hget(keys.workers(stage), replica_id(stage, replica))
    return is_fresh(beat, fresh_s=fresh_s)


class Heartbeat:
    """A leader's heartbeat: :meth:`run` beats until cancelled, :meth:`withdraw` removes it on drain."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, stage: str, replica: str) -> None:
        self._redis = redis
        self._key = keys.workers(stage)
        self.id = replica_id(stage, replica)

    async def beat(self) -> None:
        with translated():
            await self._redis.hset(self._key, self.id, str(time.time()))
            await self._redis.expire(self._key, _HASH_TTL_S)

    async def run(self) -> None:
        """Beat every :data:`HEARTBEAT_EVERY_S`; Redis trouble is logged and the next beat tried."""
        while True:
            try:
                await self.beat()
            except ControlPlaneError as exc:
                log.warning("worker.heartbeat_failed", error=exc.message)
            await anyio.sleep(HEARTBEAT_EVERY_S)

    async def withdraw(self) -> None:
        """Drop out of the live set at once (bounded, shielded: it runs while the leader stops)."""
        with anyio.move_on_after(2, shield=True):
            try:
                with translated():
                    await self._redis.hdel(self._key, self.id)
            except ControlPlaneError:
                pass
