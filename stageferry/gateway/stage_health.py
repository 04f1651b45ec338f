"""The stages as the console shows them: replicas and heartbeat ages, placement, queues and pools.

Everything comes from Redis and the pipeline config, in one pipelined round trip: the workers hash
(liveness is :mod:`stageferry.broker.control.liveness`'s rule), the input stream's length and the
group's pending count (entries handed out, not yet acknowledged), the dead-letter stream's length.
Placement is the configured one: each rank of a group uses GPU ``rank`` modulo its host's GPU count
(``stages/group.py``), which the gateway cannot see, so the device is named as configured.  Pool sizes
are the data plane's configured capacities (bytes in use are a per-process gauge, in the counters).
"""

from __future__ import annotations

import time

import anyio

from stageferry.broker.control.liveness import is_fresh
from stageferry.broker.control.redis_conn import translated
from stageferry.client import Client
from stageferry.config import StageConfig
from stageferry.errors import ControlPlaneError
from stageferry.schemas.console import Pool, RankPlacement, Replica, StageHealth, StagesReport

#: The report never waits longer than this on Redis.
REPORT_TIMEOUT_S = 2.0
#: Ranks listed per stage at most (a group is bounded by the config anyway).
MAX_RANKS = 64


def _ranks(stage: StageConfig) -> list[RankPlacement]:
    world = stage.layout.world_size
    return [
        RankPlacement(rank=r, device="cpu" if stage.device == "cpu" else f"{stage.device}:{r}")
        for r in range(min(world, MAX_RANKS))
    ]


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def stage_report(client: Client, *, fresh_s: float) -> StagesReport:
    """Each stage's state (never raises: Redis trouble is a problem in the answer)."""
    pipeline = client.pipeline
    keys = client.keys
    replies: list[object] = []
    problems: list[str] = []
    with anyio.move_on_after(REPORT_TIMEOUT_S) as scope:
        try:
            with translated():
                async with client.redis.pipeline(transaction=False) as pipe:
                    for stage in pipeline.stages:
                        pipe.hgetall(keys.workers(stage.name))
                        pipe.xlen(keys.stage_stream(stage.name))
                        pipe.xpending(keys.stage_stream(stage.name), stage.name)
                        pipe.xlen(keys.dead_letter(stage.name))
                    replies = await pipe.execute(raise_on_error=False)
        except ControlPlaneError as exc:
            problems.append(f"redis: {exc.message}")
    if scope.cancelled_caught:
        problems.append(f"redis: no answer within {REPORT_TIMEOUT_S:g}s")
    redis_ok = bool(replies)
    now = time.time()
    data_plane = pipeline.data_plane
    stages = []
    for i, stage in enumerate(pipeline.stages):
        workers, length, pending, dead = replies[4 * i : 4 * i + 4] if redis_ok else ({}, None, None, None)
        replicas = []
        for name, beat in sorted((workers if isinstance(workers, dict) else {}).items()):
            try:
                age: float | None = max(0.0, now - float(beat))
            except ValueError:
                age = None
            replicas.append(Replica(id=_text(name), heartbeat_age_s=age, live=is_fresh(beat, now=now, fresh_s=fresh_s)))
        if redis_ok and not any(r.live for r in replicas):
            problems.append(f"stage {stage.name}: no live worker")
        pools = [Pool(kind="cpu", capacity_bytes=data_plane.cpu_pool_bytes)]
        if stage.device != "cpu" and data_plane.gpu_pool_bytes:
            pools.append(Pool(kind="cuda", capacity_bytes=data_plane.gpu_pool_bytes))
        stages.append(
            StageHealth(
                name=stage.name,
                layout=stage.layout.describe(),
                device=stage.device,
                ranks=_ranks(stage),
                replicas=replicas,
                queue_length=_int_or_none(length),
                pending=_int_or_none(pending.get("pending")) if isinstance(pending, dict) else None,
                dead_letters=_int_or_none(dead),
                pools=pools,
            )
        )
    return StagesReport(redis=redis_ok, stages=stages, problems=problems)


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
