"""The shared event reader against real Redis servers: many waits on one connection, a hostile key that
fails only its own waiter, waits that ride through a Redis restart, and waits on ids that do not exist."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis

from stageferry import Client, RequestState, RequestStatus
from stageferry.broker.control import request_waits
from stageferry.broker.control.fanin import FieldReads
from stageferry.broker.control.redis_conn import MAX_CONNECTIONS, open_client
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.errors import ControlPlaneError, RequestLostError, RequestNotFoundError
from stageferry.schemas import OutputInfo
from tests.waits import until

pytestmark = pytest.mark.anyio

JOB = {"task": "t2va", "prompt": "a boat", "width": 320, "height": 192}


@pytest.fixture
async def private_redis() -> AsyncIterator[EmbeddedRedis]:
    """A server of this test's own, so that its connection count is ours alone (AOF: it survives a kill)."""
    async with EmbeddedRedis(appendonly=True, extra_args=("--appendfsync", "always")) as server:
        yield server


async def connected_clients(admin: aioredis.Redis) -> tuple[int, int]:
    """Clients connected to the server (this admin connection excluded), and how many are blocked."""
    listing = await admin.execute_command("CLIENT", "LIST")
    text = listing.decode() if isinstance(listing, bytes) else str(listing)
    lines = [line for line in text.splitlines() if line.strip()]
    blocked = [line for line in lines if " flags=b" in line]
    return len(lines) - 1, len(blocked)


async def finish(client: Client, rid: str) -> None:
    done = RequestStatus(request_id=rid, state=RequestState.DONE, result=OutputInfo(location="redis:x"))
    assert await client.store.set_status(done)


async def test_150_concurrent_waits_hold_one_blocking_connection(private_redis: EmbeddedRedis) -> None:
    n = 150  # above redis-py's old per-waiter limit of 100 pooled connections
    admin = aioredis.Redis.from_url(private_redis.url)
    async with Client(private_redis.url, prefix="fan") as client:
        rids = [await client.submit(JOB, request_id=f"fan-{i}") for i in range(n)]
        results: dict[str, RequestStatus] = {}
        during: list[tuple[int, int]] = []

        async def wait(rid: str) -> None:
            results[rid] = await client.wait(rid, timeout=60)

        async with anyio.create_task_group() as tg:
            for rid in rids:
                tg.start_soon(wait, rid)
            deadline = time.monotonic() + 30
            while client.store.fanin.waiters < n:
                assert time.monotonic() < deadline, f"only {client.store.fanin.waiters} waiters registered"
                await anyio.sleep(0.05)
            rounds = client.store.fanin.rounds
            with anyio.fail_after(30):  # all waiting: sample the server's view over two of their reads
                while client.store.fanin.rounds < rounds + 2:
                    during.append(await connected_clients(admin))
                    await anyio.sleep(0.02)
            assert client.store.fanin.widest_round == n, "one read covers every waiter"
            for rid in rids:
                await finish(client, rid)
        assert {rid: s.state for rid, s in results.items()} == dict.fromkeys(rids, RequestState.DONE)
        assert client.store.fanin.waiters == 0
        after = await connected_clients(admin)
        # The pool's connections, and the submissions' lean link (resp_link: its own socket, opened by the
        # first submit).  150 waits registering at once can fill the pool on a loaded box (CI saw 65).
        bound = MAX_CONNECTIONS + (client._link is not None)
    # One blocked read for 150 waiters; the pool's other connections come and go with short commands.
    assert max(blocked for _, blocked in during) == 1, during
    assert max(total for total, _ in during) <= bound, during
    assert after[0] <= bound and after[1] == 0, after
    await admin.aclose()


async def test_a_key_of_the_wrong_type_fails_only_its_own_waiter(redis_url: str, prefix: str) -> None:
    async with Client(redis_url, prefix=prefix) as client:
        good = await client.submit(JOB, request_id="good-1")
        bad = await client.submit(JOB, request_id="bad-1")
        outcome: dict[str, RequestStatus | Exception] = {}

        async def wait(rid: str) -> None:
            try:
                outcome[rid] = await client.wait(rid, timeout=30)
            except ControlPlaneError as exc:
                outcome[rid] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, good)
            tg.start_soon(wait, bad)
            await until(lambda: client.store.fanin.waiters >= 2, "both waits under way")
            # A hostile client replaces the events stream of "bad-1" with a plain string.
            await client.redis.delete(client.keys.events(bad))
            await client.redis.set(client.keys.events(bad), b"not a stream")
            with anyio.fail_after(30):
                while bad not in outcome:  # the bad waiter has failed; the good one still waits
                    await anyio.sleep(0.02)
            assert good not in outcome
            await finish(client, good)
        good_outcome, bad_outcome = outcome[good], outcome[bad]
        assert isinstance(good_outcome, RequestStatus) and good_outcome.state is RequestState.DONE
        assert isinstance(bad_outcome, ControlPlaneError)
        assert "WRONGTYPE" in bad_outcome.message


async def test_wait_rides_through_a_redis_restart(private_redis: EmbeddedRedis) -> None:
    async with Client(private_redis.url, prefix="restart") as client:
        rid = await client.submit(JOB, request_id="survivor-1")
        outcome: list[RequestStatus] = []

        async def wait() -> None:
            outcome.append(await client.wait(rid, timeout=60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await until(lambda: client.store.fanin.waiters >= 1, "the wait under way")
            await private_redis.kill()
            # Five failed reads, backing off 0.1, 0.2, 0.4, 0.8, 1.6 s (each x 0.5-1): beyond the ~1 s after
            # which waits used to give up, counted by the reader, not by this test's clock.
            await until(lambda: client.store.fanin.failed_rounds >= 5, "five reads failed while Redis is away")
            assert not outcome, "the wait must not end while Redis is away"
            await private_redis.start()
            await finish(client, rid)
        assert outcome[0].state is RequestState.DONE


async def test_unknown_id_ends_at_once_when_it_must_exist(client_fixture: Client) -> None:
    client = client_fixture
    started = time.monotonic()
    with pytest.raises(RequestNotFoundError) as info:
        await client.wait("never-submitted", timeout=60, exists_within=0)
    assert info.value.code == "not_found"
    assert time.monotonic() - started < 2
    started = time.monotonic()
    with pytest.raises(RequestNotFoundError):
        await client.wait("never-submitted", timeout=60, exists_within=1.0)
    assert time.monotonic() - started < 10


async def test_a_request_that_vanishes_while_waited_on_ends_the_wait(
    client_fixture: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = client_fixture
    monkeypatch.setattr(request_waits, "QUIET_CHECK_S", 0.1)  # quiet checks come quickly; counted below
    checks: list[bool] = []
    real_get = client.store.get

    async def get(request_id: str) -> RequestStatus | None:
        status = await real_get(request_id)
        checks.append(True)
        return status

    monkeypatch.setattr(client.store, "get", get)
    rid = await client.submit(JOB, request_id="vanishing-1")
    outcome: list[RequestLostError] = []

    async def wait() -> None:
        try:
            await client.wait(rid, timeout=60)
        except RequestLostError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        # Two quiet checks done: the first, which saw the request exist, has ended.
        await until(lambda: client.store.fanin.waiters >= 1 and len(checks) >= 2, "the waiter to see its request")
        keys = client.keys  # as a restart without data would
        await client.redis.delete(keys.request(rid), keys.events(rid), keys.submitted(rid))
        with anyio.fail_after(15):
            while not outcome:
                await anyio.sleep(0.05)
    assert outcome[0].code == "request_lost"


@pytest.fixture
async def client_fixture(redis_url: str, prefix: str) -> AsyncIterator[Client]:
    async with Client(redis_url, prefix=prefix) as c:
        yield c


async def test_status_reads_asked_at_once_share_round_trips_and_keep_their_own_errors(
    redis_url: str, prefix: str
) -> None:
    async with open_client(redis_url) as redis:
        keys = [f"{prefix}:reads:{i}" for i in range(300)]
        for i, key in enumerate(keys):
            await redis.hset(key, "status", f"s{i}")
        await redis.set(keys[7], b"not a hash")  # a hostile key: only its reader fails
        reads = FieldReads(redis, "status", max_batch=128)
        got: dict[int, bytes | BaseException | None] = {}

        async def read(i: int) -> None:
            try:
                got[i] = await reads.get(keys[i])
            except ControlPlaneError as exc:
                got[i] = exc

        async def cancelled_first() -> None:  # the first asker sends, and is cancelled at once
            with anyio.CancelScope() as scope:
                scope.cancel()
                await reads.get(keys[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancelled_first)
            for i in range(1, len(keys)):
                tg.start_soon(read, i)
        assert isinstance(got.pop(7), ControlPlaneError)
        assert got == {i: f"s{i}".encode() for i in range(1, len(keys)) if i != 7}
        assert reads.sends <= 4 and reads.widest_send == 128  # 299 reads in batches, not 299 round trips
        assert await reads.get(f"{prefix}:reads:none") is None  # alone: a plain HGET


async def test_lost_only_of_what_was_seen_and_not_found_of_what_never_was(
    client_fixture: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: ``request_lost`` is final, so a waiter says it only of a request it knew existed.  Its own
    submission that vanishes before the waiter first looked is lost (it used to wait out the unknown-id
    grace); an id it never saw is not found after the grace (it used to be told lost, and a raw entry
    under that id could still run to done)."""
    monkeypatch.setattr(request_waits, "UNKNOWN_GRACE_S", 1.0)
    client = client_fixture
    with pytest.raises(RequestNotFoundError):
        await client.wait("never-seen-1", timeout=30)
    rid = await client.submit(JOB, request_id="vanishing-2")
    await client.redis.delete(client.keys.submitted(rid))  # wiped before the waiter ever looked
    with pytest.raises(RequestLostError):
        await client.wait(rid, timeout=30)
