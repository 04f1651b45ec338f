"""tests.zygote: a forked child is what ``python -m stageferry <args>`` would be (output, environment,
working directory, exit codes, signals), and the zygote leaves no child behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import zygote
from tests.procs import wait_for
from tests.zygote import ForkedProcess, Zygote


@pytest.fixture
def zyg() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def test_a_child_runs_the_cli_with_its_own_environment_and_directory(zyg: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "schema.log"
    env = dict(os.environ, STAGEFERRY_PREFIX="zyg-test")
    proc = zyg.spawn("stageferry", ["schema", "job"], env=env, cwd=tmp_path, log=log)
    assert proc.wait(timeout=60) == 0
    assert json.loads(log.read_text())["title"]  # the CLI's stdout went to the log, whole
    failing = zyg.spawn("stageferry", ["schema", "nonsense"], env=env, cwd=tmp_path, log=tmp_path / "bad.log")
    assert failing.wait(timeout=60) == 2  # a usage error, as from the exec'd command
    assert "error [usage]" in (tmp_path / "bad.log").read_text()


def test_signals_reach_the_child_and_its_end_is_told_as_popen_tells_it(zyg: Zygote, tmp_path: Path) -> None:
    env = dict(os.environ, STAGEFERRY_REDIS_URL="redis://127.0.0.1:1/0", STAGEFERRY_PREFIX="zyg-test")
    # `wait` retries an unreachable Redis until its timeout: a child that runs until it is told otherwise
    proc = zyg.spawn("stageferry", ["wait", "x", "--timeout", "120"], env=env, cwd=tmp_path, log=tmp_path / "wait.log")
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_closing_the_zygote_kills_its_children(tmp_path: Path) -> None:
    z = Zygote()
    env = dict(os.environ, STAGEFERRY_REDIS_URL="redis://127.0.0.1:1/0", STAGEFERRY_PREFIX="zyg-test")
    proc = z.spawn("stageferry", ["wait", "x", "--timeout", "120"], env=env, cwd=tmp_path, log=tmp_path / "wait.log")
    z.close()

    def gone() -> bool:
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=30, what="the zygote's child killed with it")


def test_a_pythonpath_the_zygote_lacks_is_execd_so_its_sitecustomize_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "loaded"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    plain = dict(os.environ, PYTHONPATH=zygote.PYTHONPATH)
    forked = zygote.start("stageferry", ["schema", "job"], env=plain, cwd=tmp_path, log=tmp_path / "a.log")
    assert isinstance(forked, ForkedProcess) and forked.wait(timeout=60) == 0
    assert not marker.exists()
    env = dict(plain, PYTHONPATH=os.pathsep.join([str(site), zygote.PYTHONPATH]))
    execd = zygote.start("stageferry", ["schema", "job"], env=env, cwd=tmp_path, log=tmp_path / "b.log")
    assert isinstance(execd, subprocess.Popen) and execd.wait(timeout=60) == 0
    assert marker.exists()  # the pickle tripwire's sitecustomize is loaded this way
