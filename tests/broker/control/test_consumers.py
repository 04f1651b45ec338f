"""A stage group's gone consumers, pruned when a replica makes sure of its group, on real Redis: those that
hold nothing, idled past the threshold and have no fresh heartbeat go (never this replica's own); one that
holds an entry stays, however idle, and its entry with it; a live replica stays, however idle (before
Redis 7.2 its empty reads do not count); a replica pruned while it lived after all gets its next entry;
the most deleted per prune is bounded; an ACL without the commands is logged and stops nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from stageferry.broker.control.consumers import ConsumerPruner
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import Heartbeat
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.streams import StageStream
from tests.security.servers import AclRedis

pytestmark = pytest.mark.anyio


def replica(redis: object, keys: Keys, name: str) -> StageStream:
    return StageStream(redis, keys, "diffusion", f"diffusion-{name}", visibility_ms=60_000)  # type: ignore[arg-type]


async def consumers(redis: object, keys: Keys) -> dict[str, int]:
    """Each consumer of the group, with how many entries it holds."""
    rows = await redis.xinfo_consumers(keys.stage_stream("diffusion"), "diffusion")  # type: ignore[attr-defined]
    return {row["name"].decode(): row["pending"] for row in rows}


async def test_gone_consumers_go_and_one_that_holds_an_entry_stays(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        holder, idle, me = replica(redis, keys, "holder"), replica(redis, keys, "idle"), replica(redis, keys, "me")
        await holder.ensure_group()
        await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r1"})
        (held,) = await holder.read(1, block_ms=0)  # "holder" dies holding r1
        assert await idle.read(1, block_ms=0) == []  # "idle" read once, holds nothing, then died
        assert await me.read(1, block_ms=0) == []
        assert await consumers(redis, keys) == {"diffusion-holder": 1, "diffusion-idle": 0, "diffusion-me": 0}

        assert await me.pruner.prune(stale_s=3600) == (), "none idled an hour: none goes"
        with capture_logs() as logs:
            assert await me.pruner.prune(stale_s=0) == ("diffusion-idle",)
        assert await consumers(redis, keys) == {"diffusion-holder": 1, "diffusion-me": 0}
        assert [(e["event"], e["count"]) for e in logs if e["event"] == "stream.consumers_pruned"] == [
            ("stream.consumers_pruned", 1)
        ]
        # the held entry is still pending, owned by its dead holder, for a live replica to reclaim
        pending = await redis.xpending_range(keys.stage_stream("diffusion"), "diffusion", "-", "+", 10)
        assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [(held.id, "diffusion-holder")]

        # reclaimed by a live replica: the dead holder holds nothing any more, and goes at the next start
        await redis.xclaim(keys.stage_stream("diffusion"), "diffusion", "diffusion-me", 0, [held.id])
        later = replica(redis, keys, "later")
        await later.ensure_group()  # a replica's start prunes, with the threshold: none here is that old
        assert await consumers(redis, keys) == {"diffusion-holder": 0, "diffusion-me": 1}
        assert await later.pruner.prune(stale_s=0) == ("diffusion-holder",)
        assert await consumers(redis, keys) == {"diffusion-me": 1}, "the live holder of r1 stays"
        for stream in (holder, idle, me, later):
            await stream.aclose()


async def test_a_live_replica_stays_and_one_pruned_while_stalled_reads_on(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        live, quiet, other = replica(redis, keys, "live"), replica(redis, keys, "quiet"), replica(redis, keys, "other")
        await live.ensure_group()
        assert await live.read(1, block_ms=0) == [] and await quiet.read(1, block_ms=0) == []
        await Heartbeat(redis, keys, "diffusion", "live").beat()  # "live" beats; "quiet" stalled (no heartbeat)
        assert await other.pruner.prune(stale_s=0) == ("diffusion-quiet",)
        assert set(await consumers(redis, keys)) == {"diffusion-live"}
        await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r2"})
        (entry,) = await quiet.read(1, block_ms=0)  # back from its stall: the read delivers, and makes it again
        assert entry.text("request_id") == "r2" and (await consumers(redis, keys))["diffusion-quiet"] == 1
        assert await quiet.ack(entry.id)
        for stream in (live, quiet, other):
            await stream.aclose()


async def test_one_prune_deletes_at_most_its_bound(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    stream = keys.stage_stream("diffusion")
    async with open_client(redis_url) as redis:
        await redis.xgroup_create(stream, "diffusion", id="0", mkstream=True)
        for i in range(5):  # five replicas that came and went (XGROUP CREATECONSUMER: as a first read makes them)
            await redis.execute_command("XGROUP", "CREATECONSUMER", stream, "diffusion", f"diffusion-gone{i}")
        pruner = ConsumerPruner(redis, keys, "diffusion", [stream], "diffusion-me")
        assert len(await pruner.prune(stale_s=0, most=3)) == 3
        assert len(await pruner.prune(stale_s=0, most=3)) == 2
        assert await consumers(redis, keys) == {}


async def test_an_acl_without_the_commands_is_logged_and_the_replica_starts(tmp_path: Path, prefix: str) -> None:
    keys = Keys(prefix)
    with AclRedis(tmp_path, prefix) as server:
        admin = server.admin()
        try:
            admin.execute_command("ACL", "SETUSER", "stageferry", "-xinfo|consumers", "-xgroup|delconsumer")
        finally:
            admin.close()
        async with open_client(server.url("stageferry")) as redis:
            stream = replica(redis, keys, "a")
            with capture_logs() as logs:
                await stream.ensure_group()  # the group is made; the prune is refused, and logged
            assert [e["event"] for e in logs if "prune" in e["event"]] == ["stream.consumers_prune_refused"]
            await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r3"})
            (entry,) = await stream.read(1, block_ms=0)
            assert await stream.ack(entry.id)
            await stream.aclose()
