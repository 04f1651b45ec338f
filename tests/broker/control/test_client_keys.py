"""The sweep of client-written keys against a real Redis: what a hostile client ``SET`` without a TTL or
over its bound is given a TTL or deleted; what stageferry's own clients write is left as it is."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from stageferry.broker.control.client_keys import (
    FLAG_MAX_BYTES,
    ClientKeySweeper,
    Upload,
    client_key_bounds,
    read_upload,
)
from stageferry.broker.control.keys import Keys

pytestmark = pytest.mark.anyio


async def test_oversized_and_ageless_client_keys_are_bounded(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        await redis.set(keys.cancel("huge"), b"x" * (256 * 1024))  # a 256 KiB cancel flag, no TTL
        await redis.set(keys.submitted("ageless"), b"encoder")  # a marker without a TTL
        await redis.set(keys.submitted("long"), b"encoder", ex=10**7)  # one far past the request TTL
        await redis.set(keys.upload("big", "first_frame"), b"y" * 5000)  # above this deployment's 4 KiB
        await redis.set(keys.upload("fine", "first_frame"), b"z" * 100, ex=60)  # as Client.submit writes
        await redis.set(keys.cancel("fine"), b"1", ex=600)
        await redis.lpush(keys.cancel("a-list"), b"1")  # not a string: nobody of ours wrote it
        bounds = client_key_bounds(keys, request_ttl_s=600, max_upload_bytes=4096)
        swept = await ClientKeySweeper(redis, bounds, count=100).sweep()  # steps: the cursor carries on
        assert (swept.scanned, swept.expired, swept.deleted) == (7, 2, 3)
        assert not await redis.exists(keys.cancel("huge"), keys.upload("big", "first_frame"), keys.cancel("a-list"))
        assert 0 < await redis.ttl(keys.submitted("ageless")) <= 600
        assert 0 < await redis.ttl(keys.submitted("long")) <= 600
        assert await redis.get(keys.upload("fine", "first_frame")) == b"z" * 100
        assert 0 < await redis.ttl(keys.upload("fine", "first_frame")) <= 60  # a shorter TTL is kept
        assert await redis.get(keys.cancel("fine")) == b"1" and FLAG_MAX_BYTES >= 1
        again = await ClientKeySweeper(redis, bounds).sweep()
        assert (again.expired, again.deleted) == (0, 0)  # all within bounds now
    finally:
        await redis.aclose()


async def test_one_replica_at_a_time_takes_the_sweep(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        bounds = client_key_bounds(keys, request_ttl_s=600, max_upload_bytes=4096)
        a, b = (ClientKeySweeper(redis, bounds, turn=keys.client_sweep(), holder=h) for h in ("enc-a", "enc-b"))
        assert await a.my_turn(30.0) and not await b.my_turn(30.0)  # a sweeps; b skips this round
        assert await redis.get(keys.client_sweep()) == b"enc-a"
        assert 29_000 < await redis.pttl(keys.client_sweep()) <= 30_000  # held for the sweep interval
        await redis.delete(keys.client_sweep())  # as when the turn expires
        assert await b.my_turn(30.0)
        assert await ClientKeySweeper(redis, bounds).my_turn(30.0), "without a turn key it always sweeps"
    finally:
        await redis.aclose()


async def test_an_upload_is_read_bounded_in_one_command(redis_url: str, prefix: str) -> None:
    """The stage reads at most one byte past its bound, in one ``GETRANGE``: a value a client wrote larger
    — also between a length check and a read, as it could when those were two commands — is known as
    too large without being read whole."""
    keys = Keys(prefix)
    redis = aioredis.Redis.from_url(redis_url)
    try:
        fits, big = keys.upload("r", "first_frame"), keys.upload("r", "reference_video")
        await redis.set(fits, b"a" * 1024, ex=60)
        await redis.set(big, b"b" * (4 << 20), ex=60)
        sent: list[tuple[object, ...]] = []
        real = redis.execute_command

        async def command(*args: object, **kwargs: object) -> object:
            sent.append(args)
            return await real(*args, **kwargs)

        redis.execute_command = command  # type: ignore[method-assign]
        assert await read_upload(redis, fits, 1024) == Upload(1024, b"a" * 1024)
        assert [a[0] for a in sent] == ["GETRANGE"], sent
        assert await read_upload(redis, big, 1024) == Upload(4 << 20, None)
        assert sent[1] == ("GETRANGE", big, 0, 1024), "one byte past the bound, no more"
        assert await read_upload(redis, keys.upload("r", "missing"), 1024) == Upload(0, b"")
    finally:
        await redis.aclose()
