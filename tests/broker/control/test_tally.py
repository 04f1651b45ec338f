"""The opt-in Redis tally (:mod:`stageferry.broker.control.tally`) on real Redis: off by default; when on,
one round trip per command, pipeline or script call, charged to the stageferry function that sent it —
and a stage stream's read is one round trip for its three phases, with the delivery counts inside."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from stageferry.broker.control import tally
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect, open_client
from stageferry.broker.control.stream_scripts import WAKE_LUA
from stageferry.broker.control.streams import StageStream

pytestmark = pytest.mark.anyio


@pytest.fixture
def tally_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Tally on for this test, into a fresh directory (and a fresh per-process tally)."""
    monkeypatch.setenv(tally.ENV, str(tmp_path))
    monkeypatch.setattr(tally, "_TALLY", None)
    yield tmp_path


async def test_off_by_default(monkeypatch: pytest.MonkeyPatch, redis_url: str) -> None:
    monkeypatch.delenv(tally.ENV, raising=False)
    client = connect(redis_url)
    try:
        assert not issubclass(client.connection_pool.connection_class, tally.TallyMixin)
    finally:
        await client.aclose()


async def test_round_trips_and_commands_by_call_site(tally_dir: Path, redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        await redis.set(keys.cancel("r1"), b"1", ex=60)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.get(keys.cancel("r1"))
            pipe.exists(keys.cancel("r1"))
            pipe.expire(keys.cancel("r1"), 60)
            assert await pipe.execute() == [b"1", 1, True]
    counts = tally._TALLY
    assert counts is not None
    # Sent from this test (no stageferry frame on the stack): charged to the outermost caller, whatever
    # runs the tests; connecting costs round trips of its own (HELLO, CLIENT SETINFO).
    sites = {key.split(" ", 1)[1]: key for key in counts.round_trips}
    assert counts.round_trips[sites["SET"]] == 1
    assert counts.round_trips[sites["PIPE:EXISTS+EXPIRE+GET"]] == 1
    assert counts.commands[sites["PIPE:EXISTS+EXPIRE+GET"]] == 3
    assert "HELLO" in sites
    counts.flush()
    assert tally.read_dir(tally_dir)[sites["PIPE:EXISTS+EXPIRE+GET"]] == [1, 3]


async def test_a_stream_read_is_one_round_trip_with_delivery_counts(
    tally_dir: Path, redis_url: str, prefix: str
) -> None:
    """New entry → one script; the same entry reclaimed by another replica → one script again, its
    delivery count (2) read inside it, and logged as reclaimed; a replica's own pending entry is not."""
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        a = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=0)
        b = StageStream(redis, keys, "encoder", "encoder-b", visibility_ms=0)
        await a.ensure_group()
        await redis.xadd(keys.stage_stream("encoder"), {"request_id": "r1", "job": "{}"})
        counts = tally._TALLY
        assert counts is not None
        site = "broker.control.streams:_read_via_script EVALSHA"
        before = counts.round_trips[site]
        (first,) = await a.read(1, block_ms=0)
        assert (first.deliveries, counts.round_trips[site] - before) == (1, 1)
        with capture_logs() as logs:
            (again,) = await b.read(1, block_ms=0)
        assert (again.id, again.deliveries, counts.round_trips[site] - before) == (first.id, 2, 2)
        assert [e["entry"] for e in logs if e["event"] == "stream.reclaimed"] == [first.id]
        with capture_logs() as logs:
            (own,) = await b.read(1, block_ms=0)  # b's own pending entry, read first
        assert own.id == first.id and own.deliveries >= 2
        assert not [e for e in logs if e["event"] == "stream.reclaimed"]
        assert counts.round_trips["broker.control.streams:_delivery_counts PIPE:XPENDING"] == 0
        assert await b.ack(own.id)
        assert await a.read(1, block_ms=0) == []


async def test_a_woken_read_comes_back_with_its_wake_up(tally_dir: Path, redis_url: str, prefix: str) -> None:
    """An idle replica's wait and the read after it are one pipeline: the entry written while it waits
    (with the wake-up, as the hand-off writes it) arrives in the same round trip as the wake-up."""
    keys = Keys(prefix)
    async with open_client(redis_url) as redis, open_client(redis_url) as writer:
        a = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000)
        await a.ensure_group()
        wake = writer.register_script("redis.call('XADD', KEYS[1], '*', 'request_id', 'r1')" + WAKE_LUA)
        counts = tally._TALLY
        assert counts is not None
        site = "broker.control.streams:_wait_and_read PIPE:BLPOP+EVALSHA"
        async with anyio.create_task_group() as tg:

            async def write_later() -> None:
                with anyio.fail_after(30):
                    while counts.round_trips[site] == waits:  # past the read's first look, into its waits
                        await anyio.sleep(0.005)
                await wake(keys=[keys.stage_stream("encoder"), keys.wake("encoder")])

            tg.start_soon(write_later)
            waits = counts.round_trips[site]
            (entry,) = await a.read(1, block_ms=5_000)
        assert entry.text("request_id") == "r1"
        assert counts.round_trips[site] > waits, "woken by the wait's pipeline"
        assert counts.round_trips["broker.control.streams:_wait_and_read EVALSHA"] == 0
        assert counts.round_trips["broker.control.streams:read BLPOP"] == 0, "no wait on its own"
