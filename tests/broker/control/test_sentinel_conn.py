"""Behind Sentinel, on real servers (a primary, two replicas, three sentinels): the factory's client and
the lean link follow a failover to the new master; ``READONLY`` is a failover signal, not an error; an
unreachable group leaves as our error with redis-py's kept as the cause."""

from __future__ import annotations

import time

import anyio
import anyio.lowlevel
import pytest
import redis as sync_redis
from redis import exceptions as redis_errors

from stageferry.broker.control.redis_conn import connect, is_connection_error, is_transient_error, translated
from stageferry.broker.control.resp_link import open_link, run_script
from stageferry.chaos.sentinels import SentinelGroup
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.errors import ControlPlaneError
from tests.sentinels import eventually, sentinel_group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
__all__ = ["sentinel_group"]

#: A failover here takes down-after (0.8 s) plus an election; this bounds it with room for a loaded box.
FAILOVER_BOUND_S = 30.0


def on_node(group: SentinelGroup, node: EmbeddedRedis, key: str) -> bytes | None:
    with group.node_client(node) as client:
        value = client.get(key)
    return value if value is None else bytes(value)


async def test_the_factorys_client_follows_a_killed_primary_to_the_new_master(sentinel_group: SentinelGroup) -> None:
    group = sentinel_group
    redis = connect(group.url())
    try:
        await redis.set("k", b"before")
        assert await redis.execute_command("WAIT", 1, 2000) >= 1
        old = await group.kill_primary()
        killed = time.monotonic()

        async def write() -> bool:
            with translated():
                return bool(await redis.set("k", b"after"))

        await eventually(write, timeout=FAILOVER_BOUND_S, what="a write after the kill")
        took = time.monotonic() - killed
        new = group.primary()
        assert new.port != old.port and on_node(group, new, "k") == b"after"
        assert took < FAILOVER_BOUND_S
    finally:
        await redis.aclose()


async def test_the_lean_link_follows_a_sentinel_failover_and_redis_py_carries_the_gap(
    sentinel_group: SentinelGroup,
) -> None:
    group = sentinel_group
    redis = connect(group.url())
    link = open_link(redis)
    assert link is not None  # a Sentinel-managed client is one the link can follow
    script = redis.register_script("return redis.call('INCR', KEYS[1])")
    try:
        assert await link.call("SET", "k", b"1") == b"OK"
        old = group.failover()

        async def incr_over_the_link() -> int:
            with translated():
                return int(await run_script(link, script, ["n"], []))

        await eventually(incr_over_the_link, timeout=FAILOVER_BOUND_S, what="a script run after the failover")
        new = await group.wait_new_master(old, timeout=FAILOVER_BOUND_S)

        async def link_on_new_master() -> bool:  # the link itself (not redis-py) reaches the new master
            return bool(await link.call("SET", "via-link", b"yes") == b"OK")

        await eventually(link_on_new_master, timeout=FAILOVER_BOUND_S, what="the link on the new master")
        assert on_node(group, new, "via-link") == b"yes"
        assert int(on_node(group, new, "n") or 0) >= 1
    finally:
        await link.aclose()
        await redis.aclose()


async def test_readonly_from_a_demoted_master_closes_the_link_and_is_transient(tmp_path: object) -> None:
    """Two plain servers; the link's master is made a replica under it (as a failover does): the next write
    is refused ``READONLY``, which the link reports as a broken connection (redis-py repeats the call) and
    the boundary counts as transient (waited out), never as a request's failure."""
    async with EmbeddedRedis() as a, EmbeddedRedis() as b:
        redis = connect(a.url)
        link = open_link(redis)
        assert link is not None
        try:
            assert await link.call("SET", "k", b"1") == b"OK"
            with sync_redis.Redis(port=a.port) as admin:
                admin.replicaof("127.0.0.1", b.port)
            with pytest.raises(redis_errors.ConnectionError, match="READONLY"):
                await link.call("SET", "k", b"2")
            with pytest.raises(redis_errors.ConnectionError, match="READONLY"):
                await link.send([("MULTI",), ("SET", "k", b"3"), ("EXEC",)])
            with pytest.raises(ControlPlaneError) as caught, translated():
                await redis.set("k", b"4")  # a plain URL: redis-py's ReadOnlyError, translated
            assert isinstance(caught.value.__cause__, redis_errors.ReadOnlyError)
            assert is_transient_error(caught.value) and not is_connection_error(caught.value)
        finally:
            await link.aclose()
            await redis.aclose()


async def test_an_unreachable_sentinel_group_is_our_error_with_redis_pys_as_the_cause() -> None:
    redis = connect("redis+sentinel://127.0.0.1:1,127.0.0.1:2/stageferry", retries=0)
    try:
        with pytest.raises(ControlPlaneError) as caught, translated():
            await redis.ping()
        assert isinstance(caught.value.__cause__, redis_errors.ConnectionError)  # MasterNotFoundError
        assert is_connection_error(caught.value)
    finally:
        await redis.aclose()


async def test_closing_a_sentinel_client_closes_its_connections_to_the_sentinels(
    sentinel_group: SentinelGroup,
) -> None:
    redis = connect(sentinel_group.url())
    await redis.ping()
    manager = redis.connection_pool.sentinel_manager  # type: ignore[attr-defined]

    def connected() -> int:
        return sum(c.is_connected for s in manager.sentinels for c in s.connection_pool._available_connections)

    assert connected() >= 1
    await redis.aclose()
    await anyio.lowlevel.checkpoint()
    assert connected() == 0


async def test_noreplicas_behind_sentinel_sends_the_client_back_to_the_sentinels(sentinel_group: SentinelGroup) -> None:
    """A master refusing writes for want of good replicas may be one the sentinels have deposed (cut off,
    then back, not yet demoted): the connection is dropped and the sentinels asked again, on the client
    and on the link alike — a transient connection failure, retried — and writes resume once replicas do."""
    group = sentinel_group
    primary = group.primary()
    redis = connect(group.url(), retries=1)
    link = open_link(redis)
    assert link is not None
    assert await link.call("SET", "k", b"1") == b"OK"
    with group.replicas_frozen():

        async def refused() -> bool:
            with group.node_client(primary) as direct:
                try:
                    direct.set("probe", b"1")
                except sync_redis.ResponseError as exc:
                    return "NOREPLICAS" in str(exc)
            return False

        await eventually(refused, timeout=30, what="the master refusing writes (min-replicas-max-lag)")
        with pytest.raises(redis_errors.ConnectionError, match="not the master"):
            await link.call("SET", "k", b"2")
        with pytest.raises(ControlPlaneError) as caught, translated():
            await redis.set("k", b"3")
        assert isinstance(caught.value.__cause__, redis_errors.ConnectionError)
        assert "asking the sentinels" in str(caught.value) and is_connection_error(caught.value)

    async def writes_again() -> bool:
        with translated():
            return bool(await redis.set("k", b"4")) and await link.call("SET", "k", b"5") == b"OK"

    try:
        await eventually(writes_again, timeout=30, what="writes once the replicas are back")
    finally:
        await link.aclose()
        await redis.aclose()
