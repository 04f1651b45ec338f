"""The producer's lease table against a real Redis: when slots go back to the pool, and what the claim
key says to a consumer afterwards.  No NIXL needed: the pool is plain memory (no registrar)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.control.resp_link import open_link
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.leases import GONE_SLACK_S, LeaseTable, claim
from stageferry.broker.data.pool import MemoryPool, PoolSet
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.errors import PayloadUnavailableError
from stageferry.schemas import DeviceKind, Manifest, NixlPayload, RegionSpec
from tests.links import record_sends

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

MANIFEST = Manifest(tree={"v": None}, tensors=[], regions=[RegionSpec(device=DeviceKind.CPU, nbytes=1024)])


@pytest.fixture(params=["link", "redis-py"])
async def endpoint(redis_url: str, prefix: str, request: pytest.FixtureRequest) -> AsyncIterator[Endpoint]:
    """An endpoint whose marks go over its lean link (as a connector opens it), or through redis-py."""
    redis = connect(redis_url)
    incarnation = uuid.uuid4().hex[:16]
    pool = MemoryPool(DeviceKind.CPU, 1 << 16, device=torch.device("cpu"), registrar=None)
    ep = Endpoint(
        redis=redis,
        keys=Keys(prefix),
        stage="encoder",
        name=f"encoder-test-{incarnation[:8]}",
        incarnation=incarnation,
        seal_key=b"k" * 32,
        config=DataPlaneConfig(),
        timeouts=Timeouts(lease=60, claim=30),
        inline=InlineConnector(max_bytes=1 << 20, max_payload_bytes=1 << 20, cuda_device=None),
        pools=PoolSet({DeviceKind.CPU: pool}),
        link=open_link(redis) if request.param == "link" else None,
    )
    yield ep
    if ep.link is not None:
        await ep.link.aclose()
    await redis.aclose()


async def held(ep: Endpoint, table: LeaseTable, key: str = "r-1_0_0") -> NixlPayload:
    """A lease on one fresh slot, and the reference a consumer would get for it."""
    assert ep.pools is not None
    slots = await ep.pools.acquire_regions(MANIFEST, timeout=1)
    lease = table.hold(key, MANIFEST, slots)
    return NixlPayload(
        manifest=MANIFEST,
        agent=ep.name,
        incarnation=ep.incarnation,
        token=lease.token,
        regions=[slots[DeviceKind.CPU].remote_region()],
        lease_expires_at=lease.expires_at,
    )


async def claim_key(ep: Endpoint, ref: NixlPayload) -> bytes | None:
    value: bytes | None = await ep.redis.get(ep.keys.claim(ref.token))
    return value


async def test_settling_marks_the_claim_released_then_frees_the_slot(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    await claim(ep, ref)  # the consumer claims, READs; its notification settles the lease
    await table.settle(ref.token, reason="read_done")
    assert ref.token not in table and ep.pools is not None and ep.pools.slots_in_use == 0
    assert await claim_key(ep, ref) == b"released"
    ttl = await ep.redis.pttl(ep.keys.claim(ref.token))
    assert ttl > (ep.timeouts.claim + GONE_SLACK_S) * 1000 - 5000, "outlives every consumer that may retry"
    with pytest.raises(PayloadUnavailableError):  # the envelope delivered again finds it gone
        await claim(ep, ref)


async def test_the_releases_one_drain_finds_take_one_round_trip(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    refs = [await held(ep, table, key=f"r-{i}_0_0") for i in range(3)]
    trips = record_sends(ep.link) if ep.link is not None else []  # count what the link sends
    await table.settle(*(r.token for r in refs), "no-such-token", reason="read_done")
    assert len(table) == 0 and ep.pools is not None and ep.pools.slots_in_use == 0
    assert [await claim_key(ep, r) for r in refs] == [b"released"] * 3
    if ep.link is not None:
        assert trips == [["SET", "SET", "SET"]], "the three marks in one round trip, none for the unknown token"


async def test_an_unclaimed_lease_expires_and_the_payload_is_then_gone(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    await table.scan()
    assert ref.token in table, "not yet expired"
    table.get(ref.token).expires_at = time.time() - 1  # type: ignore[union-attr]  # its lease ran out
    await table.scan()
    assert ref.token not in table and ep.pools is not None and ep.pools.slots_in_use == 0
    assert await claim_key(ep, ref) == b"expired"
    with pytest.raises(PayloadUnavailableError):
        await claim(ep, ref)


async def test_a_claimed_lease_outlives_its_expiry_until_the_claim_expires(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    await claim(ep, ref)
    table.get(ref.token).expires_at = time.time() - 1  # type: ignore[union-attr]
    await table.scan()
    assert ref.token in table, "a READ may be in flight: the slot stays"
    assert await claim_key(ep, ref) == ep.name.encode()
    await ep.redis.delete(ep.keys.claim(ref.token))  # the consumer died; its claim expired
    await table.scan()
    assert ref.token not in table and await claim_key(ep, ref) == b"expired"


async def test_one_scan_marks_each_lease_as_its_own_state_says(endpoint: Endpoint) -> None:
    """A scan's marks go in one round trip, each lease freed by its own reply: a claimed expired lease
    stays (its READ may be in flight), an unclaimed one is marked expired, an abandoned one released, and
    one neither expired nor settled is left alone."""
    ep, table = endpoint, LeaseTable(endpoint)
    claimed, unclaimed, abandoned, fresh = [await held(ep, table, key=f"r-{i}_0_0") for i in range(4)]
    await claim(ep, claimed)
    for ref in (claimed, unclaimed):
        table.get(ref.token).expires_at = time.time() - 1  # type: ignore[union-attr]
    table.abandon(abandoned.token)
    await table.scan()
    assert [ref.token in table for ref in (claimed, unclaimed, abandoned, fresh)] == [True, False, False, True]
    assert [await claim_key(ep, ref) for ref in (claimed, unclaimed, abandoned, fresh)] == [
        ep.name.encode(),
        b"expired",
        b"released",
        None,
    ]
    assert ep.pools is not None and ep.pools.slots_in_use == 2


async def test_an_abandoned_lease_is_freed_by_the_next_scan_and_marked_released(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    table.abandon(ref.token)
    assert ref.token in table
    await table.scan()
    assert ref.token not in table and await claim_key(ep, ref) == b"released"


async def test_without_redis_a_settled_slot_stays_held_until_its_mark_is_written(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    ref = await held(ep, table)
    working, working_link = ep.redis, ep.link
    ep.redis = aioredis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))  # nothing listens there
    ep.link = open_link(ep.redis) if working_link is not None else None
    try:
        await table.settle(ref.token, reason="read_done")
        await table.scan()
    finally:
        await ep.redis.aclose()
        ep.redis, ep.link = working, working_link
    assert ref.token in table and ep.pools is not None and ep.pools.slots_in_use == 1
    await table.scan()
    assert ref.token not in table and ep.pools.slots_in_use == 0 and await claim_key(ep, ref) == b"released"


async def test_shutdown_frees_everything(endpoint: Endpoint) -> None:
    ep, table = endpoint, LeaseTable(endpoint)
    for i in range(3):
        await held(ep, table, key=f"r-{i}_0_0")
    assert len(table) == 3
    table.free_all(reason="shutdown")
    assert len(table) == 0 and ep.pools is not None and ep.pools.slots_in_use == 0
