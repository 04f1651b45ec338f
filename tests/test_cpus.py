"""The CPUs a process may use (its affinity, capped by cgroup v2 quotas) and the hot wait's default that
follows from them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stageferry import cpus
from stageferry.config import PipelineConfig, Timeouts
from stageferry.cpus import HOT_WAIT_MIN_CPUS, HOT_WAIT_S, default_hot_wait, usable_cpus

AFFINITY = len(os.sched_getaffinity(0))


def cgroup(tmp_path: Path, own: str, quotas: dict[str, str]) -> tuple[Path, Path]:
    """A /proc/self/cgroup naming ``own`` and a cgroup tree whose ``cpu.max`` files say ``quotas``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"1:cpu:/\n0::{own}\n")
    root = tmp_path / "cgroup"
    for directory, text in quotas.items():
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "cpu.max").write_text(text)
    return proc, root


def test_a_process_pinned_to_one_cpu_counts_one_and_runs_without_a_hot_wait() -> None:
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from stageferry.cpus import usable_cpus; from stageferry.config import Timeouts;"
        "print(usable_cpus(), Timeouts().hot_wait_s(), Timeouts(hot_wait=0.003).hot_wait_s())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "0.0", "0.003"]


def test_the_tightest_quota_on_the_cgroup_path_caps_the_affinity(tmp_path: Path) -> None:
    proc, root = cgroup(tmp_path, "/kube/pod/ctr", {"kube/pod/ctr": "max 100000", "kube/pod": "100000 100000"})
    assert usable_cpus(proc_cgroup=proc, cgroup_root=root) == 1, "the pod's quota, one level up"
    proc, root = cgroup(tmp_path / "half", "/ctr", {"ctr": "50000 100000"})
    assert usable_cpus(proc_cgroup=proc, cgroup_root=root) == 1, "half a CPU rounds to one, never zero"
    proc, root = cgroup(tmp_path / "wide", "/ctr", {"ctr": f"{(AFFINITY + 8) * 100000} 100000"})
    assert usable_cpus(proc_cgroup=proc, cgroup_root=root) == AFFINITY, "a quota above the affinity caps nothing"


@pytest.mark.parametrize(
    ("own", "quotas"),
    [
        ("/ctr", {"ctr": "max 100000", "": "max 100000"}),  # no limit anywhere
        ("/ctr", {"ctr": "not a quota"}),  # unreadable: skipped
        ("/ctr", {"ctr": "100000 0"}),  # a zero period: skipped
        ("/ctr", {}),  # no cpu.max (the controller is off)
    ],
)
def test_no_usable_quota_leaves_the_affinity(tmp_path: Path, own: str, quotas: dict[str, str]) -> None:
    proc, root = cgroup(tmp_path, own, quotas)
    assert usable_cpus(proc_cgroup=proc, cgroup_root=root) == AFFINITY


def test_a_cgroup_outside_the_namespace_root_reads_no_quota(tmp_path: Path) -> None:
    """``0::/../ctrB``: the process sits outside the mounted tree, so ``root/ctrB`` and ``root`` are not its
    ancestors and their quotas are not its own."""
    proc, root = cgroup(tmp_path, "/../ctrB", {"ctrB": "100000 100000", "": "100000 100000"})
    assert usable_cpus(proc_cgroup=proc, cgroup_root=root) == AFFINITY


def test_cgroup_v1_or_no_proc_file_leaves_the_affinity(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/x\n1:cpu:/\n")
    assert usable_cpus(proc_cgroup=v1, cgroup_root=tmp_path) == AFFINITY
    assert usable_cpus(proc_cgroup=tmp_path / "missing", cgroup_root=tmp_path) == AFFINITY


@pytest.mark.parametrize(("count", "wait"), [(HOT_WAIT_MIN_CPUS, HOT_WAIT_S), (HOT_WAIT_MIN_CPUS - 1, 0.0), (2, 0.0)])
def test_the_hot_wait_is_on_from_eight_usable_cpus(monkeypatch: pytest.MonkeyPatch, count: int, wait: float) -> None:
    """This box has fewer than eight CPUs: the count is set here, what follows from it is not."""
    monkeypatch.setattr(cpus, "usable_cpus", lambda: count)
    assert default_hot_wait() == wait
    assert Timeouts().hot_wait_s() == wait, "unset: by the CPUs"
    assert Timeouts(hot_wait=0.0).hot_wait_s() == 0.0 and Timeouts(hot_wait=0.01).hot_wait_s() == 0.01


def test_a_pipeline_file_that_sets_hot_wait_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[timeouts]\nhot_wait = 0.004\n")
    assert PipelineConfig.load(path).timeouts.hot_wait_s() == 0.004
    assert PipelineConfig.load(None).timeouts.hot_wait is None
