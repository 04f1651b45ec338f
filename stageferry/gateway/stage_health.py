"""The stages as the console shows them: replicas and heartbeat ages, placement, queues and pools.

Everything comes from Redis (:mod:`stageferry.broker.control.stage_counts`, one round trip: the workers
hash, the input stream's length, the group's pending count, the dead-letter stream's length; liveness is
:mod:`stageferry.broker.control.liveness`'s rule) and the pipeline config.
Placement is the configured one: each rank of a group uses GPU ``rank`` modulo its host's GPU count
(``stages/group.py``), which the gateway cannot see, so the device is named as configured.  Pool sizes
are the data plane's configured capacities (bytes in use are a per-process gauge, in the counters).
"""

from __future__ import annotations

import time

import anyio

from stageferry.broker.control.liveness import is_fresh
from stageferry.broker.control.stage_counts import StageCounts, stage_counts
from stageferry.client import Client
from stageferry.config import StageConfig
from stageferry.errors import ControlPlaneError
from stageferry.schemas.console_api import Pool, RankPlacement, Replica, StageHealth, StagesReport

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


async def stage_report(client: Client, *, fresh_s: float) -> StagesReport:
    """Each stage's state (never raises: Redis trouble is a problem in the answer)."""
    pipeline = client.pipeline
    counts: list[StageCounts] = []
    problems: list[str] = []
    with anyio.move_on_after(REPORT_TIMEOUT_S) as scope:
        try:
            counts = await stage_counts(client.redis, client.keys, [s.name for s in pipeline.stages])
        except ControlPlaneError as exc:
            problems.append(f"redis: {exc.message}")
    if scope.cancelled_caught:
        problems.append(f"redis: no answer within {REPORT_TIMEOUT_S:g}s")
    redis_ok = bool(counts)
    now = time.time()
    data_plane = pipeline.data_plane
    stages = []
    for i, stage in enumerate(pipeline.stages):
        counted = counts[i] if redis_ok else StageCounts(stage.name)
        replicas = []
        for name, beat in sorted(counted.heartbeats.items()):
            try:
                age: float | None = max(0.0, now - float(beat))
            except ValueError:
                age = None
            replicas.append(Replica(id=name, heartbeat_age_s=age, live=is_fresh(beat, now=now, fresh_s=fresh_s)))
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
                queue_length=counted.queue_length,
                pending=counted.pending,
                dead_letters=counted.dead_letters,
                pools=pools,
            )
        )
    return StagesReport(redis=redis_ok, stages=stages, problems=problems)
