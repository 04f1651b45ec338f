"""``stageferry health``: the container health check.

A stage replica is healthy when Redis answers and its own worker heartbeat is fresh
(:mod:`stageferry.broker.control.liveness`): a live process whose leader has stopped beating (hung, or stuck waiting
for Redis) is reported unhealthy, so an orchestrator can restart it and ``depends_on: service_healthy``
starts dependants only once the stage really consumes.
"""

from __future__ import annotations

import anyio

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import GAVE_UP, heartbeat_of, is_fresh, replica_id
from stageferry.broker.control.redis_conn import open_client, ping
from stageferry.config import Settings
from stageferry.errors import ControlPlaneError


async def check_health(settings: Settings, *, stage: str | None, timeout: float) -> str | None:
    """``None`` when healthy, else a one-line reason (a stage the pipeline has not: said so, not a missing
    heartbeat)."""
    if stage is not None:
        stages = [s.name for s in settings.load_pipeline().stages]
        if stage not in stages:
            return f"no stage named {stage!r} in the pipeline (its stages: {', '.join(stages)})"
    url = settings.redis_url or "redis://127.0.0.1:6379/0"
    try:
        with anyio.fail_after(timeout):
            async with open_client(url) as redis:
                await ping(redis)
                if stage is None:
                    return None
                beat = await heartbeat_of(redis, Keys(settings.prefix), stage, settings.replica)
    except TimeoutError:
        return f"redis did not answer within {timeout:g}s"
    except ControlPlaneError as exc:
        return exc.message
    name = replica_id(stage, settings.replica)
    if beat is not None and beat.startswith(GAVE_UP.encode()):
        return f"{name!r} gave up: its supervisor restarted it too often (stage {stage!r})"
    if not is_fresh(beat):
        return f"no fresh heartbeat from {name!r} (replica {settings.replica!r} of stage {stage!r})"
    return None


__all__ = ["check_health"]
