"""``stageferry up`` parts: worker liveness, child services' lifecycle, and one whole run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import psutil
import pytest
from typer.testing import CliRunner

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.cli import app
from stageferry.cli.launcher import REPROMPT, ServiceGroup, wait_for_workers, warm_jobs
from stageferry.cli_hints import cli_command
from stageferry.config import Limits
from stageferry.errors import StageFailedError
from tests.fake_mps import install
from tests.waits import until_sync

#: up's job, small (what these tests check is up's wiring, not the model's cost at the default 320×192).
SMALL_JOB = ["--width", "160", "--height", "96", "--fps", "8", "--duration", "1", "--steps", "2"]


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
    record = tmp_path / "mps.txt"  # --mps on with the stand-in daemon (tests/fake_mps.py; CI has no driver)
    flags = ["--startup-timeout", "90", "--timeout", "120", "--mps", "on", "--warm-runs", "2"]
    result = CliRunner().invoke(
        app,
        ["--prefix", "t-up", "up", *SMALL_JOB, *flags],
        # No UCX pin from the suite (tests/conftest.py): up's own holds its stages to loopback.
        env={
            "STAGEFERRY_REDIS_URL": None,
            "STAGEFERRY_PIPELINE": None,
            "STAGEFERRY_ADVERTISE_ADDRESS": None,
            "UCX_NET_DEVICES": None,
            **install(tmp_path / "bin", record),
        },
    )
    logs = tmp_path / "out" / "logs"
    assert result.exit_code == 0, result.output + "".join(p.read_text()[-2000:] for p in logs.glob("*.log"))
    assert ": done" in result.stdout
    assert "encoder" in result.stdout and "diffusion" in result.stdout
    assert result.stderr.count("outputs: ") == 1 and f"outputs: {tmp_path / 'out'}" in result.stderr
    # Service logs are JSON lines only (NIXL's own lines included), and name the request key.
    events = [json.loads(line) for log in logs.glob("*.log") for line in log.read_text().splitlines()]
    # Both stages advertised loopback and held UCX to it; the hop names both ends there.
    pinned = {e["service"]: (e["address"], e["net_devices"]) for e in events if e.get("event") == "nixl.address"}
    assert pinned == {f"{stage}-rank0": ("127.0.0.1", "lo") for stage in ("encoder", "diffusion")}, pinned
    gets = [e for e in events if e.get("event") == "payload.get" and e.get("transport") == "nixl"]
    assert gets and {(e["source"], e["destination"]) for e in gets} == {("127.0.0.1", "127.0.0.1")}, gets
    # The daemon was up before the stages (each names its pipe) and was asked to quit after them.
    assert "cuda mps: private control daemon for the stages" in result.stderr
    started, quit_ = record.read_text().splitlines()
    pipe = started.removeprefix("started ")
    placed = {e["stage"]: e["cuda_mps"] for e in events if e.get("event") == "placement.stage"}
    assert placed == {"encoder": pipe, "diffusion": pipe} and quit_ == "quit"
    # What the daemon prints goes beside the stages' logs, not to up's terminal.
    assert f"listening on {pipe}" in (logs / "mps-control.txt").read_text() and "listening" not in result.output
    # The job ran twice more (--warm-runs 2): the same job, then with a longer prompt (another payload
    # structure); each hop's first transfer beside both.
    table = result.stdout.splitlines()
    head = next(i for i, line in enumerate(table) if line.startswith("hop "))
    assert table[head].split()[-5:] == ["first/warm", "new", "prompt", "ms", "first/new"], table[head]
    hop = table[head + 1].split()
    assert hop[:3] == ["encoder", "→", "diffusion"] and hop[-1].endswith("×") and hop[-3].endswith("×"), hop
    sizes = {e["bytes"] for e in gets}
    assert len(gets) == 3 and len(sizes) == 2, gets  # the longer prompt's payload is another size
    # The trace outlives up's private Redis: `trace` finds it with no flags.
    request_id = result.stdout.split("request ", 1)[1].split(":", 1)[0]
    assert len(list((tmp_path / "out").glob("*.mp4"))) == 3 and (tmp_path / "out" / f"{request_id}.mp4").is_file()
    assert (tmp_path / "out" / f"{request_id}.trace.json").is_file()
    traced = CliRunner().invoke(app, ["trace", request_id], env={"STAGEFERRY_REDIS_URL": None})
    assert traced.exit_code == 0, traced.output
    assert "payload.put" in traced.stdout and "status.done" in traced.stdout


def test_warm_runs_are_the_same_job_then_longer_prompts() -> None:
    """The warm runs: the first half (rounded up) the very same job, then the same job with a prompt longer
    each time, so each payload has another structure (the reference encoder's text states are one token per
    prompt byte); all the same job when the longest prompt would be past the deployment's limits."""
    from stageferry.stages.reference.text_encoder import tokenize

    job = {"task": "t2va", "prompt": "a cat", "width": 64, "height": 64}
    jobs, same = warm_jobs(job, 5, Limits(), [])
    assert same == 3 and jobs[:3] == [job] * 3
    assert all({**j, "prompt": job["prompt"]} == job for j in jobs[3:])  # only the prompt differs
    lengths = [len(tokenize(j["prompt"], 512)) for j in [job, *jobs[3:]]]
    assert len(set(lengths)) == 3, lengths
    assert warm_jobs(job, 1, Limits(), []) == ([job], 1)
    # a prompt at the deployment's limit: no longer one is sent (it would be refused), the same job instead
    tight = Limits(max_prompt_chars=len("a cat") + len(REPROMPT))
    assert warm_jobs(job, 2, tight, [])[1] == 1  # one more is allowed
    assert warm_jobs(job, 4, tight, []) == ([job] * 4, 4)


def test_cli_command_names_the_program_as_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`up` is usually `.venv/bin/stageferry` with no `stageferry` on PATH: the printed command says so."""
    program = tmp_path / ".venv" / "bin" / "stageferry"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli_command(str(program)) == ".venv/bin/stageferry"
    assert cli_command(".venv/bin/stageferry") == ".venv/bin/stageferry"
    monkeypatch.chdir("/")
    assert cli_command(str(program)) == str(program)
    monkeypatch.setenv("PATH", str(program.parent))
    assert cli_command(str(program)) == "stageferry"
    assert cli_command("/x/stageferry/__main__.py").endswith(" -m stageferry")


def test_a_job_the_deployment_refuses_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`up --task i2va` on the built-in pipeline (it serves t2va, fl2va, ref2va): the deployment's refusal,
    before a Redis or a stage is started (it used to come after both, some 8 s later)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")}
    env["STAGEFERRY_REDIS_URL"] = "redis://127.0.0.1:1/0"  # nothing answers there: a start would fail otherwise
    command = [sys.executable, "-m", "stageferry", "up", "--task", "i2va", "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error [invalid_job]: task: this deployment serves t2va, fl2va, ref2va only (limits.tasks)"
    )
    assert not (tmp_path / "logs").exists() and "outputs:" not in done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_signals_during_start_up_stop_up_after_its_clean_up(tmp_path: Path) -> None:
    """SIGTERM while `up` starts (waiting for its MPS daemon's control pipe), then another at once: the first
    stops the run, the second waits for the clean-up, which a signal's default action used to cut short —
    leaving the private Redis and the MPS daemon (each in its own session) running."""
    record = tmp_path / "mps.txt"
    env = {**os.environ, **install(tmp_path / "bin", record), "FAKE_MPS_HOLD": "1"}
    env = {k: v for k, v in env.items() if k not in ("STAGEFERRY_REDIS_URL", "STAGEFERRY_PIPELINE")}
    up = subprocess.Popen(
        [sys.executable, "-m", "stageferry", "--prefix", "t-up-sig", "up", *SMALL_JOB, "--mps", "on"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # the daemon's first line (it then holds: up waits on its pipe), unless up ended first
        until_sync(lambda: up.poll() is not None or (record.exists() and record.read_text().startswith("started ")),
                   "the MPS daemon started by up", timeout=120)  # fmt: skip
        assert up.poll() is None, up.communicate(timeout=30)
        up.send_signal(signal.SIGTERM)
        up.send_signal(signal.SIGTERM)
        err = up.communicate(timeout=120)[1]
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 130, err
    pipe = Path(record.read_text().splitlines()[0].removeprefix("started "))
    assert not pipe.parent.exists(), err  # the daemon's directory went with it
    daemons = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert daemons == [], err
    port = int(err.split("private server at redis://127.0.0.1:", 1)[1].split("/", 1)[0])
    with pytest.raises(OSError):  # the private Redis was stopped
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_serve_prints_a_submit_and_a_trace_command_that_work(tmp_path: Path) -> None:
    """The newcomer's path as printed: `up --serve` (the real program, not on PATH), the submit command it
    prints run as printed, Ctrl-C, then the printed trace command; no raw log line on up's console."""
    program = Path(sys.executable).parent / "stageferry"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    env["PATH"] = "/usr/bin:/bin"  # no stageferry on PATH, as after scripts/up.sh
    up = subprocess.Popen(
        [str(program), "--prefix", "t-up-serve", "up", "--serve", *SMALL_JOB, "--startup-timeout", "240",
         "--warm-runs", "0"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert up.stderr is not None
    lines: list[str] = []
    try:
        while not any(line.startswith("submit another job: ") for line in lines):
            line = up.stderr.readline()
            assert line, f"up ended early: {''.join(lines)}"
            lines.append(line)
        hint = lines[-1].removeprefix("submit another job: ").strip()
        assert " --width 160 --height 96 " in hint and shlex.split(hint)[0] == str(program)  # up's job size
        submitted = subprocess.run(shlex.split(hint), cwd=tmp_path, env=env, capture_output=True, text=True,
                                   timeout=400)  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        assert "done" in submitted.stdout, submitted.stdout
    finally:
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=120)[1]
    lines.append(rest)
    console = "".join(lines)
    assert "embedded_redis" not in console and not any(line.startswith("{") for line in console.splitlines())
    (trace_line,) = [line for line in console.splitlines() if line.startswith("trace: ")]
    command = shlex.split(trace_line.removeprefix("trace: ").split("  (saved in")[0])
    assert command[0] == str(program)
    traced = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert traced.returncode == 0, traced.stderr
    assert "status.done" in traced.stdout
