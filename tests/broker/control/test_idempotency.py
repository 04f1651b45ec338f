"""broker.control.idempotency: Idempotency-Key records on a real Redis, with typed replies."""

from __future__ import annotations

import anyio
import pytest

from stageferry.broker.control.idempotency import Claim, IdempotencyRecords
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.errors import ControlPlaneError
from stageferry.schemas.idempotency import IdempotencyRecord

pytestmark = pytest.mark.anyio

F1, F2 = "1" * 64, "2" * 64  # fingerprints are sha256 hex digests


async def test_the_first_claim_holds_the_key_and_later_ones_see_it(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        records = IdempotencyRecords(redis, Keys(prefix), ttl_s=60)
        first = IdempotencyRecord(request_id="req-a", fingerprint=F1)
        assert await records.claim("d1", first) == Claim(claimed=True)
        again = await records.claim("d1", IdempotencyRecord(request_id="req-b", fingerprint=F2))
        assert again == Claim(claimed=False, existing=first)
        assert 0 < await redis.ttl(Keys(prefix).idempotency("d1")) <= 60


async def test_racing_claims_make_one_holder(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        records = IdempotencyRecords(redis, Keys(prefix), ttl_s=60)
        claims: list[Claim] = []

        async def claim(i: int) -> None:
            claims.append(await records.claim("race", IdempotencyRecord(request_id=f"r{i}", fingerprint=F1)))

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(claim, i)
    assert sum(c.claimed for c in claims) == 1
    holders = {c.existing.request_id for c in claims if c.existing is not None}
    assert len(holders) == 1


async def test_release_only_forgets_its_own_request(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        records = IdempotencyRecords(redis, Keys(prefix), ttl_s=60)
        await records.claim("d", IdempotencyRecord(request_id="mine", fingerprint=F1))
        assert not await records.release("d", "someone-else")
        assert await redis.exists(Keys(prefix).idempotency("d"))
        assert await records.release("d", "mine")
        assert not await redis.exists(Keys(prefix).idempotency("d"))
        assert await records.claim("d", IdempotencyRecord(request_id="next", fingerprint=F1)) == Claim(claimed=True)


async def test_an_unreadable_record_is_said_so(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        await redis.set(Keys(prefix).idempotency("junk"), b"{not json")
        records = IdempotencyRecords(redis, Keys(prefix), ttl_s=60)
        claim = await records.claim("junk", IdempotencyRecord(request_id="r", fingerprint=F1))
        assert claim == Claim(claimed=False, unreadable=True)
        assert not await records.release("junk", "r")


async def test_redis_away_is_a_control_plane_error(prefix: str) -> None:
    async with open_client("redis://127.0.0.1:1/0") as redis:
        records = IdempotencyRecords(redis, Keys(prefix), ttl_s=60)
        with pytest.raises(ControlPlaneError):
            await records.claim("d", IdempotencyRecord(request_id="r", fingerprint=F1))
