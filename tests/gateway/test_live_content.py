"""``GET /v1/videos/{id}/content`` while the video is being written: the streamed reference pipeline (encoder
→ diffusion streaming latent chunks → decode writing a fragmented MP4) on the test Redis, the gateway on
uvicorn, an httpx client.  The decode stage is held before its last chunk (tests/gateway/models.py) until
the test has seen the MP4's first fragments arrive, so the request is surely still running then; the body
ends when the request does, and is the finished file byte for byte."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import pytest

from tests.gateway.streamed_deployment import FORM, FRAMES, streamed_deployment
from tests.procs import wait_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    redis_url = os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    with streamed_deployment(tmp_path_factory.mktemp("live"), redis_url=redis_url) as dep:
        yield dep.base_url, dep.out


def test_a_running_video_downloads_as_it_is_written(live: tuple[str, Path]) -> None:
    base_url, out = live
    with httpx.Client(base_url=base_url, timeout=120) as http:
        created = http.post("/v1/videos", data=FORM)
        assert created.status_code == 200, created.text
        vid = created.json()["id"]
        wait_for(lambda: (out / f"{vid}.mp4.part").exists() or None, 180, "the decode stage to start writing")
        with http.stream("GET", f"/v1/videos/{vid}/content") as body:
            assert body.status_code == 200 and body.headers["x-live"] == "1", body.read()
            assert "content-length" not in body.headers and body.headers["content-type"] == "video/mp4"
            got, pieces = b"", body.iter_bytes()
            while got.count(b"moof") < 2:  # the header and two fragments, written before the last chunk
                got += next(pieces)
            status = http.get(f"/v1/videos/{vid}").json()["status"]
            assert status == "in_progress", status  # the decode stage is held: the video is not whole yet
            (out / f"{vid}.go").touch()
            for piece in pieces:
                got += piece
        finished = http.get(f"/v1/videos/{vid}")
        assert finished.json()["status"] == "completed", finished.text
        whole = http.get(f"/v1/videos/{vid}/content")
        assert whole.status_code == 200 and "x-live" not in whole.headers
        assert got == whole.content, "the live body is the finished MP4"
        with av.open(io.BytesIO(got), mode="r") as container:
            frames = sum(1 for _ in container.decode(video=0))
        assert frames == FRAMES and not (out / f"{vid}.mp4.part").exists()
