"""``stageferry up`` parts: worker liveness, child services' lifecycle, and one whole run."""

from __future__ import annotations

import json
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
def test_up_runs_one_job_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # outputs land under the working directory: never in the repository
    result = CliRunner().invoke(
        app,
        ["--prefix", "t-up", "up", "--startup-timeout", "90", "--timeout", "120"],
        env={"STAGEFERRY_REDIS_URL": None, "STAGEFERRY_PIPELINE": None},
    )
    logs = tmp_path / "out" / "logs"
    assert result.exit_code == 0, result.output + "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
    assert ": done" in result.stdout
    assert "encoder" in result.stdout and "diffusion" in result.stdout
    assert result.stderr.count("outputs: ") == 1 and f"outputs: {tmp_path / 'out'}" in result.stderr
    # Service logs are JSON lines only (NIXL's own lines included), and name the request key.
    for log in logs.glob("*.log"):
        for line in log.read_text().splitlines():
            json.loads(line)
    # The trace outlives up's private Redis: `trace` finds it with no flags.
    (mp4,) = (tmp_path / "out").glob("*.mp4")
    request_id = mp4.stem
    assert (tmp_path / "out" / f"{request_id}.trace.json").is_file()
    traced = CliRunner().invoke(app, ["trace", request_id], env={"STAGEFERRY_REDIS_URL": None})
    assert traced.exit_code == 0, traced.output
    assert "payload.put" in traced.stdout and "status.done" in traced.stdout
