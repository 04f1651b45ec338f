"""``stageferry gateway`` as a process: a start that cannot happen is one typed line and exit 1; and its
server's own bounds (a request head must arrive whole in time)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs

from stageferry.config import PipelineConfig
from stageferry.embedded_redis import free_port
from stageferry.gateway import GatewayConfig
from stageferry.heap import GATEWAY_YOUNG_THRESHOLD
from tests.conftest import delete_prefix
from tests.gateway.conftest import running_gateway
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


@pytest.fixture
def quick_heads(redis_url: str) -> Iterator[tuple[str, int]]:
    """A gateway (no stages) whose request heads must be whole within HEAD_S; its host and port."""
    prefix = f"t-head-{uuid.uuid4().hex[:10]}"
    config = GatewayConfig(redis_url=redis_url, prefix=prefix, pipeline=PipelineConfig(), trace_events=False)
    try:
        with running_gateway(config, head_timeout_s=HEAD_S) as base:
            host, port = base.removeprefix("http://").split(":")
            yield host, int(port)
    finally:
        delete_prefix(redis_url, prefix)


HEAD_S = 1.0


def _answer(sock: socket.socket) -> bytes:
    """Everything the gateway writes until it closes the connection (60 s at most)."""
    sock.settimeout(60)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _response(sock: socket.socket) -> tuple[bytes, dict[str, Any]]:
    """One response on a kept-alive connection: its head and its JSON body (read to its Content-Length)."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head, dict(json.loads(body))


def _stalled(answer: bytes) -> dict[str, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in head.lower()
    error: dict[str, Any] = json.loads(body)["error"]
    assert error["code"] == "head_stalled" and error["type"] == "invalid_request_error"
    return error


def test_a_head_not_whole_in_time_is_answered_408_and_its_connection_closed(quick_heads: tuple[str, int]) -> None:
    """uvicorn bounds no request head: a connection that sent nothing, or half a head, was held for ever."""
    with (
        capture_logs() as logs,
        socket.create_connection(quick_heads) as silent,
        socket.create_connection(quick_heads) as slow,
    ):
        slow.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: gateway\r\nContent-Type: multipart/form-da")
        for sock in (silent, slow):
            assert f"within {HEAD_S:g} s" in _stalled(_answer(sock))["message"]
    assert sum(e["event"] == "gateway.head_stalled" for e in logs) == 2


def test_a_whole_head_is_not_cut_by_the_head_timer(quick_heads: tuple[str, int]) -> None:
    """Once the head is whole the request runs past HEAD_S (its body has its own bound), the connection is
    kept alive, and the next request's head is bounded again."""
    body = b'--b\r\nContent-Disposition: form-data; name="size"\r\n\r\n64x64\r\n--b--\r\n'
    head = (
        b"POST /v1/videos HTTP/1.1\r\nHost: gateway\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    with socket.create_connection(quick_heads) as request:
        request.sendall(head)  # the body is held back until HEAD_S has passed for a later connection
        with socket.create_connection(quick_heads) as witness:
            _stalled(_answer(witness))
        request.sendall(body)
        head_bytes, answer = _response(request)
        assert head_bytes.startswith(b"HTTP/1.1 400 "), head_bytes  # the form's own answer: no prompt
        assert answer["error"]["code"] == "invalid_form"
        request.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n")  # half of the next request's head
        _stalled(_answer(request))
