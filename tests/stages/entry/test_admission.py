"""Admission against a real Redis: whether an entry runs, and in how many round trips that is decided.

:meth:`Admission.settled` reads the request record and the cancel flag and takes the run's owner key in
one script.  The test counts the Redis round trips the client makes (pipelines and single commands)
and checks each outcome: a fresh entry runs, the same entry redelivered runs, another entry of the same
run is a duplicate (acknowledged), a finished request is skipped, a cancelled one is refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from stageferry.broker.control.entry_records import EntryRecords, crash_field
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import Heartbeat
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import CancelledRequestError
from stageferry.schemas import Envelope, JobRequest, RequestState, RequestStatus, request_key
from stageferry.stages.entry.admission import Admission
from stageferry.stages.entry.leader import Leader

pytestmark = pytest.mark.anyio


class RoundTrips:
    """Counts what a redis-py client sends (one per pipeline execution, one per plain command) and what a
    stage stream's own links send (one per write)."""

    def __init__(self, redis: aioredis.Redis, stream: StageStream | None = None) -> None:
        self.count = 0
        for link in stream.links if stream is not None else ():
            real_send = link.send

            async def send(*args: Any, _send: Any = real_send, **kwargs: Any) -> Any:
                self.count += 1
                return await _send(*args, **kwargs)

            link.send = send  # type: ignore[method-assign]
        real_pipeline, real_command = redis.pipeline, redis.execute_command

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = real_pipeline(*args, **kwargs)
            real_execute = pipe.execute

            async def execute(*a: Any, **k: Any) -> Any:
                self.count += 1
                return await real_execute(*a, **k)

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        async def command(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await real_command(*args, **kwargs)

        redis.pipeline = pipeline  # type: ignore[method-assign]
        redis.execute_command = command  # type: ignore[method-assign]


class Stage:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.stream = StageStream(redis, keys, "diffusion", "diffusion-a", visibility_ms=30_000)
        self.store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        pipeline = PipelineConfig(stages=(StageConfig(name="encoder"), StageConfig(name="diffusion")))
        self.leader = Leader(
            redis=redis,
            keys=keys,
            pipeline=pipeline,
            stage=pipeline.stage("diffusion"),
            heartbeat=Heartbeat(redis, keys, "diffusion", "a"),
            stream=self.stream,
            store=self.store,
            records=EntryRecords(redis, keys, ttl_s=600, link=self.stream.script_link),
            input_connector=None,
            output_connector=None,
            refusals=None,
        )
        self.admission = Admission(self.leader)

    async def entries(self, rid: str, n: int) -> list[Entry]:
        for _ in range(n):
            await self.redis.xadd(self.keys.stage_stream("diffusion"), {"request_id": rid, "job": "{}"})
        entries = await self.stream.read(n, block_ms=1000)
        assert len({e.id for e in entries}) == n
        return entries


async def crashes(redis: aioredis.Redis, keys: Keys, rid: str, stage: str, entry_id: str) -> int:
    """An entry's crash mark: the field of its request's record (0: none, or cleared)."""
    raw = await redis.hget(keys.request(rid), crash_field(stage, entry_id))
    count = raw.split(b":")[0] if raw else b""  # ``<count>`` or, marked by a redelivery, ``<count>:<delivery>``
    return int(count) if count else 0


async def set_crashes(redis: aioredis.Redis, keys: Keys, rid: str, stage: str, entry_id: str, n: int) -> None:
    await redis.hset(keys.request(rid), crash_field(stage, entry_id), n)


def envelope(rid: str) -> Envelope:
    return Envelope(
        request_id=rid, key=request_key(rid, 0), from_stage="encoder", to_stage="diffusion", job=JobRequest(prompt="x")
    )


@pytest.fixture
async def stage(redis_url: str, prefix: str) -> AsyncIterator[Stage]:
    async with open_client(redis_url) as redis:
        stage = Stage(redis, Keys(prefix))
        await stage.stream.ensure_group()
        yield stage
        await stage.stream.aclose()


async def test_a_fresh_entry_runs_after_one_round_trip_and_a_second_entry_is_a_duplicate(stage: Stage) -> None:
    first, second = await stage.entries("req-1", 2)
    for rid in ("req-0", "req-1"):  # admitted first, as every entry is (the look writes into its record)
        await stage.leader.records.admit(rid, "d" * 64)
    # the script's first call loads it (NOSCRIPT, LOAD, again): not what is counted
    assert await stage.admission.settled(first, envelope("req-0")) is False
    trips = RoundTrips(stage.redis, stage.stream)
    assert await stage.admission.settled(first, envelope("req-1")) is False
    assert trips.count == 1
    assert await stage.admission.settled(first, envelope("req-1")) is False  # redelivered: still its run
    assert trips.count == 2
    assert await stage.admission.settled(second, envelope("req-1")) is True  # another entry: a duplicate
    assert await stage.stream.pending_count() == 1  # the duplicate was acknowledged, the first is in hand


async def test_a_finished_request_is_skipped_and_a_cancelled_one_refused(stage: Stage) -> None:
    [done] = await stage.entries("req-2", 1)
    status = RequestStatus(request_id="req-2", state=RequestState.DONE, stage="diffusion")
    assert await stage.store.set_status(status)
    assert await stage.admission.settled(done, envelope("req-2")) is True
    [cancelled] = await stage.entries("req-3", 1)
    await stage.redis.set(stage.keys.cancel("req-3"), b"1")
    with pytest.raises(CancelledRequestError):
        await stage.admission.settled(cancelled, envelope("req-3"))
