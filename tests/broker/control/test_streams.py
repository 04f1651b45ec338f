"""A stage stream's read, on real Redis: it claims each new entry's lease in the same script
(:class:`LeaseClaim`): won, taken already, not tried for redeliveries or without the field, and never
outside the prefix; a new-only read skips the entries in hand; the links stay hot after an entry."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from stageferry.broker.control import functions
from stageferry.broker.control.entry_records import crash_field
from stageferry.broker.control.entry_records.scripts import ENTRY_LIBRARY
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import LEASE_FIELD, LeaseClaim, StageStream
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.errors import ControlPlaneError
from stageferry.schemas import RequestState, RequestStatus

pytestmark = pytest.mark.anyio


def reader(redis: object, keys: Keys, consumer: str, claim: LeaseClaim | None) -> StageStream:
    return StageStream(redis, keys, "diffusion", consumer, visibility_ms=0, lease_claim=claim)  # type: ignore[arg-type]


async def test_a_new_entry_s_lease_is_claimed_by_the_read_once(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    claim = LeaseClaim(prefix=keys.claim(""), holder="agent-a", ttl_ms=30_000)
    async with open_client(redis_url) as redis:
        a = reader(redis, keys, "diffusion-a", claim)
        await a.ensure_group()
        stream = keys.stage_stream("diffusion")
        await redis.xadd(stream, {"request_id": "r1", LEASE_FIELD: "tok-1"})
        await redis.xadd(stream, {"request_id": "r2", LEASE_FIELD: "tok-1"})  # the same lease, named again
        await redis.xadd(stream, {"request_id": "r3"})  # no lease: nothing to claim
        first, second, third = await a.read(3, block_ms=0)
        assert first.claimed("tok-1") is True
        assert await redis.get(keys.claim("tok-1")) == b"agent-a"
        assert 29_000 < await redis.pttl(keys.claim("tok-1")) <= 30_000
        assert second.claimed("tok-1") is False, "a lease already claimed is not claimed again"
        assert third.lease_claimed is None and third.claimed("tok-1") is None
        assert first.claimed("tok-2") is None, "the read's claim answers only for the lease it named"


async def test_redeliveries_and_readers_without_a_claim_take_none(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    claim = LeaseClaim(prefix=keys.claim(""), holder="agent-b", ttl_ms=30_000)
    async with open_client(redis_url) as redis:
        plain = reader(redis, keys, "diffusion-a", None)
        b = reader(redis, keys, "diffusion-b", claim)
        await plain.ensure_group()
        await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r1", LEASE_FIELD: "tok-9"})
        (entry,) = await plain.read(1, block_ms=0)
        assert entry.lease_claimed is None and await redis.exists(keys.claim("tok-9")) == 0
        # Reclaimed by another replica (idle past the visibility timeout of 0): a redelivery, whose first
        # consumer may still be READing — the read leaves the claim to the connector.
        (again,) = await b.read(1, block_ms=0)
        assert again.id == entry.id and again.deliveries == 2
        assert again.lease_claimed is None and await redis.exists(keys.claim("tok-9")) == 0


async def test_a_lease_field_cannot_aim_the_claim_outside_the_prefix(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    claim = LeaseClaim(prefix=keys.claim(""), holder="agent-c", ttl_ms=30_000)
    victim = f"{prefix}:victim"
    async with open_client(redis_url) as redis:
        await redis.set(victim, b"untouched")
        c = reader(redis, keys, "diffusion-c", claim)
        await c.ensure_group()
        stream = keys.stage_stream("diffusion")
        await redis.xadd(stream, {"request_id": "r1", LEASE_FIELD: victim})
        await redis.xadd(stream, {"request_id": "r2", LEASE_FIELD: "x" * 201})  # too long: not tried
        await redis.xadd(stream, {"request_id": "r3", LEASE_FIELD: ""})
        hostile, long, empty = await c.read(3, block_ms=0)
        assert hostile.claimed(victim) is True, "claimed under the prefix, as a key of its own"
        assert await redis.get(keys.claim(victim)) == b"agent-c"
        assert await redis.get(victim) == b"untouched"
        assert long.lease_claimed is None and empty.lease_claimed is None


async def test_a_woken_read_survives_a_redis_that_forgot_its_script(prefix: str) -> None:
    """The wait's pipeline names the read script by its hash; on a server that lost it (restart,
    ``SCRIPT FLUSH``) the read is retried on its own, which loads it: the entry still comes back, claimed."""
    keys = Keys(prefix)
    claim = LeaseClaim(prefix=keys.claim(""), holder="agent-d", ttl_ms=30_000)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        d = reader(redis, keys, "diffusion-d", claim)
        await d.ensure_group()
        assert await d.read(1, block_ms=0) == []  # loads the script

        async def write_later() -> None:  # while the read waits: forget the script, write, wake it
            with anyio.fail_after(30):
                while not (await redis.info("clients"))["blocked_clients"]:  # the read waits in its BLPOP
                    await anyio.sleep(0.01)
            async with redis.pipeline(transaction=True) as pipe:
                pipe.script_flush()
                pipe.xadd(keys.stage_stream("diffusion"), {"request_id": "r1", LEASE_FIELD: "tok-5"})
                pipe.lpush(keys.wake("diffusion"), b"1")
                await pipe.execute()

        async with anyio.create_task_group() as tg:
            tg.start_soon(write_later)
            (entry,) = await d.read(1, block_ms=5_000)
        assert entry.text("request_id") == "r1" and entry.claimed("tok-5") is True
        assert await redis.get(keys.claim("tok-5")) == b"agent-d"


async def test_a_stream_keeps_its_links_hot_after_an_entry_is_delivered_or_settled(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        hot = StageStream(redis, keys, "diffusion", "diffusion-hot", visibility_ms=60_000, hot_wait_s=5.0)
        cold = StageStream(redis, keys, "diffusion", "diffusion-cold", visibility_ms=60_000)
        assert len(hot.links) == 2, "the test needs the lean links"
        await hot.ensure_group()
        loop = asyncio.get_running_loop()
        assert await hot.read(1, block_ms=0) == []
        assert all(link.hot_until == 0 for link in hot.links), "nothing delivered: the links may sleep"
        await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r1"})
        await redis.xadd(keys.stage_stream("diffusion"), {"request_id": "r2"})
        (entry,) = await hot.read(1, block_ms=0)
        assert all(link.hot_until > loop.time() + 4 for link in hot.links), "delivered: hot"
        for link in hot.links:
            link.hot_until = 0.0
        assert await hot.ack(entry.id)
        assert all(link.hot_until > loop.time() + 4 for link in hot.links), "settled: hot again"
        (other,) = await cold.read(1, block_ms=0)
        assert await cold.ack(other.id)
        assert all(link.hot_until == 0 for link in cold.links), "hot_wait_s 0: never hot"
        for stream in (hot, cold):
            await stream.aclose()


async def test_a_new_only_read_skips_entries_in_hand_and_a_plain_read_returns_them(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    claim = LeaseClaim(prefix=keys.claim(""), holder="agent-n", ttl_ms=30_000)
    async with open_client(redis_url) as redis:
        a = StageStream(redis, keys, "diffusion", "diffusion-a", visibility_ms=60_000, lease_claim=claim)
        await a.ensure_group()
        for n in (1, 2):
            await redis.xadd(keys.stage_stream("diffusion"), {"request_id": f"r{n}", LEASE_FIELD: f"tok-{n}"})
        (first,) = await a.read(1, block_ms=0, new_only=True)
        (second,) = await a.read(1, block_ms=0, new_only=True)  # the first is still in hand, un-acked
        assert (first.text("request_id"), second.text("request_id")) == ("r1", "r2")
        assert first.claimed("tok-1") is True and second.claimed("tok-2") is True, "each new entry's lease claimed"
        assert await a.read(1, block_ms=0, new_only=True) == []
        (again,) = await a.read(1, block_ms=0)  # a plain read: its own un-acked entries first
        assert again.id == first.id and again.deliveries == 2 and again.lease_claimed is None
        await a.aclose()


async def test_a_hand_off_above_maxmemory_is_refused_whole_then_goes_through(prefix: str) -> None:
    """The hand-off is a library function without flags (:mod:`~stageferry.broker.control.functions`):
    above ``maxmemory`` Redis refuses it before it runs, so nothing of it is written (the next entry, the
    ack, the status); once memory is back the same call goes through."""
    keys = Keys(prefix)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        store = RequestStore(redis, keys, ttl_s=60, events_maxlen=100)
        enc = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000)
        await enc.ensure_group()
        await redis.xadd(keys.stage_stream("encoder"), {"request_id": "r1"})
        (entry,) = await enc.read(1, block_ms=0)
        queued = RequestStatus(request_id="r1", state=RequestState.QUEUED, stage="diffusion")
        write = store.status_write(queued, stage_index=1)

        async def hand_off() -> bool:
            fields = {"request_id": "r1", "envelope": "{}"}
            return await enc.hand_off(
                entry.id, "diffusion", fields, status=write, crash_field=crash_field("encoder", entry.id)
            )

        key = functions.credential_key(redis)
        await functions.load(redis, ENTRY_LIBRARY.named(key))  # as a first call would (above maxmemory: refused)
        await redis.config_set("maxmemory", 1)  # whatever it holds is above it: every write needing memory
        with pytest.raises(ControlPlaneError, match="OutOfMemoryError"):
            await hand_off()
        assert await redis.exists(keys.stage_stream("diffusion"), keys.request("r1")) == 0
        assert (await redis.xpending(keys.stage_stream("encoder"), enc.group))["pending"] == 1, "still held"
        await redis.config_set("maxmemory", 0)
        assert await hand_off()
        assert await redis.xlen(keys.stage_stream("diffusion")) == 1
        assert (await store.get("r1")).state is RequestState.QUEUED  # type: ignore[union-attr]
        await enc.aclose()


async def test_a_hand_off_leaves_the_events_ttl_to_the_next_event(redis_url: str, prefix: str) -> None:
    """The hand-off adds no event, so it does not mark the events stream refreshed (``ttl_at``): a stream
    gone before its record (writes without events refresh the record alone) is made again by the next
    event, whose write then sets its TTL, rather than living on without one."""
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        store = RequestStore(redis, keys, ttl_s=60, events_maxlen=100)
        enc = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000)
        await enc.ensure_group()
        await redis.xadd(keys.stage_stream("encoder"), {"request_id": "r1"})
        (entry,) = await enc.read(1, block_ms=0)
        assert await store.set_status(RequestStatus(request_id="r1", state=RequestState.RUNNING, stage="encoder"))
        # long after: the events stream expired, the record (refreshed since by writes without events) lives
        await redis.delete(keys.events("r1"))
        await redis.hset(keys.request("r1"), "ttl_at", "1")
        queued = RequestStatus(request_id="r1", state=RequestState.QUEUED, stage="diffusion")
        fields = {"request_id": "r1", "envelope": "{}"}
        write = store.status_write(queued, stage_index=1)
        assert await enc.hand_off(
            entry.id, "diffusion", fields, status=write, crash_field=crash_field("encoder", entry.id)
        )
        running = RequestStatus(request_id="r1", state=RequestState.RUNNING, stage="diffusion")
        assert await store.set_status(running, stage_index=1)
        assert await redis.exists(keys.events("r1")) == 1
        assert 60_000 <= await redis.pttl(keys.events("r1")) <= 66_000, "the event's write set the stream's TTL"
        await redis.delete(keys.stage_stream("encoder"), keys.stage_stream("diffusion"), keys.request("r1"))
        await redis.delete(keys.events("r1"))
        await enc.aclose()
