"""A real streamed deployment for the live-content tests: the streamed reference pipeline (encoder →
diffusion streaming its latents a latent frame per chunk → a decode stage held before its last chunk,
tests/gateway/models.py) on the test Redis, and a gateway on uvicorn (with a bearer token when given).
The decode stage writes ``<out>/<id>.mp4.part`` as it goes and waits for ``<out>/<id>.go`` before its last
chunk, so a test sees the video's first fragments while the request is surely running."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stageferry.config import PipelineConfig
from stageferry.gateway import GatewayConfig
from tests.conftest import delete_prefix
from tests.gateway.conftest import running_gateway
from tests.procs import Services, write_pipeline

EXTRA = json.dumps({"task": "t2va", "duration": 2.0})
#: A small job: 16 frames of 128×64 at 8 fps, in 5 latent chunks (frame 0 alone, then 4 frames each).
FORM = {"prompt": "a red fox runs", "width": "128", "height": "64", "fps": "8", "num_inference_steps": "2",
        "seed": "5", "extra_params": EXTRA}  # fmt: skip
FRAMES = 16
STAGES = ("encoder", "diffusion", "decode")


@dataclass
class StreamedDeployment:
    base_url: str
    out: Path

    def release(self, video_id: str) -> None:
        """Let the held decode stage take its last chunk."""
        (self.out / f"{video_id}.go").touch()


@contextmanager
def streamed_deployment(tmp: Path, *, redis_url: str, api_token: str | None = None) -> Iterator[StreamedDeployment]:
    prefix = f"t-live-{uuid.uuid4().hex[:10]}"
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
            for stage in STAGES:
                services.start(stage, "a")
            config = GatewayConfig(
                redis_url=redis_url, prefix=prefix, pipeline=pipeline, model_name="test-model", api_token=api_token
            )
            with running_gateway(config) as base_url:
                for stage in STAGES:
                    services.wait_live(stage, f"{stage}-a", timeout=180)
                yield StreamedDeployment(base_url, out)
    finally:
        delete_prefix(redis_url, prefix)
