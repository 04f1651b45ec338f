"""Control-plane guarantees with real processes and a real Redis: crash recovery, dead letters,
idempotency, Redis restarts, cancellation, draining and typed rejections."""

from __future__ import annotations

import io
import json
import signal
import uuid
import wave
from pathlib import Path

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.schemas import RequestState
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(240)

STAGES = [
    {"name": "encoder", "model": "tests.models:factory"},
    {"name": "diffusion", "model": "tests.models:factory"},
]


def pipeline_file(tmp_path: Path, connector: str = "inline", **limits: object) -> Path:
    return write_pipeline(
        tmp_path / "pipeline.toml",
        STAGES,
        timeouts={"visibility": 2.0, "claim_renew_every": 0.5, "redis_unreachable": 60.0},
        limits={"max_deliveries": 2, "max_steps": 50, "lora_adapters": ["anime-v1"], **limits},
        data_plane={"connector": connector},
    )


def make_services(tmp_path: Path, redis_url: str, prefix: str, connector: str = "inline", **env: str) -> Services:
    return Services(
        tmp_path,
        redis_url=redis_url,
        prefix=prefix,
        pipeline=pipeline_file(tmp_path, connector),
        extra_env={"STAGEFERRY_TEST_RECORD": str(tmp_path / "record.txt"), **env},
    )


def completions(tmp_path: Path, stage: str, rid: str) -> int:
    path = tmp_path / "record.txt"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line == f"{stage} {rid}")


JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 4}


def test_killed_worker_request_finishes_elsewhere_once(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
    with svc:
        victim = svc.start("encoder", "a")
        svc.start("diffusion", "a")
        svc.wait_live("encoder", "encoder-a")
        svc.wait_live("diffusion", "diffusion-a")
        client = svc.client()
        rid = client.submit({**JOB, "prompt": "sleep:3"})
        wait_for(
            lambda: (s := client.status(rid)) and s.state is RequestState.RUNNING and s.stage == "encoder",
            30,
            "encoder running",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        svc.start("encoder", "b")  # another replica reclaims the idle entry after the visibility timeout
        status = client.wait(rid, timeout=60)
        assert status.state is RequestState.DONE, (status, svc.logs())
        assert completions(tmp_path, "encoder", rid) == 1
        assert completions(tmp_path, "diffusion", rid) == 1
        assert_streams_empty(svc)


def test_poison_entry_goes_to_dead_letter_and_request_fails(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix)
    with svc:
        client = svc.client()
        rid = client.submit({**JOB, "prompt": "poison pill"})
        # The entry kills every worker that takes it: keep starting replicas until it is dead-lettered.
        for attempt in range(6):
            proc = svc.start("encoder", f"r{attempt}")
            settled = wait_for(
                lambda p=proc: p.poll() is not None or ((s := client.status(rid)) is not None and s.state.terminal),
                60,
                "worker death or a settled request",
            )
            assert settled
            status = client.status(rid)
            if status is not None and status.state.terminal:
                break
        status = client.wait(rid, timeout=30)
        assert status.state is RequestState.FAILED
        assert status.error is not None and status.error.code == "dead_lettered"
        r = sync_redis.Redis.from_url(redis_url)
        dead = wait_for(lambda: r.xrange(svc.keys.dead_letter("encoder")), 10, "the dead-letter row")
        assert len(dead) == 1
        fields = dead[0][1]
        assert fields[b"request_id"].decode() == rid
        assert b"delivered" in fields[b"reason"]
        assert svc.procs[-1].poll() is None, "the replica that dead-lettered it is still serving"
        assert_streams_empty(svc, stages=("encoder",))


def test_duplicate_submission_runs_once(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix)
    with svc:
        client = svc.client()
        rid = client.submit(JOB, request_id="video_sync-dup-1")
        assert client.submit(JOB, request_id="video_sync-dup-1") == rid
        r = sync_redis.Redis.from_url(redis_url)
        assert r.llen(svc.keys.intake("encoder")) == 1  # the second submit enqueued nothing
        # A raw client that submits the same id twice is deduplicated by the stage itself.
        raw_id = "video_sync-dup-raw"
        for _ in range(2):
            item = {"v": 1, "ticket": uuid.uuid4().hex, "request_id": raw_id, "job": JOB}
            r.rpush(svc.keys.intake("encoder"), json.dumps(item))
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        for request_id in (rid, raw_id):
            assert client.wait(request_id, timeout=60).state is RequestState.DONE
            wait_for(lambda r_=request_id: r.xlen(svc.keys.stage_stream("encoder")) == 0, 10, "encoder drained")
            assert completions(tmp_path, "encoder", request_id) == 1
            assert completions(tmp_path, "diffusion", request_id) == 1
        assert client.result_bytes(rid)  # one result, stored once
        assert_streams_empty(svc)


@pytest.mark.anyio
async def test_worker_reconnects_after_redis_restart(tmp_path: Path, prefix: str) -> None:
    async with EmbeddedRedis(appendonly=True, data_dir=tmp_path / "redis-data") as server:
        svc = make_services(tmp_path, server.url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
        with svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "encoder", "encoder-a")
            async with Client(server.url, prefix=prefix, pipeline=PipelineConfig.load(svc.pipeline)) as client:
                rid = await client.submit({**JOB, "prompt": "sleep:2"})
                with anyio.fail_after(60):
                    while (s := await client.status(rid)) is None or s.state is not RequestState.RUNNING:
                        await anyio.sleep(0.05)
            await server.restart()
            async with Client(server.url, prefix=prefix, pipeline=PipelineConfig.load(svc.pipeline)) as client:
                status = await client.wait(rid, timeout=90)
            assert status.state is RequestState.DONE, svc.logs()
            assert all(p.poll() is None for p in svc.procs), "workers must survive a Redis restart"


@pytest.mark.anyio
async def test_worker_exits_nonzero_when_redis_stays_away(tmp_path: Path, prefix: str) -> None:
    path = write_pipeline(tmp_path / "p.toml", STAGES, timeouts={"redis_unreachable": 3.0})
    async with EmbeddedRedis() as server:
        svc = Services(tmp_path, redis_url=server.url, prefix=prefix, pipeline=path, extra_env={})
        with svc:
            proc = svc.start("encoder", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "encoder", "encoder-a")
            await server.stop()
            code = await anyio.to_thread.run_sync(lambda: proc.wait(timeout=60))
            assert code != 0


def test_worker_recreates_a_lost_group(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """A Redis restarted without persistence loses streams and groups: workers make them again."""
    svc = make_services(tmp_path, redis_url, prefix)
    with svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        svc.wait_live("encoder", "encoder-a")
        r = sync_redis.Redis.from_url(redis_url)
        r.delete(svc.keys.stage_stream("encoder"), svc.keys.stage_stream("diffusion"))
        client = svc.client()
        rid = client.submit(JOB)
        assert client.wait(rid, timeout=60).state is RequestState.DONE


def test_cancel_stops_at_next_stage_boundary(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
    with svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        client = svc.client()
        rid = client.submit({**JOB, "prompt": "sleep:2"})
        wait_for(lambda: (s := client.status(rid)) and s.state is RequestState.RUNNING, 60, "running")
        assert client.cancel(rid)
        status = client.wait(rid, timeout=30)
        assert status.state is RequestState.CANCELLED
        assert_streams_empty(svc)  # nothing queued or pending anywhere: the diffusion stage cannot run it later
        assert completions(tmp_path, "diffusion", rid) == 0


def test_sigterm_drains_the_entry_in_hand(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
    with svc:
        enc = svc.start("encoder", "a")
        svc.wait_live("encoder", "encoder-a")
        client = svc.client()
        rid = client.submit({**JOB, "prompt": "sleep:1.5"})
        wait_for(lambda: (s := client.status(rid)) and s.state is RequestState.RUNNING, 30, "running")
        enc.send_signal(signal.SIGTERM)
        assert enc.wait(timeout=30) == 0
        assert completions(tmp_path, "encoder", rid) == 1
        status = client.status(rid)
        assert status is not None and status.state is RequestState.QUEUED and status.stage == "diffusion"


def short_wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16_000)
        w.writeframes(b"\x00\x00" * int(16_000 * seconds))
    return buf.getvalue()


INVALID_JOBS: dict[str, tuple[str | dict[str, object], str]] = {
    "steps_zero": ({**JOB, "num_inference_steps": 0}, "num_inference_steps"),
    "steps_above_max": ({**JOB, "num_inference_steps": 80}, "num_inference_steps"),
    "unknown_task": ({**JOB, "task": "t2x"}, "task"),
    "unknown_lora": ({**JOB, "lora": "nope"}, "lora"),
    "flow_shift_range": ({**JOB, "flow_shift": 99.0}, "flow_shift"),
    "audio_flow_shift_range": ({**JOB, "audio_flow_shift": 0.0}, "audio_flow_shift"),
    "fl2va_missing_frame": ({**JOB, "task": "fl2va", "media": {"first_frame": {"path": "/x.png"}}}, "media.last_frame"),
    "width_not_supported": ({**JOB, "width": 330}, "width"),
    "height_too_large": ({**JOB, "height": 4096}, "height"),
    "prompt_too_long": ({**JOB, "prompt": "x" * 5000}, "prompt"),
    "unknown_field": ({**JOB, "colour": "blue"}, "colour"),
    "malformed_json": ('{"prompt": "a cat", "width": ', "__root__"),
    "short_reference_audio": ("AUDIO", "media.reference_audio"),
}


def test_invalid_jobs_end_rejected_with_field_errors(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix)
    r = sync_redis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    with svc:
        worker = svc.start("encoder", "a")
        ids = {}
        for name, (job, _field) in INVALID_JOBS.items():
            rid = f"bad-{name.replace('_', '-')}"
            if job == "AUDIO":
                key = keys.upload(rid, "reference_audio")
                r.set(key, short_wav(0.3), ex=600)
                job = {**JOB, "task": "ref2va", "media": {"reference_audio": {"upload_key": key}}}
            body = job if isinstance(job, str) else json.dumps(job)
            r.xadd(keys.stage_stream("encoder"), {"request_id": rid, "job": body})
            ids[name] = rid
        client = svc.client()
        for name, rid in ids.items():
            status = client.wait(rid, timeout=60)
            assert status.state is RequestState.REJECTED, (name, status)
            assert status.error is not None and status.error.code == "invalid_job", (name, status.error)
            fields = [e["field"] for e in status.error.details["field_errors"]]
            expected = INVALID_JOBS[name][1]
            assert any(f == expected or f.startswith(expected) for f in fields), (name, fields)
        assert worker.poll() is None, "bad input must never take the worker down"
        assert_streams_empty(svc, stages=("encoder",))


def assert_streams_empty(svc: Services, stages: tuple[str, ...] = ("encoder", "diffusion")) -> None:
    """Nothing left behind: acked entries are deleted and nothing is pending."""
    r = sync_redis.Redis.from_url(svc.redis_url)

    def drained() -> bool:
        for stage in stages:
            key = svc.keys.stage_stream(stage)
            if r.exists(key) and (r.xlen(key) or r.xpending(key, stage)["pending"]):
                return False
        return True

    wait_for(drained, 15, "stage streams empty")
