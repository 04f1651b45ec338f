"""CUDA MPS for stages on one GPU (``stages/process/mps.py``): when ``up`` starts a private daemon, and its
life (started before the stages, asked to quit after them, stopped if deaf, its directories removed).

The daemon here is ``tests/fake_mps.py`` (no NVIDIA driver in CI); the real one runs on the device
machine (``benchmarks/issue39_device.sh up_gpu``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

import anyio
import pytest

from stageferry.errors import ConfigError
from stageferry.stages.process import mps
from stageferry.stages.process.mps import MpsDaemon, MpsMode, decide, start_mps
from tests.fake_mps import install

SHARED = {0: ("encoder/0", "diffusion/0")}


@pytest.fixture
def fake(tmp_path: Path) -> tuple[dict[str, str], Path]:
    record = tmp_path / "record.txt"
    return {**os.environ, **install(tmp_path / "bin", record)}, record


def test_auto_starts_only_for_a_shared_gpu_with_the_daemon_on_path(fake: tuple[dict[str, str], Path]) -> None:
    env, _ = fake
    started = decide(MpsMode.AUTO, SHARED, env)
    assert started.start and started.reason == "private control daemon for GPU 0 (encoder/0 + diffusion/0)"
    assert decide(MpsMode.AUTO, {}, env) == mps.MpsDecision(False, "not needed (no GPU runs ranks of two stages)")
    assert not decide(MpsMode.OFF, SHARED, env).start
    mine = decide(MpsMode.AUTO, SHARED, {**env, mps.PIPE_ENV: "/run/ops-mps"})
    assert not mine.start and "/run/ops-mps" in mine.reason  # an operator's own MPS is theirs
    missing = decide(MpsMode.AUTO, SHARED, {"PATH": "/nonexistent"})
    assert not missing.start and "no nvidia-cuda-mps-control on PATH" in missing.reason
    assert decide(MpsMode.ON, {}, env).start  # asked for: even without a shared GPU


def test_on_without_the_daemon_is_refused() -> None:
    with pytest.raises(ConfigError, match="--mps on, but no nvidia-cuda-mps-control"):
        decide(MpsMode.ON, SHARED, {"PATH": "/nonexistent"})


@pytest.mark.anyio
async def test_the_daemon_lives_for_the_block_and_quits_after(fake: tuple[dict[str, str], Path]) -> None:
    env, record = fake
    out = record.parent / "logs" / "mps-control.txt"
    async with MpsDaemon(env, out) as daemon:
        pipe = Path(daemon.env[mps.PIPE_ENV])
        assert await anyio.Path(pipe / "control").exists() and await anyio.Path(daemon.env[mps.LOG_ENV]).is_dir()
        assert record.read_text().splitlines() == [f"started {pipe}"]
        proc = daemon.process
        assert proc is not None and proc.returncode is None
    assert record.read_text().splitlines() == [f"started {pipe}", "quit"]
    assert proc.returncode == 0  # it left on quit, not on a signal
    assert not pipe.parent.exists()
    assert out.read_text() == f"fake mps control: listening on {pipe}\n"  # its output, in the file given


@pytest.mark.anyio
async def test_a_deaf_daemon_is_stopped(fake: tuple[dict[str, str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    env, record = fake
    # The deaf daemon never leaves: the stop waits all of QUIT_S, then signals it.  Long enough for the
    # control client (a Python start) to deliver its quit on a loaded 2-core box: at 0.5 s it once did not.
    monkeypatch.setattr(mps, "QUIT_S", 5.0)
    async with MpsDaemon({**env, "FAKE_MPS_DEAF": "1"}) as daemon:
        proc = daemon.process
    assert proc is not None and proc.returncode is not None and proc.returncode < 0  # signalled
    assert record.read_text().splitlines()[-1] == "quit"


@pytest.mark.anyio
async def test_a_daemon_that_cannot_be_told_to_quit_is_stopped_and_its_directory_removed(
    fake: tuple[dict[str, str], Path],
) -> None:
    """The control client cannot run (gone from PATH): the daemon is signalled instead, and its pipe and
    log directory go all the same."""
    env, record = fake
    async with MpsDaemon(env) as daemon:
        pipe, proc = Path(daemon.env[mps.PIPE_ENV]), daemon.process
        (record.parent / "bin" / mps.CONTROL).unlink()
    assert proc is not None and proc.returncode is not None and proc.returncode < 0  # signalled
    assert record.read_text().splitlines() == [f"started {pipe}"]  # no quit reached it
    assert not pipe.parent.exists()


@pytest.mark.anyio
async def test_a_daemon_that_dies_at_start_is_a_config_error(
    fake: tuple[dict[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, _ = fake
    made: list[str] = []
    real_mkdtemp = mps.tempfile.mkdtemp

    def mkdtemp(**kw: str) -> str:
        made.append(real_mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr(mps.tempfile, "mkdtemp", mkdtemp)
    with pytest.raises(ConfigError, match="exited 3 before opening"):
        async with MpsDaemon({**env, "FAKE_MPS_EXIT": "3"}):
            pass
    assert len(made) == 1 and not await anyio.Path(made[0]).exists()  # its directories went with it


@pytest.mark.anyio
async def test_a_failed_start_is_said_under_auto_and_refused_under_on(fake: tuple[dict[str, str], Path]) -> None:
    env = {**fake[0], "FAKE_MPS_EXIT": "1"}
    wanted = decide(MpsMode.AUTO, SHARED, env)
    async with contextlib.AsyncExitStack() as stack:
        decision, stage_env = await start_mps(stack, MpsMode.AUTO, wanted, env)
    assert not decision.start and stage_env == {}
    assert decision.reason.startswith("not started: nvidia-cuda-mps-control -f exited 1")
    async with contextlib.AsyncExitStack() as stack:
        with pytest.raises(ConfigError, match="exited 1"):
            await start_mps(stack, MpsMode.ON, wanted, env)
    async with contextlib.AsyncExitStack() as stack:
        decision, stage_env = await start_mps(stack, MpsMode.AUTO, wanted, fake[0])
        assert decision is wanted and await anyio.Path(stage_env[mps.PIPE_ENV], "control").exists()


def _real_gpu() -> bool:
    if shutil.which(mps.CONTROL) is None:
        return False
    torch = pytest.importorskip("torch")
    return bool(torch.cuda.is_available())


@pytest.mark.anyio
@pytest.mark.skipif(not _real_gpu(), reason="the real nvidia-cuda-mps-control and a GPU (the device machine)")
async def test_the_real_daemon_serves_a_cuda_process_and_quits(tmp_path: Path) -> None:
    """The real path (the device machine): a CUDA process started with the daemon's variables is served by
    an MPS server the daemon spawned for it, and the daemon leaves on ``quit`` with its directories."""
    probe = "import os, torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); print(os.getpid())"
    async with MpsDaemon(os.environ) as daemon:
        env = {**os.environ, **daemon.env}
        client = await anyio.run_process([sys.executable, "-c", probe], env=env)
        servers = await anyio.run_process([mps.CONTROL], input=b"get_server_list\n", env=env)
        listed = servers.stdout.decode().split()
        assert listed and all(pid.isdigit() for pid in listed)  # the client's work went through an MPS server
        assert client.returncode == 0
        proc, pipe = daemon.process, Path(daemon.env[mps.PIPE_ENV])
    assert proc is not None and proc.returncode == 0  # it left on quit
    assert not pipe.parent.exists()
