"""Behind Sentinel over TLS, on real servers (a primary, two replicas, three sentinels, every one on a TLS
port only, with a throwaway CA): a Client on the ``redis+sentinel://...?ssl=true&ssl_ca_certs=...`` URL
submits, WAITed on both replicas; after a ``SENTINEL FAILOVER`` the same client (redis-py's pool and the
lean link alike) follows the new master, over TLS; and a plain connection to any port of the group is
refused, so TLS is what carried it all."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_url import parse_url
from stageferry.broker.control.resp_link import RespLink
from stageferry.chaos.sentinels import SentinelGroup, sync_client
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis, TlsFiles
from tests.links import record_sends
from tests.security.servers import make_test_ca
from tests.sentinels import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PIPELINE = PipelineConfig.model_validate(
    {"stages": [{"name": "encoder", "model": "m:f"}, {"name": "diffusion", "model": "m:f"}]}
)
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}
FAILOVER_BOUND_S = 30.0


def holders(group: SentinelGroup, key: str) -> dict[int, int]:
    """Which data nodes (by port) hold ``key`` (1) or not (0), asked over TLS."""
    out = {}
    for node in group.nodes:
        with group.node_client(node) as client:
            out[node.port] = int(client.exists(key))
    return out


def refuses_plain(port: int) -> bool:
    """True when a plain (non-TLS) client on ``port`` gets no answer (the server wants a TLS handshake)."""
    with sync_redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2, retry=None) as plain:
        try:
            plain.ping()
        except (sync_redis.ConnectionError, sync_redis.TimeoutError):
            return True
    return False


async def test_a_client_on_tls_sentinels_submits_and_follows_a_failover(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir()
    tls = TlsFiles(*make_test_ca(tmp_path / "ca"))
    keys = Keys("tls")
    async with SentinelGroup(tmp_path / "ha", tls=tls) as group:
        url = group.url(query="wait_replicas=2")
        target = parse_url(url).sentinel
        assert target is not None and target.ssl and target.options["ssl_ca_certs"] == str(tls.ca)
        for process in (*group.nodes, *group.sentinels):  # TLS only: a plain client gets nowhere
            assert refuses_plain(process.port), process.port
        primary = group.primary()

        async with Client(url, prefix="tls", pipeline=PIPELINE) as client:
            link = client._link
            assert isinstance(link, RespLink)  # the lean link follows a TLS Sentinel client (no step-aside)
            trips = record_sends(link)
            first = await client.submit(JOB)
            assert holders(group, keys.submitted(first)) == {n.port: 1 for n in group.nodes}  # WAIT 2 answered
            assert any("WAIT" in trip for trip in trips)
            assert link._wire is not None and link._wire.transport is not None
            assert link._wire.transport.get_extra_info("ssl_object") is not None  # the link's socket is TLS

            old = group.failover()
            new = await group.wait_new_master(old, timeout=FAILOVER_BOUND_S)
            assert new.port != primary.port

            second = await client.submit(JOB)  # rides the failover: the sentinels name the new master
            with group.node_client(new) as admin:
                assert admin.exists(keys.submitted(second)) == 1

            async def link_on_new_master() -> bool:  # the link itself, not redis-py, reached the new master
                return bool(await link.call("SET", "via-link", b"yes") == b"OK")

            await eventually(link_on_new_master, timeout=FAILOVER_BOUND_S, what="the link on the new master")
            with group.node_client(new) as admin:
                assert admin.get("via-link") == b"yes"

        with sync_client(url) as bookkeeping:  # the soak's synchronous client over TLS sentinels too
            assert bookkeeping.exists(keys.submitted(first), keys.submitted(second)) == 2
        await group.wait_settled(timeout=FAILOVER_BOUND_S)


async def test_a_tls_embedded_redis_answers_on_tls_only(tmp_path: Path) -> None:
    tls = TlsFiles(*make_test_ca(tmp_path))
    async with EmbeddedRedis(tls=tls) as server:
        assert server.url.startswith("rediss://")
        with sync_redis.Redis.from_url(server.url) as client:
            assert client.ping()
        assert refuses_plain(server.port)
