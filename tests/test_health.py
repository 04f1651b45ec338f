"""`stageferry health`, the container health check, against a real Redis."""

from __future__ import annotations

import time

import pytest
import redis as sync_redis
from typer.testing import CliRunner

from stageferry.broker.control.keys import Keys
from stageferry.cli import app

runner = CliRunner()


def health(redis_url: str, prefix: str, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["--redis-url", redis_url, "--prefix", prefix, "health", *args])
    return result.exit_code, result.output


def beat(redis_url: str, prefix: str, stage: str, consumer: str, at: float) -> None:
    with sync_redis.Redis.from_url(redis_url) as r:
        r.hset(Keys(prefix).workers(stage), consumer, str(at))


def test_redis_reachable_is_healthy(redis_url: str, prefix: str) -> None:
    assert health(redis_url, prefix) == (0, "ok\n")


def test_unreachable_redis_is_unhealthy(prefix: str) -> None:
    code, output = health("redis://127.0.0.1:1/0", prefix, "--timeout", "3")
    assert code == 1
    assert output.startswith("unhealthy: ") and "Traceback" not in output


def test_stage_needs_this_replicas_fresh_heartbeat(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGEFERRY_REPLICA", "box-1")
    code, output = health(redis_url, prefix, "--stage", "encoder")
    assert code == 1 and "encoder-box-1" in output  # no heartbeat at all

    beat(redis_url, prefix, "encoder", "encoder-box-2", time.time())  # another replica's is not ours
    assert health(redis_url, prefix, "--stage", "encoder")[0] == 1

    beat(redis_url, prefix, "encoder", "encoder-box-1", time.time() - 600)  # stale
    assert health(redis_url, prefix, "--stage", "encoder")[0] == 1

    beat(redis_url, prefix, "encoder", "encoder-box-1", time.time())
    assert health(redis_url, prefix, "--stage", "encoder") == (0, "ok\n")
    assert health(redis_url, prefix, "--stage", "diffusion")[0] == 1  # per stage


def test_a_stage_the_pipeline_has_not_is_named_as_such(redis_url: str, prefix: str) -> None:
    """A mistyped ``--stage`` says the pipeline has no such stage and lists them (it read as a replica
    whose heartbeat is missing)."""
    code, output = health(redis_url, prefix, "--stage", "encodr")
    assert (code, output) == (
        1,
        "unhealthy: no stage named 'encodr' in the pipeline (its stages: encoder, diffusion)\n",
    )
