"""``stageferry gateway`` as a process: a start that cannot happen is one typed line and exit 1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from stageferry.embedded_redis import free_port
from stageferry.heap import GATEWAY_YOUNG_THRESHOLD
from tests.procs import wait_for

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_port_in_use_is_one_config_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")} | {"PYTHONPATH": str(ROOT)}
        argv = [
            sys.executable,
            "-m",
            "stageferry",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "gateway",
            "--port",
            str(port),
        ]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error [config]: the gateway could not start on 127.0.0.1:{port} (the log line above says why)"
    assert "Traceback" not in result.stderr


def test_the_gateway_settles_its_heap_before_serving(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """Collections mid-burst stalled every request, ``/health`` too: the gateway freezes its start-up
    heap and collects its youngest generation every 20,000 allocations (stageferry.heap has the
    figures), then serves."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")} | {"PYTHONPATH": str(ROOT)}
    env |= {"STAGEFERRY_LOG_FORMAT": "json", "STAGEFERRY_LOG_LEVEL": "info", "STAGEFERRY_PREFIX": prefix}
    argv = [sys.executable, "-m", "stageferry", "--redis-url", redis_url, "gateway", "--port", str(port)]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def settled() -> dict[str, Any] | None:
            for line in log.read_text(errors="replace").splitlines():
                if '"gateway.heap_settled"' in line:
                    return dict(json.loads(line))
            assert proc.poll() is None, log.read_text()
            return None

        event = wait_for(settled, 120, "gateway.heap_settled")
        assert event["frozen_objects"] >= 10_000 and event["young_threshold"] == GATEWAY_YOUNG_THRESHOLD == 20_000
        answer = wait_for(lambda: _health(port), 60, "/health to answer")
        assert answer.status_code == 503 and "no live worker" in answer.text  # it answers (no stages here)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def _health(port: int) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    except httpx.HTTPError:
        return None
