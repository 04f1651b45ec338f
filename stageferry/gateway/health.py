"""Health: Redis answers, every stage of the pipeline has a worker with a fresh heartbeat, and no replica's
supervisor gave up restarting it (``gave_up``: until that replica is started again).

Behind Sentinel the report also says when a failover of the Redis master runs (``failover``, from the
sentinels' own flags for the master: ``s_down``, ``o_down``, ``failover_in_progress``, ...), so the
moment the master is gone is told as what it is, not as a plain outage.

Liveness is :mod:`stageferry.broker.control.liveness`'s, the rule ``stageferry up`` and ``stageferry
health`` use too: a stage whose workers were killed outright drops out once its last heartbeat is older
than the freshness bound, a drained one at once.

A gateway under load must not look down when it is not: a 503 from ``/health`` gets it restarted in the
middle of the burst it is serving.  So the gateway checks in the background (:class:`HealthMonitor`,
every second) over a connection of its own (:func:`health_connection`), not the pool its requests queue
for, and ``/health`` answers the latest report at once; a report older than ``stale_s`` is itself a
problem (the check is stuck).  A check that merely *timed out* (Redis, or this busy process, slower than
:data:`HEALTH_TIMEOUT_S` for a moment) replaces a healthy report only when the trouble lasts
``slow_grace_s``; a refused connection or a stage without a live worker shows at once.
"""

from __future__ import annotations

import time

import anyio
import anyio.abc
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.liveness import FRESH_S, replicas_by_stage
from stageferry.broker.control.redis_conn import connect, failover_state, ping
from stageferry.client import Client
from stageferry.errors import ControlPlaneError
from stageferry.gateway.objects import Health

#: A health check never waits longer than this on Redis.
HEALTH_TIMEOUT_S = 2.0
_TIMED_OUT = "redis: no answer within"

log = structlog.get_logger(__name__)


def _timed_out(report: Health) -> bool:
    return any(problem.startswith(_TIMED_OUT) for problem in report.problems)


def health_connection(url: str) -> aioredis.Redis:
    """A client for health checks alone (one connection, two at most)."""
    return connect(url, retries=1, max_connections=2)


async def check_health(client: Client, *, fresh_s: float = FRESH_S, redis: aioredis.Redis | None = None) -> Health:
    """The deployment's health as seen from here, over ``redis`` (default: the client's own pool); never
    raises: trouble is a problem in the answer."""
    redis = redis if redis is not None else client.redis
    stages = [s.name for s in client.pipeline.stages]
    live: dict[str, list[str]] = {}
    gave_up: dict[str, list[str]] = {}
    problems: list[str] = []
    redis_ok = False
    with anyio.move_on_after(HEALTH_TIMEOUT_S) as scope:
        try:
            await ping(redis)
            redis_ok = True
            by_stage = await replicas_by_stage(redis, client.keys, stages, fresh_s=fresh_s)
            live = {s: r.live for s, r in by_stage.items()}
            gave_up = {s: r.gave_up for s, r in by_stage.items() if r.gave_up}
        except ControlPlaneError as exc:
            problems.append(f"redis: {exc.message}")
    if scope.cancelled_caught:
        problems.append(f"{_TIMED_OUT} {HEALTH_TIMEOUT_S:g}s")
    problems += [f"stage {s}: no live worker" for s in stages if redis_ok and not live.get(s)]
    problems += [f"stage {s}: replica {r} gave up restarting" for s, replicas in gave_up.items() for r in replicas]
    failover = await failover_state(redis)
    if failover is not None:
        problems.append(f"redis: Sentinel failover in progress ({failover}); requests wait for the new master")
    ok = redis_ok and not problems
    return Health(
        status="ok" if ok else "unhealthy", redis=redis_ok, stages=live, gave_up=gave_up, problems=problems,
        failover=failover,
    )  # fmt: skip


class HealthMonitor:
    """Checks the deployment every ``interval_s`` in the background; :meth:`report` is the latest."""

    def __init__(
        self,
        client: Client,
        redis: aioredis.Redis,
        *,
        fresh_s: float = FRESH_S,
        interval_s: float = 1.0,
        stale_s: float = 10.0,
        slow_grace_s: float = 5.0,
    ) -> None:
        self._client = client
        self._redis = redis
        self._fresh_s = fresh_s
        self._interval_s = interval_s
        self._stale_s = stale_s
        self._slow_grace_s = slow_grace_s
        self._latest = Health(status="unhealthy", redis=False, stages={}, problems=["not checked yet"])
        self._at = time.monotonic()
        self._last_ok = -float("inf")

    async def check(self) -> Health:
        report = await check_health(self._client, fresh_s=self._fresh_s, redis=self._redis)
        now = time.monotonic()
        self._at = now
        if report.status == "ok":
            self._last_ok = now
        elif _timed_out(report) and now - self._last_ok <= self._slow_grace_s:
            log.info("gateway.health_slow", problems=report.problems, since_ok_s=round(now - self._last_ok, 1))
            return self._latest  # slow for a moment: the last healthy report stands
        self._latest = report
        return report

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Check now, report started, then check every ``interval_s`` until cancelled."""
        await self.check()
        task_status.started()
        while True:
            await anyio.sleep(self._interval_s)
            await self.check()

    def report(self) -> Health:
        """The latest report (answered at once), or unhealthy when no check finished for ``stale_s``."""
        age = time.monotonic() - self._at
        if age <= self._stale_s:
            return self._latest
        stale = f"health check stuck: last report {age:.0f}s old"
        return self._latest.model_copy(update={"status": "unhealthy", "problems": [*self._latest.problems, stale]})
