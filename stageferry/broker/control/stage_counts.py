"""What Redis knows of each stage at a glance, in one pipelined round trip: typed replies.

Per stage: its workers hash (heartbeats by replica id, :mod:`.liveness` says what counts as live), the
input stream's length, the consumer group's pending count (entries handed out, not yet acknowledged) and
the dead-letter stream's length.  A count Redis cannot give (no such stream or group yet) is ``None``, not
an error; Redis being away is a :class:`~stageferry.errors.ControlPlaneError` (translated here).  The web
console's stages report (``gateway/stage_health.py``) is built on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated


@dataclass(frozen=True, slots=True)
class StageCounts:
    """One stage's workers hash (replica id → its heartbeat field, as text) and counts."""

    stage: str
    heartbeats: Mapping[str, str] = field(default_factory=dict)
    queue_length: int | None = None
    pending: int | None = None
    dead_letters: int | None = None


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def stage_counts(redis: aioredis.Redis, keys: Keys, stages: Sequence[str]) -> list[StageCounts]:
    """Each of ``stages``' counts, in order (one round trip)."""
    with translated():
        async with redis.pipeline(transaction=False) as pipe:
            for stage in stages:
                pipe.hgetall(keys.workers(stage))
                pipe.xlen(keys.stage_stream(stage))
                pipe.xpending(keys.stage_stream(stage), stage)
                pipe.xlen(keys.dead_letter(stage))
            replies = await pipe.execute(raise_on_error=False)
    out = []
    for i, stage in enumerate(stages):
        workers, length, pending, dead = replies[4 * i : 4 * i + 4]
        beats = {_text(k): _text(v) for k, v in workers.items()} if isinstance(workers, dict) else {}
        out.append(
            StageCounts(
                stage,
                heartbeats=beats,
                queue_length=_count(length),
                pending=_count(pending.get("pending")) if isinstance(pending, dict) else None,
                dead_letters=_count(dead),
            )
        )
    return out


__all__ = ["StageCounts", "stage_counts"]
