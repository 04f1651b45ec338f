"""The worker's Redis retry (``StageWorker._with_redis_retry``) on a real Redis: the first attempt runs
bare, a transient failure is logged and retried under the policy, anything else is raised at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.retry import Retry
from structlog.testing import capture_logs

from stageferry.broker.control.redis_conn import connect, translated
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import free_port
from stageferry.errors import RequestIdTakenError
from stageferry.stages.worker import StageWorker
from tests.models import factory
from tests.procs import write_pipeline
from tests.stages.workers import first_stage_worker

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
async def worker(tmp_path: Path, redis_url: str, prefix: str) -> AsyncIterator[StageWorker]:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}],
        timeouts={"redis_unreachable": 5.0},
    )
    pipeline = PipelineConfig.load(path)
    redis = connect(redis_url)
    yield first_stage_worker(redis, prefix, pipeline, factory(stage=pipeline.stages[0], pipeline=pipeline))
    await redis.aclose()


async def test_a_transient_failure_is_logged_and_retried_until_the_call_succeeds(worker: StageWorker) -> None:
    """The first two attempts go to a port nobody listens on (a real connection refusal, translated once
    as everywhere), the third to the test Redis."""
    nowhere = aioredis.Redis(host="127.0.0.1", port=free_port(), retry=Retry(NoBackoff(), 0))
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        with translated():
            await (nowhere if len(calls) <= 2 else worker.redis).ping()
        return "answered"

    try:
        with capture_logs() as logs:
            assert await worker._with_redis_retry(flaky) == "answered"
    finally:
        await nowhere.aclose()
    assert len(calls) == 3
    retries = [e for e in logs if e["event"] == "worker.redis_retry"]
    assert [e["attempt"] for e in retries] == [0, 1], "the bare attempt's failure, then the policy's first"


async def test_the_first_attempt_runs_bare_and_other_errors_are_raised_at_once(worker: StageWorker) -> None:
    calls: list[int] = []

    async def ok() -> int:
        calls.append(1)
        return 7

    async def refused() -> None:
        calls.append(1)
        raise RequestIdTakenError("taken", request_id="r")

    with capture_logs() as logs:
        assert await worker._with_redis_retry(ok) == 7
        with pytest.raises(RequestIdTakenError):
            await worker._with_redis_retry(refused)
    assert len(calls) == 2 and not [e for e in logs if e["event"] == "worker.redis_retry"]
