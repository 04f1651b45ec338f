"""Result files are served only from the deployment's output directory: forged statuses naming host files,
symlinks out of the directory, FIFOs and swapped files are refused, through a real gateway on real Redis."""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import redis as sync_redis
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.gateway import GatewayConfig
from stageferry.gateway.errors import MAX_FIELD_CHARS
from stageferry.gateway.results import ResultFiles, ResultRefused
from stageferry.gateway.server import MAX_REQUEST_HEAD_BYTES
from stageferry.schemas import OutputInfo, RequestState, RequestStatus
from tests.conftest import delete_prefix
from tests.gateway.conftest import running_gateway

MP4 = b"\x00\x00\x00\x18ftypmp42" + b"x" * 1000


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    return out


def test_only_regular_files_inside_the_output_directory_open(out_dir: Path, tmp_path: Path) -> None:
    files = ResultFiles(out_dir)
    good = out_dir / "sub" / "video.mp4"
    good.parent.mkdir()
    good.write_bytes(MP4)
    opened = files.open(str(good), expected_bytes=len(MP4))
    assert b"".join(opened.chunks()) == MP4

    (out_dir / "passwd.mp4").symlink_to("/etc/passwd")
    (out_dir / "linked").symlink_to(tmp_path)
    (tmp_path / "secret.mp4").write_bytes(MP4)
    os.mkfifo(out_dir / "fifo.mp4")
    refused = {
        "/etc/passwd": "outside",
        str(out_dir / ".." / "secret.mp4"): "not a normal path",
        str(tmp_path / "secret.mp4"): "outside",
        "out/sub/video.mp4": "not an absolute path",
        str(out_dir / "passwd.mp4"): "cannot open",  # a symlink as the last component
        str(out_dir / "linked" / "secret.mp4"): "cannot open",  # a symlink on the way
        str(out_dir / "fifo.mp4"): "not a regular file",
        str(out_dir / "sub"): "not a regular file",
        str(out_dir / "missing.mp4"): "cannot open",
        str(out_dir): "the output directory itself",
    }
    for location, reason in refused.items():
        with pytest.raises(ResultRefused) as info:
            files.open(location)
        assert reason in info.value.reason, (location, info.value.reason)
    with pytest.raises(ResultRefused, match="not the recorded"):
        files.open(str(good), expected_bytes=len(MP4) + 1)


def test_output_directory_is_fixed_at_start(out_dir: Path, tmp_path: Path) -> None:
    """The directory's real path is taken once: a symlink to it works, swapping it later does not widen it."""
    link = tmp_path / "out-link"
    link.symlink_to(out_dir)
    files = ResultFiles(link)
    assert files.root == out_dir.resolve()
    (out_dir / "a.mp4").write_bytes(MP4)
    assert files.open(str(out_dir.resolve() / "a.mp4")).size == len(MP4)
    with pytest.raises(ResultRefused):
        files.open(str(link / "a.mp4"))  # not the resolved form a stage records


@pytest.fixture
def gateway(out_dir: Path, redis_url: str) -> Iterator[tuple[str, str]]:
    """A gateway (no stages: only stored statuses matter here) serving ``out_dir``; (base URL, prefix)."""
    prefix = f"t-res-{uuid.uuid4().hex[:10]}"
    pipeline = PipelineConfig.model_validate({"output_dir": str(out_dir)})
    config = GatewayConfig(redis_url=redis_url, prefix=prefix, pipeline=pipeline, trace_events=False)
    try:
        with running_gateway(config) as base:
            yield base, prefix
    finally:
        delete_prefix(redis_url, prefix)


def forge(redis_url: str, prefix: str, rid: str, location: str, size: int) -> None:
    """Write a finished status naming ``location`` and no Redis key, as a hostile client's HSET could."""

    async def write() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            result = OutputInfo(location=location, redis_key=None, bytes=size)
            await client.store.set_status(RequestStatus(request_id=rid, state=RequestState.DONE, result=result))

    anyio.run(write)


def test_forged_statuses_never_serve_host_files(
    gateway: tuple[str, str], out_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    base, prefix = gateway
    passwd_size = Path("/etc/passwd").stat().st_size
    (out_dir / "escape.mp4").symlink_to("/etc/passwd")
    (tmp_path / "beside.mp4").write_bytes(MP4)
    forge(redis_url, prefix, "forged-passwd", "/etc/passwd", passwd_size)
    forge(redis_url, prefix, "forged-shadow", "/etc/shadow", 0)
    forge(redis_url, prefix, "forged-link", str(out_dir / "escape.mp4"), passwd_size)
    forge(redis_url, prefix, "forged-dotdot", f"{out_dir}/../beside.mp4", len(MP4))
    (out_dir / "real.mp4").write_bytes(MP4)
    forge(redis_url, prefix, "real-1", str(out_dir.resolve() / "real.mp4"), len(MP4))
    with httpx.Client(base_url=base, timeout=30) as http, capture_logs() as logs:
        for rid in ("forged-passwd", "forged-shadow", "forged-link", "forged-dotdot"):
            answer = http.get(f"/v1/videos/{rid}/content")
            assert answer.status_code == 404, (rid, answer.status_code)
            assert answer.json()["error"]["code"] == "not_found"
            assert b"root:" not in answer.content
        served = http.get("/v1/videos/real-1/content")
        assert served.status_code == 200 and served.content == MP4
        assert served.headers["content-type"] == "video/mp4"
    refused = [e for e in logs if e["event"] == "gateway.result_refused"]
    assert {e["request_id"] for e in refused} == {"forged-passwd", "forged-shadow", "forged-link", "forged-dotdot"}


def test_a_forged_status_naming_another_request_never_serves_its_bytes(
    gateway: tuple[str, str], redis_url: str
) -> None:
    """The victim's result is in Redis under its own id; a record under another id whose status names the
    victim (a stage user's HSET) is corrupt: the gateway serves nothing of the victim's through it."""
    base, prefix = gateway
    keys = Keys(prefix)
    secret = b"\x00\x00\x00\x18ftypmp42victim-bytes"
    victim = RequestStatus(
        request_id="victim-2",
        state=RequestState.DONE,
        result=OutputInfo(location="redis:x", redis_key=keys.result("victim-2"), bytes=len(secret)),
    )
    with sync_redis.Redis.from_url(redis_url) as r:
        r.set(keys.result("victim-2"), secret)
        r.hset(keys.request("victim-2"), mapping={"state": "done", "status": victim.model_dump_json()})
        r.hset(keys.request("forged-2"), mapping={"state": "done", "status": victim.model_dump_json()})
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/v1/videos/victim-2/content").content == secret  # the owner still gets it
        for path in ("/v1/videos/forged-2/content", "/v1/videos/forged-2"):
            answer = http.get(path)
            assert answer.status_code == 500 and answer.json()["error"]["code"] == "status_corrupt", answer.text
            assert b"victim-bytes" not in answer.content and b"victim-2" not in answer.content


def test_error_answers_never_echo_client_input_unbounded(gateway: tuple[str, str]) -> None:
    """A 100,000-character id was echoed whole into its 404 (a 100 kB answer); a form key of that size
    into its 400 (twice).  Every error body is bounded, whatever the client sent."""
    base, _prefix = gateway
    long_id = "v" * 60_000  # (httpx sends at most 64 KiB of URL)
    with httpx.Client(base_url=base, timeout=30) as http:
        for path in (f"/v1/videos/{long_id}", f"/v1/videos/{long_id}/content"):
            answer = http.get(path)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
            assert len(answer.content) < 2_000, len(answer.content)
            assert sum(len(k) + len(v) for k, v in answer.headers.items()) < 2_000
        lora = json.dumps({"name": "style-a", "k" * 60_000: 1})  # (a form field holds at most 64 KiB)
        answer = http.post("/v1/videos", files={"prompt": (None, "a cat"), "lora": (None, lora)})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_form", answer.text[:300]
        assert len(answer.content) < 2_000, len(answer.content)
        [error] = answer.json()["error"]["field_errors"]
        assert error["field"].startswith("lora.kkk") and len(error["field"]) <= MAX_FIELD_CHARS


def test_a_long_request_line_in_many_reads_gets_the_gateways_answer(gateway: tuple[str, str]) -> None:
    """The 60,000-character id above got h11's bare 400 instead of the gateway's 404 whenever its request line
    took more than one read (h11's 16 KiB bound on an incomplete head): sent here 1 KiB per segment."""
    host, port = gateway[0].removeprefix("http://").split(":")
    head = f"GET /v1/videos/{'v' * 60_000} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    assert len(head) <= MAX_REQUEST_HEAD_BYTES
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for at in range(0, len(head), 1024):
            sock.sendall(head[at : at + 1024])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 404 Not Found", answer[:300]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "not_found"
