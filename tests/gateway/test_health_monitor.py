"""The gateway's background health check on a private Redis that stalls (``DEBUG SLEEP``) and dies: a
moment's stall keeps the last healthy report, a lasting one shows, a refused connection shows at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis

from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.gateway.health import HealthMonitor, health_connection

pytestmark = pytest.mark.anyio


@pytest.fixture
async def server() -> AsyncIterator[EmbeddedRedis]:
    async with EmbeddedRedis(extra_args=("--enable-debug-command", "local")) as redis_server:
        yield redis_server


async def test_stalls_and_deaths(server: EmbeddedRedis) -> None:
    pipeline = PipelineConfig.model_validate({"stages": [{"name": "encoder"}]})
    admin = aioredis.Redis.from_url(server.url)
    async with Client(server.url, prefix="hm", pipeline=pipeline) as client:
        await admin.hset(client.keys.workers("encoder"), "encoder-a", str(time.time()))
        monitor = HealthMonitor(client, health_connection(server.url), slow_grace_s=4.0)
        assert (await monitor.check()).status == "ok"

        async def stall(seconds: float) -> None:
            staller = aioredis.Redis.from_url(server.url, socket_timeout=30)
            await staller.execute_command("DEBUG", "SLEEP", seconds)
            await staller.aclose()

        async with anyio.create_task_group() as tg:  # a 2.5 s stall: one check times out
            tg.start_soon(stall, 2.5)
            await anyio.sleep(0.2)
            kept = await monitor.check()
        assert kept.status == "ok" and monitor.report().status == "ok"
        assert (await monitor.check()).status == "ok"

        async with anyio.create_task_group() as tg:  # a 7 s stall: checks time out past the grace
            tg.start_soon(stall, 7)
            await anyio.sleep(0.2)
            reports = [await monitor.check() for _ in range(3)]
        assert reports[0].status == "ok", "the first timeout is within the grace"
        assert reports[-1].status == "unhealthy" and any("no answer within" in p for p in reports[-1].problems)

        await admin.hset(client.keys.workers("encoder"), "encoder-a", str(time.time()))
        assert (await monitor.check()).status == "ok"
        await server.kill()
        down = await monitor.check()
        assert down.status == "unhealthy" and not down.redis, "a refused connection shows at once"
        assert monitor.report() is down
    await admin.aclose()
