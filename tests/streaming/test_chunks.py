"""The chunk stream's guarantees, on a real Redis with the inline connector: each index once and in order
under repeats and reordering, a missing chunk's deadline, back-pressure holding the producer, a consumer
restart abandoning the old stream, and a recomputing producer starting where the consumer is."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
import torch
from structlog.testing import capture_logs

from stageferry.broker.control.chunks import ChunkChannel, StreamId
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.data.inline import InlineConnector
from stageferry.config import Streaming
from stageferry.errors import ChunkTimeoutError, PayloadUnavailableError, StreamAbandonedError, UpstreamEndedError
from stageferry.schemas import NoPayload, request_key
from stageferry.schemas.chunks import ChunkAnnouncement
from stageferry.stages.entry.chunk_input import ChunkReader
from stageferry.stages.entry.chunk_output import ChunkProducer
from tests.security.servers import AclRedis
from tests.waits import until

pytestmark = pytest.mark.anyio

SID = StreamId("req-1", 0, 0)


@pytest.fixture
async def channel(redis_url: str, prefix: str) -> AsyncIterator[ChunkChannel]:
    client = aioredis.Redis.from_url(redis_url)
    yield ChunkChannel(client, Keys(prefix), ttl_s=120)
    await client.aclose()


def connector() -> InlineConnector:
    return InlineConnector(max_bytes=1 << 20, max_payload_bytes=1 << 24, cuda_device=None)


def chunk(index: int) -> dict[str, Any]:
    return {"index": torch.tensor([index]), "data": torch.full((64,), float(index))}


async def announce(channel: ChunkChannel, index: int, *, final: bool = False, end: bool = False) -> None:
    key = request_key(SID.request_id, SID.stage_index, index)
    if end:
        ann = ChunkAnnouncement(
            request_id=SID.request_id,
            from_stage="encoder",
            attempt=0,
            index=index,
            final=True,
            key=key,
            payload=NoPayload(),
        )
        await channel.announce(SID, ann, None)
        return
    out = await connector().put(key, chunk(index))
    ann = ChunkAnnouncement(
        request_id=SID.request_id, from_stage="encoder", attempt=0, index=index, final=final, key=key, payload=out.ref
    )
    await channel.announce(SID, ann, out.blob)


async def take_all(reader: ChunkReader) -> list[int]:
    taken = []
    while (got := await reader.next()) is not None:
        assert torch.equal(got.payload["data"], torch.full((64,), float(got.index)))
        taken.append(got.index)
    await reader.aclose()
    return taken


async def test_each_index_is_applied_once_and_in_order_under_repeats_and_reordering(channel: ChunkChannel) -> None:
    for index in (0, 1, 0, 2, 1, 4, 3, 2):  # a recomputing producer repeats; an index may come early
        await announce(channel, index)
    await announce(channel, 5, final=True)
    await announce(channel, 5, final=True)  # the final chunk repeated too
    reader = ChunkReader(channel, connector(), SID, timeout_s=10.0, window=8)
    assert await take_all(reader) == [0, 1, 2, 3, 4, 5]
    assert reader.skipped >= 3
    state = await channel.state(SID)
    assert state.applied == 5 and state.taken == 0  # taken: the first chunk a consumer began with


async def test_what_a_writer_puts_past_the_window_or_past_the_repeats_kept_is_dropped(channel: ChunkChannel) -> None:
    """A reader awaiting chunk n keeps announcements up to the window past n and the newest few of one
    index: a flood of far-ahead indices or of one index's repeats (each may carry inline bytes) is not
    held.  The stream itself is taken whole and in order."""
    await announce(channel, 0)
    for index in range(100, 140):  # no producer gets 100 ahead of its consumer: back-pressure holds it
        await announce(channel, index)
    for _ in range(12):  # one index announced again and again
        await announce(channel, 1)
    await announce(channel, 2, final=True)
    reader = ChunkReader(channel, connector(), SID, timeout_s=10.0, window=4)
    with capture_logs() as logs:
        first = await reader.next()
        assert first is not None and first.index == 0
        assert sum(len(kept) for kept in reader._pending.values()) <= 4 + 1  # held: bounded, not 52
        assert await take_all(reader) == [1, 2]
    dropped = [e for e in logs if e["event"] == "chunk.dropped"]
    assert {e["why"] for e in dropped} == {"beyond_window", "repeats"} and reader.dropped == len(dropped) == 40 + 8


async def test_the_cancel_and_upstream_checks_run_while_waiting_not_per_chunk(channel: ChunkChannel) -> None:
    """Chunks that come as they are asked for cost no check of the request (two Redis round trips each, on
    the stream's path); a wait asks between its reads, and an upstream end ends it typed."""
    asked: list[str] = []

    async def is_cancelled() -> bool:
        asked.append("cancelled")
        return False

    async def ended_upstream() -> bool:
        asked.append("ended")
        return len(asked) >= 4  # the producer fails while chunk 3 is awaited

    for index in range(3):
        await announce(channel, index)
    reader = ChunkReader(
        channel, connector(), SID, timeout_s=30.0, window=4, is_cancelled=is_cancelled, ended_upstream=ended_upstream
    )
    for index in range(3):
        got = await reader.next()
        assert got is not None and got.index == index
    assert asked == [], "no check while the chunks flow"
    with pytest.raises(UpstreamEndedError):
        await reader.next()  # chunk 3 never comes: checked between reads until the request ended upstream
    assert asked == ["cancelled", "ended", "cancelled", "ended"]
    await reader.aclose()


async def test_an_end_marker_closes_the_stream_without_a_chunk(channel: ChunkChannel) -> None:
    await announce(channel, 0)
    await announce(channel, 1, end=True)
    assert await take_all(ChunkReader(channel, connector(), SID, timeout_s=10.0, window=8)) == [0]


async def test_a_missing_chunk_ends_typed_after_its_deadline(channel: ChunkChannel) -> None:
    await announce(channel, 0)
    reader = ChunkReader(channel, connector(), SID, timeout_s=0.6, window=8)
    first = await reader.next()
    assert first is not None and first.index == 0
    started = time.monotonic()
    with pytest.raises(ChunkTimeoutError) as caught:
        await reader.next()
    assert caught.value.code == "chunk_timeout" and caught.value.details["index"] == 1
    assert (await channel.state(SID)).stopped, "its producer is told to stop"
    assert 0.5 <= time.monotonic() - started < 10
    assert (await channel.state(SID)).applied == 0  # chunk 0 was applied before the wait


def producer(channel: ChunkChannel, handed: list[int], *, window: int = 2) -> ChunkProducer:
    async def hand_on() -> None:  # as the stage's: the channel's script hands on once per attempt
        if await channel.hand_on_once(SID, "diffusion", {"request_id": SID.request_id, "envelope": "{}"}):
            handed.append(1)

    async def not_cancelled() -> bool:
        return False

    return ChunkProducer(
        channel=channel,
        connector=connector(),
        sid=SID,
        stage="encoder",
        config=Streaming(max_chunks_in_flight=window, producer_wait_s=60.0),
        hand_on=hand_on,
        is_cancelled=not_cancelled,
    )


async def announced(channel: ChunkChannel) -> list[int]:
    return [r.announcement.index for r in await channel.read(SID, "0", block_ms=1)]


async def test_backpressure_holds_the_producer_until_the_consumer_applies(channel: ChunkChannel) -> None:
    handed: list[int] = []
    prod = producer(channel, handed, window=2)
    with capture_logs() as logs:
        await prod.emit(chunk(0))
        await prod.emit(chunk(1))  # two in flight: the window is full
        done = anyio.Event()

        async def third() -> None:
            await prod.emit(chunk(2))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await until(lambda: any(e["event"] == "chunk.backpressure" for e in logs), "the producer to wait")
            assert not done.is_set() and await announced(channel) == [0, 1]
            await channel.raise_to(SID, "applied", 0)  # the consumer applied chunk 0: one slot frees
            await until(done.is_set, "the held chunk to go out")
        assert await announced(channel) == [0, 1, 2]
    waits = [e for e in logs if e["event"] == "chunk.backpressure"]
    released = [e for e in logs if e["event"] == "chunk.backpressure_released"]
    assert len(waits) == 1 and waits[0]["index"] == 2 and waits[0]["window"] == 2
    assert len(released) == 1 and released[0]["held_s"] > 0 and prod.held_s > 0
    assert handed == [1]  # the stream's envelope went on once, after the first announcement


async def test_a_recomputing_producer_starts_where_the_consumer_is(channel: ChunkChannel) -> None:
    first: list[int] = []
    await producer(channel, first).emit(chunk(0))
    await channel.raise_to(SID, "applied", 2)  # what the consumer had applied when the producer died
    again: list[int] = []
    prod = producer(channel, again, window=4)
    for index in range(5):
        await prod.emit(chunk(index), final=index == 4)
    assert await announced(channel) == [0, 3, 4]
    assert prod.skipped == 3 and first == [1] and again == []  # handed on once per attempt


async def test_a_redelivered_consumer_that_had_taken_chunks_restarts_the_request(channel: ChunkChannel) -> None:
    handed: list[int] = []
    prod = producer(channel, handed, window=1)
    await prod.emit(chunk(0))
    await channel.raise_to(SID, "taken", 0)  # a consumer took chunk 0, then died
    with pytest.raises(PayloadUnavailableError):  # the outcome table's recompute: the next attempt
        await ChunkReader(channel, connector(), SID, timeout_s=5.0, window=8).check_start()
    assert (await channel.state(SID)).abandoned
    with pytest.raises(StreamAbandonedError):  # the old attempt's producer stops
        await prod.emit(chunk(1))
    with pytest.raises(StreamAbandonedError):  # and a stale entry of the old attempt does not start
        await ChunkReader(channel, connector(), SID, timeout_s=5.0, window=8).check_start()


async def test_the_chunk_channel_runs_as_the_stage_acl_user(tmp_path: Path, prefix: str) -> None:
    """Every command a stream's control plane sends is one the stage ACL user holds (stageferry.acl)."""
    with AclRedis(tmp_path, prefix) as server:
        async with open_client(server.url("stageferry")) as client:
            acl = ChunkChannel(client, Keys(prefix), ttl_s=60)
            await announce(acl, 0)
            [record] = await acl.read(SID, "0", block_ms=10, applied=None)
            assert record.announcement.index == 0
            assert await acl.raise_to(SID, "taken", 0) == 0  # the script is loaded now: the next read pipelines it
            assert await acl.read(SID, record.entry_id, block_ms=10, applied=0) == []
            fields = {"request_id": SID.request_id, "envelope": "{}"}
            assert await acl.hand_on_once(SID, "diffusion", fields)  # handed on once, in one script
            assert not await acl.hand_on_once(SID, "diffusion", fields)  # a recomputing producer's: no second
            keys = Keys(prefix)
            [(_, added)] = await client.xrange(keys.stage_stream("diffusion"))
            assert added == {b"request_id": SID.request_id.encode(), b"envelope": b"{}"}
            assert await client.llen(keys.wake("diffusion")) == 1
            await acl.abandon(SID, why="stopped")
            state = await acl.state(SID)
            assert (state.applied, state.taken, state.opened, state.stopped) == (0, 0, True, True)
