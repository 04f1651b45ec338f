"""Leases behind Sentinel (real servers): a consumer's claim and a producer's release mark count only once a
replica has them, because a failover that lost either would let a consumer READ a slot its producer had
freed and refilled (the failover soak saw exactly that: another request's bytes).  With the replicas
frozen the claim is refused (the payload is recomputed) and the mark leaves the slot held; thawed, both
go through."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.control.resp_link import open_link
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import LeaseTable, claim
from stageferry.broker.data.pool import MemoryPool, PoolSet
from stageferry.chaos.sentinels import SentinelGroup
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.errors import PayloadUnavailableError
from stageferry.schemas import DeviceKind
from tests.broker.data.nixl.test_leases import held
from tests.sentinels import sentinel_group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
__all__ = ["sentinel_group"]


@pytest.fixture
async def endpoint(sentinel_group: SentinelGroup) -> AsyncIterator[Endpoint]:
    redis = connect(sentinel_group.url(query="wait_timeout_ms=300"))
    incarnation = uuid.uuid4().hex[:16]
    pool = MemoryPool(DeviceKind.CPU, 1 << 16, device=torch.device("cpu"), registrar=None)
    ep = Endpoint(
        redis=redis, keys=Keys("t-lease-ha"), stage="encoder", name=f"encoder-{incarnation[:8]}",
        incarnation=incarnation, seal_key=b"k" * 32, config=DataPlaneConfig(), timeouts=Timeouts(lease=60, claim=30),
        inline=InlineConnector(max_bytes=1 << 20, max_payload_bytes=1 << 20, cuda_device=None),
        pools=PoolSet({DeviceKind.CPU: pool}), link=open_link(redis),
    )  # fmt: skip
    yield ep
    if ep.link is not None:
        await ep.link.aclose()
    await redis.aclose()


async def test_a_claim_no_replica_has_is_refused_and_one_on_a_replica_holds(
    endpoint: Endpoint, sentinel_group: SentinelGroup
) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    first, second = await held(ep, table, "r-1_0_0"), await held(ep, table, "r-2_0_0")
    with sentinel_group.replicas_frozen(), pytest.raises(PayloadUnavailableError):
        await claim(ep, first)  # set on the master only: it could vanish with it
    await claim(ep, second)
    assert await ep.redis.get(ep.keys.claim(second.token)) == ep.name.encode()


async def test_a_release_mark_no_replica_has_keeps_the_slot_held(
    endpoint: Endpoint, sentinel_group: SentinelGroup
) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    with sentinel_group.replicas_frozen():
        await table.settle(ref.token, reason="released")
        assert ref.token in table  # not freed: its mark might be lost with the master
    await table.settle(ref.token, reason="released")
    assert ref.token not in table
    assert await ep.redis.get(ep.keys.claim(ref.token)) == b"released"
