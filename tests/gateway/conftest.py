"""A real deployment for the gateway tests: reference encoder and (slow-on-request) diffusion stage
processes on the test Redis, and the gateway served by uvicorn on a free port in a background thread.

Both are module-scoped: starting stage processes costs seconds on a small machine, so every test in
``test_gateway.py`` shares one deployment under its own key prefix (deleted at the end).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from stageferry.config import PipelineConfig
from stageferry.embedded_redis import free_port
from stageferry.gateway import GatewayConfig, create_app
from stageferry.gateway.server import HEAD_TIMEOUT_S, uvicorn_config
from tests.conftest import delete_prefix
from tests.procs import Services, write_pipeline

#: Small enough that an oversized upload is cheap to send; the bundled samples fit.
MAX_UPLOAD_BYTES = 256 * 1024
LORA = "style-a"
MAX_STEPS = 150  #: high enough that a job of the real sampler outlives a short sync timeout


@dataclass
class Deployment:
    services: Services
    pipeline: PipelineConfig
    base_url: str
    prefix: str
    redis_url: str


@contextlib.contextmanager
def running_gateway(
    config: GatewayConfig, *, start_timeout: float = 120, head_timeout_s: float = HEAD_TIMEOUT_S
) -> Iterator[str]:
    """The gateway for ``config`` served by uvicorn in a background thread; yields its base URL."""
    port = free_port()
    app = create_app(config)
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, head_timeout_s=head_timeout_s))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


@pytest.fixture(scope="module")
def module_prefix(redis_url: str) -> Iterator[str]:
    name = f"t-gw-{uuid.uuid4().hex[:10]}"
    yield name
    delete_prefix(redis_url, name)


@pytest.fixture(scope="module")
def redis_url() -> str:
    """The test Redis, for module-scoped fixtures (the root conftest's is per test)."""
    return os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, redis_url: str, module_prefix: str) -> Iterator[Deployment]:
    tmp: Path = tmp_path_factory.mktemp("gateway")
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
    with Services(tmp, redis_url=redis_url, prefix=module_prefix, pipeline=path, extra_env={}) as services:
        services.start("encoder", "a")
        services.start("diffusion", "a")
        config = GatewayConfig(redis_url=redis_url, prefix=module_prefix, pipeline=pipeline, model_name="test-model")
        with running_gateway(config) as base_url:
            services.wait_live("encoder", "encoder-a", timeout=180)
            services.wait_live("diffusion", "diffusion-a", timeout=180)
            yield Deployment(services, pipeline, base_url, module_prefix, redis_url)


@pytest.fixture(scope="module")
def http(deployment: Deployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployment.base_url, timeout=120) as client:
        yield client
