"""broker.control.stage_counts: each stage's heartbeats and counts from a real Redis, one round trip."""

from __future__ import annotations

import pytest

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client, ping
from stageferry.broker.control.stage_counts import StageCounts, stage_counts
from stageferry.errors import ControlPlaneError

pytestmark = pytest.mark.anyio


async def test_counts_of_a_stage_with_work_and_of_one_never_started(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        stream = keys.stage_stream("enc")
        await redis.xgroup_create(stream, "enc", id="0", mkstream=True)
        for i in range(3):
            await redis.xadd(stream, {"n": str(i)})
        await redis.xreadgroup("enc", "enc-0", {stream: ">"}, count=2)
        await redis.xadd(keys.dead_letter("enc"), {"why": "x"})
        await redis.hset(keys.workers("enc"), mapping={"enc-0": "123.5", "enc-1": "gave-up 9"})
        counts = await stage_counts(redis, keys, ["enc", "dec"])
    assert counts == [
        StageCounts(
            "enc",
            heartbeats={"enc-0": "123.5", "enc-1": "gave-up 9"},
            queue_length=3,
            pending=2,
            dead_letters=1,
        ),
        StageCounts("dec", heartbeats={}, queue_length=0, pending=None, dead_letters=0),
    ]


async def test_redis_away_is_a_control_plane_error(prefix: str) -> None:
    async with open_client("redis://127.0.0.1:1/0") as redis:
        with pytest.raises(ControlPlaneError):
            await stage_counts(redis, Keys(prefix), ["enc"])
        with pytest.raises(ControlPlaneError):
            await ping(redis)
