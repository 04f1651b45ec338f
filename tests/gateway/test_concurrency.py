"""More concurrent sync requests than redis-py's old pool limit (100): every one answered, Redis
connections bounded, ``/health`` green throughout, nothing left blocked afterwards.

A real deployment on a private ``redis-server`` (so that ``CLIENT LIST`` counts only this deployment):
encoder and diffusion stage processes running the payload-only model, and the gateway.
``benchmarks/gateway_concurrency.py`` runs the same at 1,000.
"""

from __future__ import annotations

import collections
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest
import redis.asyncio as aioredis

from stageferry.broker.control.redis_conn import MAX_CONNECTIONS
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.gateway import GatewayConfig
from tests.gateway.conftest import running_gateway
from tests.procs import ROOT, Services, write_pipeline

CONCURRENT = 150
FORM = {"size": "256x144", "seconds": "1", "num_inference_steps": "1"}


@pytest.fixture
def private_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis()
    anyio.run(server.start)
    yield server
    anyio.run(server.stop)


async def clients(admin: aioredis.Redis) -> tuple[int, int]:
    """(connections except this one, connections blocked in XREAD)."""
    text = (await admin.execute_command("CLIENT", "LIST")).decode()
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) - 1, sum(1 for line in lines if " flags=b" in line and " cmd=xread" in line)


def test_150_concurrent_sync_requests_are_all_answered(tmp_path: Path, private_redis: EmbeddedRedis) -> None:
    stages = [
        {"name": name, "model": "stageferry.stages.passthrough:factory", "tp": 1, "device": "cpu"}
        for name in ("encoder", "diffusion")
    ]
    path = write_pipeline(
        tmp_path / "pipeline.toml", stages, data_plane={"connector": "inline", "inline_max_bytes": 1 << 20}
    )
    prefix = "conc"
    with Services(tmp_path, redis_url=private_redis.url, prefix=prefix, pipeline=path, extra_env={}) as services:
        services.start("encoder", "a")
        services.start("diffusion", "a")
        config = GatewayConfig(redis_url=private_redis.url, prefix=prefix, pipeline=PipelineConfig.load(path))
        with running_gateway(config) as base:
            services.wait_live("encoder", "encoder-a", timeout=180)
            services.wait_live("diffusion", "diffusion-a", timeout=180)
            anyio.run(burst, base, private_redis.url)


async def burst(base: str, redis_url: str) -> None:
    admin = aioredis.Redis.from_url(redis_url)
    answers: list[httpx.Response | Exception] = []
    samples: list[tuple[int, int]] = []
    health: list[tuple[int, bool, list[str]]] = []
    limits = httpx.Limits(max_connections=CONCURRENT + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=300) as http:
        warm = await http.post("/v1/videos/sync", data={**FORM, "prompt": "warm-up"})
        assert warm.status_code == 200, warm.text
        with anyio.fail_after(30):  # green before the burst (the monitor reports every second)
            while (await http.get("/health")).status_code != 200:
                await anyio.sleep(0.2)
        done = False

        async def one(i: int) -> None:
            try:
                answers.append(await http.post("/v1/videos/sync", data={**FORM, "prompt": f"n{i}", "seed": str(i)}))
            except httpx.HTTPError as exc:
                answers.append(exc)

        async def watch() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=30) as probe:
                while not done:
                    samples.append(await clients(admin))
                    answer = await probe.get("/health")
                    body = answer.json()
                    health.append((answer.status_code, bool(body["redis"]), body["problems"]))
                    await anyio.sleep(0.3)

        # /health probed from a process of its own too: the probe above shares this loop with the burst, so
        # it times this process as well as the gateway (how /health once "took 17 s").
        probe_cmd = [sys.executable, str(ROOT / "benchmarks" / "health_probe.py"), base, "--every", "0.3"]
        async with await anyio.open_process(probe_cmd, stdout=subprocess.PIPE) as probe:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                async with anyio.create_task_group() as requests:
                    for i in range(CONCURRENT):
                        requests.start_soon(one, i)
                done = True
            probe.terminate()
            assert probe.stdout is not None
            probed = b"".join([chunk async for chunk in probe.stdout]).decode()
    after = await clients(admin)
    await admin.aclose()

    outcomes = collections.Counter(
        a.status_code if isinstance(a, httpx.Response) else type(a).__name__ for a in answers
    )
    assert outcomes == {200: CONCURRENT}, outcomes
    ids = {a.headers["x-request-id"] for a in answers if isinstance(a, httpx.Response)}
    assert len(ids) == CONCURRENT
    assert health and all(code == 200 and redis_ok for code, redis_ok, _ in health), health
    apart = [line.split(" ", 2) for line in probed.splitlines() if line.strip()]
    assert len(apart) >= 2 and all(code == "200" for code, _, _ in apart), probed  # answered while saturated
    print(f"/health from its own process during the burst: max {max(float(t) for _, t, _ in apart):.2f} s")
    # The gateway's pool (MAX_CONNECTIONS), the health connection, two stages, this test: bounded.
    assert max(total for total, _ in samples) <= MAX_CONNECTIONS + 12, samples
    assert max(blocked for _, blocked in samples) <= 1, samples
    assert after[1] == 0, after
