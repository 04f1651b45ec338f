"""``benchmarks/script_instructions.py``: each step of a request's hot path counted by callgrind on a private
``redis-server``, through the tree's own API (a tiny run: the figures themselves are the benchmark's)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks import script_instructions
from stageferry.embedded_redis import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("redis-server") is None, reason="no valgrind")
def test_every_step_of_a_request_is_counted(tmp_path: Path) -> None:
    got = script_instructions.run_tree(ROOT, 2, tmp_path, free_port(), tmp_path)
    assert list(got) == list(script_instructions.STEPS)
    assert all(10_000 < n < 10_000_000 for n in got.values()), got  # a script's call: thousands of instructions
    assert len(list(tmp_path.glob("*.callgrind"))) == len(script_instructions.STEPS)  # kept for callgrind_annotate
