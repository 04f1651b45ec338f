"""``stageferry up`` parts: worker liveness, child services' lifecycle, and one whole run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.cli import app
from stageferry.errors import StageFailedError
from stageferry.launcher import ServiceGroup, wait_for_workers


@pytest.mark.anyio
async def test_wait_for_workers(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        await redis.hset(keys.workers("encoder"), "r1", str(time.time()))
        await redis.hset(keys.workers("diffusion"), "r1", str(time.time() - 60))
        with pytest.raises(StageFailedError, match="diffusion"):
            await wait_for_workers(redis, keys, ["encoder", "diffusion"], timeout=0.3)
        await redis.hset(keys.workers("diffusion"), "r2", str(time.time()))
        await wait_for_workers(redis, keys, ["encoder", "diffusion"], timeout=1)


@pytest.mark.anyio
async def test_service_group_stops_children_and_reports_early_exits(tmp_path: Path) -> None:
    group = ServiceGroup(dict(os.environ), tmp_path, stop_timeout=0.5)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    )
    await group.start("stubborn", [sys.executable, "-c", stubborn])
    for _ in range(500):  # its SIGTERM handler is in place once it has said so
        if group.log_tail("stubborn") == "up":
            break
        await anyio.sleep(0.02)
    await group.start("crash", [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(group.watch, "stubborn", tg.cancel_scope)
        tg.start_soon(group.watch, "crash", tg.cancel_scope)
    assert group.failure is not None and group.failure.details["returncode"] == 3
    assert "bye" in str(group.failure)
    started = time.monotonic()
    await group.stop()  # SIGTERM is ignored: SIGKILL after the bound
    assert time.monotonic() - started < 5
    assert group.log_tail("stubborn") == "up"


@pytest.mark.slow
def test_up_runs_one_job_end_to_end(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["--prefix", "t-up", "up", "--log-dir", str(tmp_path), "--startup-timeout", "60", "--timeout", "60"],
        env={"STAGEFERRY_REDIS_URL": None, "STAGEFERRY_PIPELINE": None},
    )
    assert result.exit_code == 0, result.output + "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
    assert ": done" in result.stdout
    assert "encoder" in result.stdout and "diffusion" in result.stdout
