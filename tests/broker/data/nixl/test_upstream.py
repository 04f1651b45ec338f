"""A consumer connects to its producers ahead of their payloads (issue 39: no cold first hop).

Real agents (a producer leader in its own process, ``tests.peer_producer``; the test process is the
consumer leader), CPU DRAM over UCX, real Redis.  The producer is held back (``--hold``) until the test
has seen the consumer connected, so "connected before the first request" is observed, not assumed; the
first payload's get then loads no agent of its own.  After the producer is killed and started again (new
incarnation, new agent name in the stage index) the consumer drops the old peer and connects the new one,
again before its first payload.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis as sync_redis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.data.nixl.peers import Peer
from stageferry.schemas import NixlPayload, Transport
from stageferry.testing import assert_same
from tests.broker.data.nixl.test_connector import consumer, ref_of, start_producer  # noqa: F401 - a fixture
from tests.peer_producer import build
from tests.sentinels import eventually

pytest.importorskip("nixl")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


def index_entry(redis_url: str, prefix: str) -> str | None:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        raw = client.hget(Keys(prefix).agents("encoder"), "encoder-peer")
    finally:
        client.close()
    return raw.decode() if isinstance(raw, bytes) else None


async def connected(conn: Any, name: str) -> Peer | None:
    peers = conn.peers.peers_of("encoder")
    return peers[0] if [p.name for p in peers] == [name] and conn.agent.remotes() == {name} else None


async def first_payload_without_a_handshake(conn: Any, producer: Any, go: str) -> None:
    """Let the held producer put one payload; its get must find the agent loaded (no remote added)."""
    producer.redis.set(f"{producer.prefix}:test:{go}", 1)
    item = producer.take()
    ref, blob = ref_of(item)
    assert isinstance(ref, NixlPayload)
    with structlog.testing.capture_logs() as logs:
        async with conn.get(ref, blob, key=item["key"]) as incoming:
            assert incoming.transport is Transport.NIXL, incoming.fallback_reason
            assert_same(incoming.payload, build(item["spec"], item["seed"]))
    events = [e["event"] for e in logs]
    assert "nixl.remote.added" not in events and "nixl.peer_connected" not in events, events


async def test_the_consumer_is_connected_before_the_first_payload_and_again_after_its_producer_restarts(
    start_producer: Any,  # noqa: F811 - the fixture imported above
    redis_url: str,
    prefix: str,
) -> None:
    first = start_producer("--payloads", "T2VA", "--hold", "go1")
    async with consumer(redis_url, prefix, upstream="encoder") as conn:
        assert conn.upstream is not None
        name = await eventually(
            lambda: _value(index_entry(redis_url, prefix)), timeout=60, what="the producer's index entry"
        )
        assert name is not None
        peer = await eventually(lambda: connected(conn, name), timeout=60, what=f"{name} connected")
        # Nothing was sent yet: the agent was loaded and its arenas READ by the watch, not by a payload.
        assert first.redis.llen(f"{prefix}:test:refs") == 0 and conn.counters.gets == 0
        assert peer is not None
        assert conn.upstream.connects == 1 and peer.stage == "encoder" and peer.arenas
        await first_payload_without_a_handshake(conn, first, "go1")

        first.proc.kill()  # no withdrawal: its record is left to expire, its index entry to be replaced
        first.proc.wait(30)
        second = start_producer("--payloads", "T2VA", "--hold", "go2")
        renamed = await eventually(
            lambda: _value(n if (n := index_entry(redis_url, prefix)) != name else None),
            timeout=60,
            what="the restarted producer's index entry",
        )
        assert renamed is not None
        await eventually(lambda: connected(conn, renamed), timeout=60, what=f"{renamed} connected in place of {name}")
        assert conn.upstream.connects == 2 and name not in conn.peers
        await first_payload_without_a_handshake(conn, second, "go2")
        assert conn.counters.fallbacks == {}
        second.stop()
        assert index_entry(redis_url, prefix) is None, "a producer that stops takes its entry out with its record"


async def test_index_entries_without_a_record_or_of_another_stage_are_not_connected(
    redis_url: str, prefix: str
) -> None:
    """A stale entry (its producer died and its record expired) is tried, logged once and taken out of the
    index (replicas come and go: the index must not keep them all); an entry naming an agent of another
    stage, or a name that is not its replica's, is ignored."""
    client = sync_redis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    client.hset(
        keys.agents("encoder"),
        mapping={
            "encoder-gone": "encoder-gone-0123abcd",  # no record under it
            "encoder-x": "diffusion-x-0123abcd",  # not this replica's name
            "decoder-y": "decoder-y-0123abcd",  # another stage's replica
        },
    )
    client.close()
    with structlog.testing.capture_logs() as logs:
        async with consumer(redis_url, prefix, upstream="encoder") as conn:  # its start-up makes one look
            assert conn.upstream is not None
            for _ in range(3):
                assert await conn.upstream.look() == 0
            assert conn.agent is not None and conn.agent.remotes() == frozenset() and len(conn.peers) == 0
    failed = [e for e in logs if e["event"] == "nixl.preconnect_failed"]
    assert [(e["peer"], e["error"]) for e in failed] == [("encoder-gone-0123abcd", "producer agent is gone")]
    unlisted = [e["peer"] for e in logs if e["event"] == "nixl.peer_unlisted"]
    assert unlisted == ["encoder-gone-0123abcd"]
    client = sync_redis.Redis.from_url(redis_url)
    try:
        left = client.hgetall(keys.agents("encoder"))
        assert left == {b"encoder-x": b"diffusion-x-0123abcd", b"decoder-y": b"decoder-y-0123abcd"}
        client.delete(keys.agents("encoder"))
    finally:
        client.close()
    assert not [e for e in logs if e["event"] == "nixl.remote.added"]


async def _value(value: str | None) -> str | None:
    return value
