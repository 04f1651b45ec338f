"""``benchmarks/step_timer.py``: the steps ``transfer.py --steps`` wraps still name what the data plane has
(a step renamed or moved away, e.g. the seal into :class:`~stageferry.schemas.nixl.Sealer`, used to crash
the benchmark at start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# In a process of its own: wrapping replaces the data plane's methods for the rest of that process.
WRAP_BOTH = """
import sys
sys.path.insert(0, "benchmarks")
from step_timer import hop_steps
from stageferry.schemas.nixl import Sealer

for role in ("producer", "consumer"):
    hop_steps(role)
timer = hop_steps("consumer")
assert Sealer(b"k" * 32).seal("agent", "token", []) == Sealer(b"k" * 32).seal("agent", "token", [])
print(sorted(timer.times))
"""


def test_every_step_it_wraps_exists_and_a_wrapped_step_is_timed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", WRAP_BOTH], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "get: seal (the peer's Sealer)" in done.stdout, done.stdout
