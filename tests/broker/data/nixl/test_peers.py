"""Agent records and the handshake between real connectors (real NIXL agent, real Redis).

A consumer loads a producer's agent only from a record of its own protocol version: a record of
another version is refused with :class:`ProtocolMismatchError` before any native call (no remote agent
is added, nothing is claimed or read, no resend is asked of a peer that would not understand it)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import pytest
import redis as sync_redis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.data.payload_codec import plan_payload
from stageferry.errors import ManifestError, ProtocolMismatchError
from stageferry.schemas import NixlPayload, RemoteRegion
from stageferry.schemas.nixl import NIXL_PROTOCOL_VERSION, AgentRecord, lease_seal
from tests.broker.data.nixl.test_connector import consumer, ref_of, start_producer  # noqa: F401 - a fixture
from tests.security.test_codec_fuzz import GOOD_PAYLOAD

pytest.importorskip("nixl")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

AGENT, INCARNATION = "encoder-old-0123abcd", "0123abcd00000000"


def foreign_ref(prefix: str, redis_url: str, protocol: str) -> NixlPayload:
    """A payload reference and the agent record of a producer speaking ``protocol``."""
    manifest = plan_payload(GOOD_PAYLOAD).manifest
    arena = RemoteRegion(mem_kind="DRAM", address=1 << 30, length=1 << 24, device_id=0)
    region = arena.model_copy(update={"length": manifest.regions[0].nbytes})
    key = secrets.token_bytes(32)
    record = AgentRecord(
        name=AGENT,
        stage="encoder",
        incarnation=INCARNATION,
        metadata=b"metadata of an agent from another release",
        arenas=[arena],
        seal_key=key,
        started_at=time.time(),
    ).to_redis()
    record["protocol"] = protocol
    client = sync_redis.Redis.from_url(redis_url)
    client.hset(Keys(prefix).agent(AGENT), mapping=record)  # type: ignore[arg-type]
    client.close()
    token = "r-1_0_0.0123456789ab"
    return NixlPayload(
        manifest=manifest,
        agent=AGENT,
        incarnation=INCARNATION,
        token=token,
        regions=[region],
        lease_expires_at=time.time() + 60,
        seal=lease_seal(key, AGENT, token, [region]),
    )


async def test_a_peer_record_of_another_protocol_version_is_refused_before_any_native_call(
    redis_url: str, prefix: str
) -> None:
    ref = foreign_ref(prefix, redis_url, protocol=str(NIXL_PROTOCOL_VERSION + 1))
    async with consumer(redis_url, prefix) as conn:
        assert conn.agent is not None
        added: list[Any] = []
        real_add = conn.agent.add_remote

        def add_remote(metadata: bytes) -> str:
            added.append(metadata)
            return real_add(metadata)

        conn.agent.add_remote = add_remote  # type: ignore[method-assign]
        with structlog.testing.capture_logs() as logs, pytest.raises(ProtocolMismatchError) as info:
            async with conn.get(ref, None, key="r-1_0_0"):
                pass
        err = info.value
        assert err.code == "protocol_mismatch"
        assert err.details["peer_protocol"] == str(NIXL_PROTOCOL_VERSION + 1)
        assert err.details["protocol"] == NIXL_PROTOCOL_VERSION
        assert added == [] and conn.agent.remotes() == frozenset() and AGENT not in conn.peers
        assert conn.counters.reads == 0 and conn.pools is not None and conn.pools.slots_in_use == 0
        assert next(e for e in logs if e["event"] == "nixl.protocol_mismatch")["agent"] == AGENT
        client = sync_redis.Redis.from_url(redis_url)
        try:
            keys = Keys(prefix)
            assert not client.exists(keys.claim(ref.token)), "nothing was claimed"
            assert not client.exists(keys.resend(AGENT)), "no resend asked of a peer of another protocol"
        finally:
            client.close()


async def test_a_connector_publishes_a_record_of_its_own_version(redis_url: str, prefix: str) -> None:
    async with consumer(redis_url, prefix) as conn:
        client = sync_redis.Redis.from_url(redis_url)
        try:
            raw = client.hgetall(Keys(prefix).agent(conn.name))
        finally:
            client.close()
        record = AgentRecord.from_redis(raw)
        assert record.protocol == NIXL_PROTOCOL_VERSION and raw[b"protocol"] == str(NIXL_PROTOCOL_VERSION).encode()
        assert record.name == conn.name and record.incarnation == conn.incarnation
        assert conn.pools is not None and record.arenas == conn.pools.arenas()


async def test_an_envelope_of_a_forged_incarnation_leaves_the_loaded_peer_as_it_was(
    redis_url: str,
    prefix: str,
    start_producer: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """An envelope names a loaded agent with an incarnation that shares its name's 8 characters but not the
    rest: refused (the record is of another incarnation) before the good peer is dropped, so the READs in
    flight from it go on."""
    producer = start_producer("--payloads", "T2VA")
    item = producer.take()
    ref, blob = ref_of(item)
    async with consumer(redis_url, prefix) as conn:
        async with conn.get(ref, blob, key=item["key"]):
            pass
        assert ref.agent in conn.peers
        forged = ref.model_copy(update={"incarnation": ref.incarnation[:8] + "0" * (len(ref.incarnation) - 8)})
        assert forged.incarnation != ref.incarnation
        with pytest.raises(ManifestError, match="does not match the envelope"):
            await conn.peers.ensure(forged)
        assert ref.agent in conn.peers and conn.agent is not None and ref.agent in conn.agent.remotes()
    producer.stop()
