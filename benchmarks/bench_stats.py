"""What every benchmark script prints the same way: percentiles, table cells, sizes, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Sequence

from stageferry.testing import TASKS

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
#: The three conditioning payloads of the reference model (bytes), by task.
TASK_BYTES = {name: nbytes for name, (_, nbytes) in TASKS.items()}
TASK_OF_SIZE = {nbytes: name for name, nbytes in TASK_BYTES.items()}


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank (no interpolation: a p99 is a sample that happened)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def cell(values: Sequence[float], digits: int = 3) -> str:
    """``median / p99`` of one series."""
    return f"{median(values):.{digits}f} / {pct(values, 99):.{digits}f}"


def print_steps(title: str, steps: dict[str, list[float]], *, unit: str, q: int, digits: int) -> None:
    """A diagnostic's table: one row per step, its median and its ``q``-th percentile (by index)."""
    print(f"| {title} | p50 {unit} | p{q} {unit} |")
    print("| --- | ---: | ---: |")
    for name, values in steps.items():
        ordered = sorted(values)
        tail = ordered[int(q / 100 * (len(ordered) - 1))]
        print(f"| {name} | {statistics.median(values):.{digits}f} | {tail:.{digits}f} |")


def human(n: int) -> str:
    """A byte count as a table label: ``4 KiB``, ``64 MiB``, or the task name for task payload sizes."""
    if n in TASK_OF_SIZE:
        return f"{n:,} ({TASK_OF_SIZE[n]})"
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,}"


def verdict(holds: bool) -> str:
    return "HOLDS" if holds else "DOES NOT HOLD"


def machine_facts() -> str:
    """One line about the host: CPU model and count, load, memory, GPUs."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as fh:
            mem_gib = int(fh.readline().split()[1]) / (1 << 20)
    except (OSError, ValueError, IndexError):
        mem_gib = 0.0
    gpus = ""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        gpus = f", GPUs: {len(names)} × {names[0]}" if names else ""
    except (OSError, subprocess.SubprocessError):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}), {mem_gib:.0f} GiB, load average {load}{gpus}"


def rss_mib(pid: int) -> float:
    """Resident memory of a process (VmRSS), MiB; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
