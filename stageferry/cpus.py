"""How many CPUs this process may use, and the hot wait that follows from it.

``os.cpu_count()`` counts the host's CPUs, not this process's: under ``taskset``, or in a container given
``--cpus`` (a cgroup v2 quota, ``cpu.max``), it overstates what the process can run on.  :func:`usable_cpus`
takes the affinity mask and caps it by every quota on the process's cgroup path, as Go's automaxprocs
and the JVM's container support do.

What follows from it here is :func:`default_hot_wait`, the value of ``timeouts.hot_wait`` when the
pipeline leaves it unset.  A hot wait keeps a stage's leader spinning for 2 ms after each entry, which
shortens a hop only when a core is free to spin on: side by side on one host (``throughput.py
--hot-wait``, T2VA, two replicas a stage, every process pinned to the same CPUs;
``benchmarks/RESULTS.md`` §16) asleep beat hot by 13-40 % on 2 CPUs and 4-27 % on 4, while on 16 the hot
wait took 4-12 % off a hop and cost no throughput.  So it is on from :data:`HOT_WAIT_MIN_CPUS` up.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The hot wait where the process has CPUs to spare (``timeouts.hot_wait`` unset).
HOT_WAIT_S = 0.002
#: Fewest usable CPUs at which an unset ``timeouts.hot_wait`` is :data:`HOT_WAIT_S` (below: 0, off).
HOT_WAIT_MIN_CPUS = 8

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cpus(*, proc_cgroup: Path = Path("/proc/self/cgroup"), cgroup_root: Path = _CGROUP_ROOT) -> int:
    """The CPUs this process may run on (its affinity), capped by the tightest cgroup v2 CPU quota on its
    cgroup's path (``cpu.max``: quota / period, rounded down, at least 1).  Where a file is missing or
    unreadable (cgroup v1, another OS) that cap is skipped."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cpus = os.cpu_count() or 1
    for directory in _cgroup_path(proc_cgroup, cgroup_root):
        quota = _quota(directory / "cpu.max")
        if quota is not None:
            cpus = min(cpus, quota)
    return max(1, cpus)


def default_hot_wait() -> float:
    """``timeouts.hot_wait`` when the pipeline leaves it unset: :data:`HOT_WAIT_S` on
    :data:`HOT_WAIT_MIN_CPUS` usable CPUs or more, else 0."""
    return HOT_WAIT_S if usable_cpus() >= HOT_WAIT_MIN_CPUS else 0.0


def _cgroup_path(proc_cgroup: Path, root: Path) -> list[Path]:
    """The process's cgroup v2 directory and its ancestors up to ``root`` (none on cgroup v1)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    own = next((line[3:] for line in lines if line.startswith("0::")), None)
    if own is None:
        return []
    parts = [p for p in own.strip().split("/") if p]
    if ".." in parts:  # outside this namespace's root (``0::/../x``): none of its files is on our path
        return []
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _quota(cpu_max: Path) -> int | None:
    """Whole CPUs a ``cpu.max`` allows ("max 100000": no limit, None)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, int(quota) // int(period))
    except (OSError, ValueError, ZeroDivisionError):
        return None
