"""Replica liveness: who a replica is, how it says it is alive, and when it counts as alive.

A stage leader writes its heartbeat — the unix time, as text — into the hash
``<p>:stage:<stage>:workers`` (:meth:`Keys.workers`), under its replica id ``"<stage>-<replica>"``
(:func:`replica_id`, which is also its consumer name in the stage's consumer group), every
:data:`HEARTBEAT_EVERY_S`, and removes it when it drains.  A replica is *live* while its last heartbeat
is at most :data:`FRESH_S` old: a killed process drops out after that, a drained one at once.

A replica whose supervisor gave up restarting it (:mod:`stageferry.stages.process.supervisor`) writes
``gave-up <unix time>`` in place of its heartbeat (:func:`record_gave_up`): not a time, so it is not live
at once, and the health checks name it (:func:`replicas_by_stage`) until the replica beats again (it was
restarted) or the hash expires.

Everyone who asks reads it through this module, with the same rule: ``stageferry up`` waiting for its
services, ``stageferry health`` (the container check), the gateway's ``/health``, the soak's cluster,
and the tests.  Nothing else writes the hash.  :func:`unheld_note` turns it into what a request's reader
needs to know while a stage is down mid-job: the status still says ``running`` (its last writer is gone),
so ``stageferry status`` and the gateway's video object add that no live worker holds it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
#: What stands in a replica's field once its supervisor gave up on it: ``gave-up <unix time>``.
GAVE_UP = "gave-up"


@dataclass(frozen=True, slots=True)
class StageReplicas:
    """One stage's replicas as the workers hash has them: live ones, and those whose supervisor gave up."""

    live: list[str]
    gave_up: list[str]


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


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def gave_up_replicas(heartbeats: Mapping[bytes | str, bytes | str]) -> list[str]:
    """The replica ids in a workers hash whose supervisor gave up on them (:func:`record_gave_up`)."""
    return [_text(name) for name, value in heartbeats.items() if _text(value).startswith(GAVE_UP)]


async def replicas_by_stage(
    redis: aioredis.Redis, keys: Keys, stages: Sequence[str], *, fresh_s: float = FRESH_S
) -> dict[str, StageReplicas]:
    """Each stage's live and given-up replica ids, sorted (one round trip); :class:`ControlPlaneError` on
    Redis trouble."""
    with translated():
        async with redis.pipeline(transaction=False) as pipe:
            for stage in stages:
                pipe.hgetall(keys.workers(stage))
            hashes = await pipe.execute()
    now = time.time()
    return {
        s: StageReplicas(sorted(live_replicas(h, now=now, fresh_s=fresh_s)), sorted(gave_up_replicas(h)))
        for s, h in zip(stages, hashes, strict=True)
    }


async def live_by_stage(
    redis: aioredis.Redis, keys: Keys, stages: Sequence[str], *, fresh_s: float = FRESH_S
) -> dict[str, list[str]]:
    """Each stage's live replica ids, sorted (one round trip); :class:`ControlPlaneError` on Redis trouble."""
    by_stage = await replicas_by_stage(redis, keys, stages, fresh_s=fresh_s)
    return {stage: replicas.live for stage, replicas in by_stage.items()}


async def record_gave_up(redis: aioredis.Redis, keys: Keys, stage: str, replica: str) -> None:
    """Put ``gave-up <now>`` in place of this replica's heartbeat: it is not live from now on, and the
    health checks say why (written by its supervisor as it gives up)."""
    with translated():
        await redis.hset(keys.workers(stage), replica_id(stage, replica), f"{GAVE_UP} {time.time():.3f}")
        await redis.expire(keys.workers(stage), _HASH_TTL_S)


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
    return is_fresh(await heartbeat_of(redis, keys, stage, replica), fresh_s=fresh_s)


async def heartbeat_of(redis: aioredis.Redis, keys: Keys, stage: str, replica: str) -> bytes | None:
    """This one replica's field in the workers hash as stored (a heartbeat, ``gave-up ...``, or ``None``)."""
    with translated():
        beat: bytes | None = await redis.hget(keys.workers(stage), replica_id(stage, replica))
    return beat


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
