"""A real deployment for the console tests: the gateway tests' two stages (reference encoder, slow-on-request
diffusion), each with its Prometheus endpoint on, and a gateway with a bearer token, a small bound on
event streams, and the stages' metrics URLs (plus one that answers nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from stageferry.config import PipelineConfig
from stageferry.embedded_redis import free_port
from stageferry.gateway import GatewayConfig
from tests.gateway.conftest import LORA, MAX_STEPS, MAX_UPLOAD_BYTES, running_gateway
from tests.procs import Services, write_pipeline

TOKEN = "console-test-token-0123456789"
EVENT_STREAMS = 2


@dataclass
class ConsoleDeployment:
    services: Services
    pipeline: PipelineConfig
    base_url: str
    prefix: str
    metrics_urls: tuple[str, ...]
    dead_metrics_url: str

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}


@contextmanager
def console_deployment(tmp: Path, *, redis_url: str, prefix: str) -> Iterator[ConsoleDeployment]:
    path = write_pipeline(
        tmp / "pipeline.toml",
        [
            {"name": "encoder", "model": "stageferry.stages.reference.encoder:factory", "tp": 1},
            {"name": "diffusion", "model": "tests.gateway.models:diffusion", "tp": 1},
        ],
        limits={"max_steps": MAX_STEPS, "lora_adapters": [LORA], "max_upload_bytes": MAX_UPLOAD_BYTES},
        timeouts={"claim_renew_every": 0.5},
    )
    path.write_text(f'output_dir = "{tmp / "out"}"\n' + path.read_text())
    pipeline = PipelineConfig.load(path)
    with Services(tmp, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as services:
        urls = []
        for stage in ("encoder", "diffusion"):
            port = free_port()
            services.extra_env["STAGEFERRY_METRICS_PORT"] = str(port)
            services.start(stage, "a")
            urls.append(f"http://127.0.0.1:{port}/metrics")
        dead = f"http://127.0.0.1:{free_port()}/metrics"
        config = GatewayConfig(
            redis_url=redis_url,
            prefix=prefix,
            pipeline=pipeline,
            model_name="test-model",
            api_token=TOKEN,
            event_streams=EVENT_STREAMS,
            metrics_urls=(*urls, dead),
        )
        with running_gateway(config) as base_url:
            services.wait_live("encoder", "encoder-a", timeout=180)
            services.wait_live("diffusion", "diffusion-a", timeout=180)
            yield ConsoleDeployment(services, pipeline, base_url, prefix, tuple(urls), dead)
