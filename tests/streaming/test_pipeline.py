"""Chunked streaming in the running pipeline (issue 40): real stage processes, real Redis, real NIXL agents.

The producer is the AR-style ``tests.models:streamer`` (a chunk every few steps), the consumer
``tests.models:chunk_consumer`` (checks each chunk's bytes, records what it applied)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from stageferry.schemas import RequestState
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(240)

STAGES = [
    {"name": "encoder", "model": "tests.models:streamer"},
    {"name": "diffusion", "model": "tests.models:chunk_consumer"},
]


def make(
    tmp_path: Path,
    redis_url: str,
    prefix: str,
    *,
    streaming: dict[str, Any] | None = None,
    consumer_tp: int = 1,
    producer_tp: int = 1,
    **data_plane: Any,
) -> Services:
    marks = tmp_path / "marks"
    marks.mkdir()
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [{**STAGES[0], "tp": producer_tp}, {**STAGES[1], "tp": consumer_tp}],
        timeouts={"visibility": 3.0, "claim_renew_every": 0.5, "resend": 2.0},
        limits={"max_recomputes": 2},
        streaming={"chunk_timeout_s": 30.0, "max_chunks_in_flight": 2, **(streaming or {})},
        data_plane={"connector": "nixl", "agent_ttl_s": 2.0, "agent_heartbeat_s": 0.5, **data_plane},
    )
    return Services(
        tmp_path,
        redis_url=redis_url,
        prefix=prefix,
        pipeline=path,
        extra_env={
            "STAGEFERRY_TEST_CHUNKS": str(tmp_path / "chunks.txt"),
            "STAGEFERRY_TEST_MARKS": str(marks),
            "STAGEFERRY_TEST_HIDDEN": "20000",  # 80 kB a chunk: above inline_max_bytes, so NIXL
        },
    )


def job(prompt: str) -> dict[str, Any]:
    return {"prompt": prompt, "width": 64, "height": 64, "num_inference_steps": 1}


def applied_runs(tmp_path: Path, rid: str, rank: int = 0) -> dict[str, list[int]]:
    """Per consumer run, the chunk indices it applied (on ``rank``), in order."""
    runs: dict[str, list[int]] = {}
    path = tmp_path / ("chunks.txt" if rank == 0 else f"chunks.txt.rank{rank}")
    for line in path.read_text().splitlines() if path.exists() else []:
        run, request, index = line.split()
        if request == rid:
            runs.setdefault(run, []).append(int(index))
    return runs


def result(svc: Services, rid: str) -> dict[str, Any]:
    client = svc.client()
    data = client.result_bytes(rid)
    assert data is not None
    return json.loads(data)


def events(svc: Services, rid: str, name: str, at_least: int = 0) -> list[Any]:
    """The trace's ``name`` events, once there are ``at_least`` (a trace is written behind the status)."""

    def found() -> list[Any] | None:
        got = [e for e in svc.client().trace(rid) if e.event == name]
        return got if len(got) >= at_least else None

    return wait_for(found, 30, f"{at_least} {name} events") if at_least else found() or []


def test_chunks_arrive_in_order_over_nixl_and_the_consumer_starts_on_chunk_0(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    with make(tmp_path, redis_url, prefix) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:6 every:2 step_s:0.05"))
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.DONE, svc.logs()
        assert result(svc, rid)["applied"] == list(range(6))
        puts = events(svc, rid, "chunk.put", 6)
        assert [e.raw["index"] for e in puts] == list(range(6))
        assert all(e.raw["transport"] == "nixl" for e in puts)
        received = events(svc, rid, "chunk.received", 6)
        assert [e.raw["index"] for e in received] == list(range(6))
        done = events(svc, rid, "stream.done", 1)
        assert len(done) == 1
        assert received[0].timestamp < puts[-1].timestamp, "the consumer started before the last chunk was put"
        hop = [t for t in status.timings if t.stage == "diffusion"][-1]
        assert hop.transport.value == "nixl" and hop.payload_bytes >= 6 * 80_000


def test_each_chunk_falls_back_inline_when_nixl_is_down(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, nixl_backends=["NO_SUCH_BACKEND"]) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:4 every:1"))
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.DONE, svc.logs()
        assert result(svc, rid)["applied"] == [0, 1, 2, 3]
        puts = events(svc, rid, "chunk.put", 4)
        assert [e.raw["index"] for e in puts] == [0, 1, 2, 3]
        assert all(e.raw["transport"] == "inline" and e.raw["fallback"] for e in puts), [e.raw for e in puts]


def test_a_consumer_killed_mid_stream_restarts_it_and_applies_no_chunk_twice(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    with make(tmp_path, redis_url, prefix) as svc:
        svc.start("encoder", "a")
        consumer = svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:6 every:1 consumer_dies_at:2"))
        wait_for(lambda: consumer.poll() is not None, 90, "the consumer to die after taking chunk 2")
        svc.start("diffusion", "b")
        status = client.wait(rid, timeout=150)
        assert status.state is RequestState.DONE, svc.logs()
        assert status.attempt >= 1, "the request was computed again under the next attempt"
        assert result(svc, rid)["applied"] == list(range(6))
        runs = applied_runs(tmp_path, rid)
        assert len(runs) == 2
        for indices in runs.values():  # within a run, every index once, in order
            assert indices == list(range(len(indices))), runs
        assert sorted(len(v) for v in runs.values()) == [3, 6]
        assert events(svc, rid, "chunk.restart", 1), "the new consumer saw the taken chunks and restarted"


def test_a_producer_killed_mid_stream_is_recomputed_and_the_consumer_applies_each_chunk_once(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    with make(tmp_path, redis_url, prefix, streaming={"max_chunks_in_flight": 1}) as svc:
        producer = svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:6 every:1 die_at:3"))
        wait_for(lambda: producer.poll() is not None, 90, "the producer to die before chunk 3")
        producer.wait(10)
        svc.start("encoder", "b")  # reclaims the pending entry after the visibility timeout
        status = client.wait(rid, timeout=150)
        assert status.state is RequestState.DONE, svc.logs()
        assert result(svc, rid)["applied"] == list(range(6))
        runs = applied_runs(tmp_path, rid)
        assert list(runs.values()) == [list(range(6))], runs  # one consumer run, each index once
        received = events(svc, rid, "chunk.received", 6)
        assert Counter(e.raw["index"] for e in received) == Counter(range(6))


def test_backpressure_holds_a_producer_ahead_of_a_slow_consumer(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, streaming={"max_chunks_in_flight": 2}) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:6 every:1 consume_s:0.3"))
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.DONE, svc.logs()
        events(svc, rid, "stream.done", 1)  # the producer's last event: its waits are all in the trace
        waits = events(svc, rid, "chunk.backpressure")
        assert waits and all(e.raw["index"] - e.raw["applied"] > 2 for e in waits)
        released = events(svc, rid, "chunk.backpressure_released")
        assert len(released) == len(waits) and all(e.raw["held_s"] > 0 for e in released)
        assert result(svc, rid)["applied"] == list(range(6))
        # never more than two chunks announced ahead of what the consumer applied
        received = events(svc, rid, "chunk.received", 6)
        for put in events(svc, rid, "chunk.put", 6):
            applied_before = [e for e in received if e.timestamp <= put.timestamp]
            assert put.raw["index"] - (len(applied_before) - 1) <= 3


def test_the_consumer_leader_fans_each_chunk_out_to_its_ranks(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, consumer_tp=2, producer_tp=2) as svc:  # the producer's leader streams
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:5 every:1"))
        status = client.wait(rid, timeout=150)
        assert status.state is RequestState.DONE, svc.logs()
        leader = applied_runs(tmp_path, rid, rank=0)
        follower = applied_runs(tmp_path, rid, rank=1)  # each chunk checked against its expected bytes
        assert list(leader.values()) == [list(range(5))] and list(follower.values()) == [list(range(5))]


def test_a_chunk_that_does_not_come_ends_the_request_chunk_timeout(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, streaming={"chunk_timeout_s": 1.5}) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:4 every:1 stall_at:2:6"))  # chunk 2 comes 6 s late
        status = client.wait(rid, timeout=60)
        assert status.state is RequestState.FAILED, svc.logs()
        assert status.error is not None and status.error.code == "chunk_timeout"
        assert status.error.details["index"] == 2
        assert applied_runs(tmp_path, rid) and list(applied_runs(tmp_path, rid).values()) == [[0, 1]]
        # the late producer was told to stop: it puts no more chunks and its entry is settled
        r = sync_redis.Redis.from_url(redis_url)
        stream = svc.keys.stage_stream("encoder")
        wait_for(lambda: r.xpending(stream, "encoder")["pending"] == 0, 60, "the producer's entry to be settled")
        assert len(events(svc, rid, "chunk.put")) <= 3  # it stopped at its window instead of waiting there
        assert [e.raw["index"] for e in events(svc, rid, "chunk.put")] == [0, 1]
        record = client.status(rid)  # and the request's record stands
        assert record is not None and record.error is not None and record.error.code == "chunk_timeout"


def test_a_stream_into_a_model_that_takes_whole_payloads_fails_typed(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [STAGES[0], {"name": "diffusion", "model": "tests.models:factory"}],  # a whole-payload consumer
        timeouts={"visibility": 3.0, "claim_renew_every": 0.5},
        streaming={"chunk_timeout_s": 30.0, "max_chunks_in_flight": 2},
        data_plane={"connector": "nixl"},
    )
    with Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit(job("stream chunks:8 every:1"))  # more than the window: the producer would wait
        status = client.wait(rid, timeout=90)
        assert status.state is RequestState.FAILED, svc.logs()
        assert status.error is not None and status.error.code == "config" and "takes_chunks" in status.error.message
        # and the producer was told to stop (no chunk will be applied): it does not wait out producer_wait_s
        r = sync_redis.Redis.from_url(redis_url)
        stream = svc.keys.stage_stream("encoder")
        wait_for(lambda: r.xpending(stream, "encoder")["pending"] == 0, 60, "the producer's entry to be settled")


def test_a_stream_cut_short_at_either_end_frees_both_stages_and_its_announcements(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """A consumer model that returns after one chunk stops its producer (which waited in back-pressure for
    ``producer_wait_s``); a producer model that breaks mid-stream ends its consumer's wait (which lasted
    ``chunk_timeout_s``, its stage held): both long here, so a stage still held would not serve the next
    job in time.  And once a consumer is done with a stream its announcements, inline bytes among them,
    are deleted (they were kept for the request's TTL)."""
    long = {"chunk_timeout_s": 600.0, "producer_wait_s": 600.0}
    with make(tmp_path, redis_url, prefix, streaming=long, inline_max_bytes=1 << 20) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        early = client.submit(job("chunks:8 take:1"))
        assert client.wait(early, timeout=60).state is RequestState.DONE
        assert result(svc, early)["applied"] == [0]
        after_early = client.submit(job("chunks:2"))  # the producer stopped: it serves this at once
        assert client.wait(after_early, timeout=60).state is RequestState.DONE

        # breaks at chunk 4: emitting chunk 3 waited for chunk 2's publish, which waited (window 2) for the
        # consumer to apply chunk 0, so the consumer is mid-stream (at 2 it might not have claimed it yet)
        broken = client.submit(job("chunks:6 fail_at:4"))
        status = client.wait(broken, timeout=60)
        assert status.state is RequestState.FAILED and status.stage == "encoder", status
        after_broken = client.submit(job("chunks:2"))  # the consumer stopped waiting: it serves this
        assert client.wait(after_broken, timeout=60).state is RequestState.DONE
        assert status == client.status(broken), "the consumer wrote nothing over the producer's failure"
        consumer_log = "".join(p.read_text() for p in tmp_path.glob("diffusion-*.log"))
        assert '"event": "chunk.upstream_ended"' in consumer_log and broken in consumer_log

        r = sync_redis.Redis.from_url(redis_url)
        left = lambda: sorted(r.scan_iter(match=f"{prefix}:req-chunks:*"))  # noqa: E731
        assert wait_for(lambda: left() == [], 30, "every stream's announcements deleted") is True
