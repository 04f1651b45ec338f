"""The intake mover (:mod:`stageferry.broker.control.intake`) against a real Redis: a batch per list and
round, round-robin across tenants, bounded by the count, oversized items kept out of the stream; and a
first stage's read, which moves only when its stream runs short."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from stageferry.broker.control.intake import Intake
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.streams import MOVE_SURPLUS, StageStream

pytestmark = pytest.mark.anyio


def _item(n: int, tenant: str) -> bytes:
    return json.dumps({"ticket": f"{n:032x}", "request_id": f"{tenant}.r{n}", "job": {}}).encode()


async def _moved(r: aioredis.Redis, stream: str) -> list[tuple[str, str]]:
    """(tenant, request id or 'oversized') of each stream entry, in stream order."""
    out = []
    for _, fields in await r.xrange(stream):
        tenant = fields.get(b"tenant", b"").decode()
        if b"oversized" in fields:
            out.append((tenant, "oversized"))
        else:
            out.append((tenant, json.loads(fields[b"submission"])["request_id"]))
    return out


async def test_moves_a_batch_round_robin_within_the_count(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)
    try:
        intake = Intake(r, keys, "encoder", tenants=("a", "b"), max_item_bytes=4096)
        await r.rpush(keys.intake("encoder", "a"), *(_item(i, "a") for i in range(10)))  # a floods its list
        await r.rpush(keys.intake("encoder", "b"), *(_item(i, "b") for i in range(2)))
        moved = await intake.move(7)
        assert (moved.moved, moved.oversized) == (7, 0)
        rows = await _moved(r, intake.stream)
        # b's two are not starved by a's ten: each round takes a share from every list, item by item
        assert sorted(rid for t, rid in rows if t == "b") == ["b.r0", "b.r1"]
        assert [rid for t, rid in rows if t == "a"] == [f"a.r{i}" for i in range(5)]  # a's in its own order
        assert [t for t, _ in rows[:4]] == ["a", "b", "a", "b"]
        assert await r.llen(keys.intake("encoder", "a")) == 5  # nothing popped beyond the count
        # the rest, then an empty move
        assert (await intake.move(64)).total == 5
        assert (await intake.move(64)).total == 0
        assert len(await _moved(r, intake.stream)) == 12
    finally:
        await r.aclose()


async def test_an_oversized_item_is_moved_as_its_size_only(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)
    try:
        intake = Intake(r, keys, "encoder", max_item_bytes=200)
        big = json.dumps({"ticket": "f" * 32, "request_id": "big", "job": {"prompt": "x" * 500}}).encode()
        await r.rpush(keys.intake("encoder"), _item(1, "solo"), big, _item(2, "solo"))
        moved = await intake.move(16)
        assert (moved.moved, moved.oversized) == (2, 1)
        entries = await r.xrange(intake.stream)
        assert entries[1][1] == {b"oversized": str(len(big)).encode(), b"ticket": b"f" * 32}
        assert await r.llen(keys.intake("encoder")) == 0
    finally:
        await r.aclose()


async def test_a_first_stages_read_moves_only_when_its_stream_runs_short(redis_url: str, prefix: str) -> None:
    """A busy first stage pays the move once per ``MOVE_SURPLUS`` entries: a read short of new entries
    moves what it lacks and the surplus besides; the next reads take those from the stream, and the
    intake is left as it is until the stream runs short again."""
    keys = Keys(prefix)
    r = aioredis.Redis.from_url(redis_url)
    intake = Intake(r, keys, "encoder", max_item_bytes=4096)
    stream = StageStream(r, keys, "encoder", "encoder-a", visibility_ms=30_000, intake=intake)
    try:
        await stream.ensure_group()
        await r.rpush(keys.intake("encoder"), *(_item(i, "solo") for i in range(MOVE_SURPLUS + 10)))
        first = await stream.read(2, block_ms=0, new_only=True)
        assert [e.text("ticket") for e in first] == [f"{i:032x}" for i in range(2)]
        # it took 2, and moved 2 + the surplus: 8 wait in the intake
        assert await r.llen(keys.intake("encoder")) == 8
        assert await r.xlen(intake.stream) == MOVE_SURPLUS + 2
        taken = [e.text("ticket") for e in await stream.read(MOVE_SURPLUS, block_ms=0, new_only=True)]
        assert taken == [f"{i:032x}" for i in range(2, MOVE_SURPLUS + 2)]
        assert await r.llen(keys.intake("encoder")) == 8, "the stream had them: no move"
        rest = await stream.read(64, block_ms=0, new_only=True)  # short: moves, and reads them at once
        assert [e.text("ticket") for e in rest] == [f"{i:032x}" for i in range(MOVE_SURPLUS + 2, MOVE_SURPLUS + 10)]
        assert await r.llen(keys.intake("encoder")) == 0
    finally:
        await stream.aclose()
        await r.aclose()
