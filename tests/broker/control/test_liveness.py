"""Replica liveness against a real Redis: the freshness rule, a heartbeat's life, the per-stage view."""

from __future__ import annotations

import time

import pytest

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import (
    FRESH_S,
    Heartbeat,
    StageReplicas,
    is_fresh,
    is_live,
    live_by_stage,
    live_replicas,
    record_gave_up,
    replica_id,
    replicas_by_stage,
)
from stageferry.broker.control.redis_conn import open_client


def test_live_replicas_keeps_fresh_heartbeats_only() -> None:
    now = 1000.0
    beats: dict[bytes | str, bytes | str] = {b"a": b"995.5", b"b": b"980", "c": "not-a-time", b"d": str(now).encode()}
    assert live_replicas(beats, now=now, fresh_s=10) == ["a", "d"]
    assert not is_fresh(None) and not is_fresh(b"junk")
    assert is_fresh(str(time.time() - FRESH_S + 1)) and not is_fresh(str(time.time() - FRESH_S - 1))


def test_replica_id_is_stage_dash_replica() -> None:
    assert replica_id("diffusion", "box-1") == "diffusion-box-1"


@pytest.mark.anyio
async def test_heartbeat_makes_a_replica_live_until_withdrawn(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        heartbeat = Heartbeat(redis, keys, "encoder", "box-1")
        assert heartbeat.id == "encoder-box-1"
        assert not await is_live(redis, keys, "encoder", "box-1")
        await heartbeat.beat()
        assert await is_live(redis, keys, "encoder", "box-1")
        assert await redis.ttl(keys.workers("encoder")) > 0  # the hash does not outlive its writers for ever
        await redis.hset(keys.workers("diffusion"), "diffusion-old", str(time.time() - 60))
        assert await live_by_stage(redis, keys, ["encoder", "diffusion"]) == {
            "encoder": ["encoder-box-1"],
            "diffusion": [],
        }
        await heartbeat.withdraw()
        assert not await is_live(redis, keys, "encoder", "box-1")
        assert await live_by_stage(redis, keys, ["encoder"]) == {"encoder": []}


@pytest.mark.anyio
async def test_a_replica_that_gave_up_is_named_until_it_beats_again(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        heartbeat = Heartbeat(redis, keys, "encoder", "box-1")
        await heartbeat.beat()
        await Heartbeat(redis, keys, "encoder", "box-2").beat()
        await record_gave_up(redis, keys, "encoder", "box-1")
        assert not await is_live(redis, keys, "encoder", "box-1")  # at once, not once the beat is stale
        assert await replicas_by_stage(redis, keys, ["encoder", "diffusion"]) == {
            "encoder": StageReplicas(live=["encoder-box-2"], gave_up=["encoder-box-1"]),
            "diffusion": StageReplicas(live=[], gave_up=[]),
        }
        await heartbeat.beat()  # started again: its beat replaces the mark
        assert await replicas_by_stage(redis, keys, ["encoder"]) == {
            "encoder": StageReplicas(live=["encoder-box-1", "encoder-box-2"], gave_up=[])
        }
