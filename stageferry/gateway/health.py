"""Health: Redis answers, and every stage of the pipeline has a worker with a fresh heartbeat.

Liveness is :mod:`stageferry.broker.control.liveness`'s, the rule ``stageferry up`` and ``stageferry
health`` use too: a stage whose workers were killed outright drops out once its last heartbeat is older
than the freshness bound, a drained one at once.
"""

from __future__ import annotations

import anyio

from stageferry.broker.control.liveness import FRESH_S, live_by_stage
from stageferry.broker.control.redis_conn import translated
from stageferry.client import Client
from stageferry.errors import ControlPlaneError
from stageferry.gateway.objects import Health

#: A health check never waits longer than this on Redis.
HEALTH_TIMEOUT_S = 2.0


async def check_health(client: Client, *, fresh_s: float = FRESH_S) -> Health:
    """The deployment's health as seen from here (never raises: trouble is a problem in the answer)."""
    stages = [s.name for s in client.pipeline.stages]
    live: dict[str, list[str]] = {}
    problems: list[str] = []
    redis_ok = False
    with anyio.move_on_after(HEALTH_TIMEOUT_S) as scope:
        try:
            with translated():
                await client.redis.ping()
            redis_ok = True
            live = await live_by_stage(client.redis, client.keys, stages, fresh_s=fresh_s)
        except ControlPlaneError as exc:
            problems.append(f"redis: {exc.message}")
    if scope.cancelled_caught:
        problems.append(f"redis: no answer within {HEALTH_TIMEOUT_S:g}s")
    problems += [f"stage {s}: no live worker" for s in stages if redis_ok and not live.get(s)]
    ok = redis_ok and not problems
    return Health(status="ok" if ok else "unhealthy", redis=redis_ok, stages=live, problems=problems)
