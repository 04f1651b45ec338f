"""``GET /v1/videos/{id}/content`` while the video is being written: the streamed reference pipeline (encoder
→ diffusion streaming latent chunks → decode writing a fragmented MP4) on the test Redis, the gateway on
uvicorn, an httpx client.  The decode stage is held before its last chunk (tests/gateway/models.py) until
the test has seen the MP4's first fragments arrive, so the request is surely still running then; the body
ends when the request does, and is the finished file byte for byte."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import av
import httpx
import pytest

from stageferry.config import PipelineConfig
from stageferry.gateway import GatewayConfig
from tests.conftest import delete_prefix
from tests.gateway.conftest import running_gateway
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(300)
EXTRA = json.dumps({"task": "t2va", "duration": 2.0})
FORM = {"prompt": "a red fox runs", "width": "128", "height": "64", "fps": "8", "num_inference_steps": "2",
        "seed": "5", "extra_params": EXTRA}  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    import os

    redis_url = os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"t-live-{uuid.uuid4().hex[:10]}"
    tmp = tmp_path_factory.mktemp("live")
    out = tmp / "out"
    path = write_pipeline(
        tmp / "pipeline.toml",
        [
            {"name": "encoder", "model": "stageferry.stages.reference.encoder:factory", "tp": 1, "device": "cpu"},
            {
                "name": "diffusion",
                "model": "stageferry.stages.reference.diffusion:factory",
                "tp": 1,
                "device": "cpu",
                "options": {"stream_latent_frames": 1},
            },
            {"name": "decode", "model": "tests.gateway.models:held_decode", "tp": 1, "device": "cpu"},
        ],
        streaming={"chunk_timeout_s": 200.0},
    )
    path.write_text(f'output_dir = "{out}"\n' + path.read_text())
    pipeline = PipelineConfig.load(path)
    try:
        with Services(tmp, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as services:
            for stage in ("encoder", "diffusion", "decode"):
                services.start(stage, "a")
            config = GatewayConfig(redis_url=redis_url, prefix=prefix, pipeline=pipeline, model_name="test-model")
            with running_gateway(config) as base_url:
                for stage in ("encoder", "diffusion", "decode"):
                    services.wait_live(stage, f"{stage}-a", timeout=180)
                yield base_url, out
    finally:
        delete_prefix(redis_url, prefix)


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
        with av.open(io.BytesIO(got)) as container:
            frames = sum(1 for _ in container.decode(video=0))
        assert frames == 16 and not (out / f"{vid}.mp4.part").exists()
