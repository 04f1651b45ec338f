"""The hot path's lean Redis link, on real servers: replies matched under concurrency, redis-py's error
types, a cancelled wait that leaves nothing queued behind it, a killed connection healed by the next call
(and by redis-py's retries in :func:`run_script`), a reply that never comes, and the client's credentials,
database and TLS followed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import selectors
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.credentials import UsernamePasswordCredentialProvider
from structlog.testing import capture_logs

from stageferry.broker.control import resp_link
from stageferry.broker.control.redis_conn import connect, open_client
from stageferry.broker.control.resp_link import RespLink, open_link, run_script, run_transaction
from stageferry.embedded_redis import EmbeddedRedis, free_port
from tests.security.servers import PrivateRedis, make_test_ca

pytestmark = pytest.mark.anyio


@dataclass
class Linked:
    redis: aioredis.Redis
    link: RespLink


@pytest.fixture
async def linked(redis_url: str) -> AsyncIterator[Linked]:
    """A client of the test Redis and a link that follows it (closed afterwards)."""
    async with open_client(redis_url) as redis:
        link = link_of(redis)
        yield Linked(redis, link)
        await link.aclose()


def link_of(redis: object) -> RespLink:
    link = open_link(redis)  # type: ignore[arg-type]
    assert link is not None
    return link


async def test_many_tasks_pipeline_on_one_link_and_each_gets_its_own_reply(linked: Linked, prefix: str) -> None:
    redis, link = linked.redis, linked.link
    got: dict[int, object] = {}

    async def one(i: int) -> None:
        replies = await link.send([("SET", f"{prefix}:k{i}", i), ("GET", f"{prefix}:k{i}"), ("INCR", f"{prefix}:n")])
        got[i] = replies[1]

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert got == {i: str(i).encode() for i in range(200)}
    assert await redis.get(f"{prefix}:n") == b"200"


async def test_error_replies_are_redis_py_s_types_as_values_or_raised(linked: Linked, prefix: str) -> None:
    redis, link = linked.redis, linked.link
    await redis.set(f"{prefix}:s", "x")
    ok, wrong = await link.send([("GET", f"{prefix}:s"), ("LPUSH", f"{prefix}:s", "y")])
    assert ok == b"x" and isinstance(wrong, redis_errors.ResponseError) and "WRONGTYPE" in str(wrong)
    with pytest.raises(redis_errors.NoScriptError):
        await link.call("EVALSHA", "0" * 40, 0)
    assert await link.call("PING") == b"PONG", "an error reply leaves the connection in step"
    with pytest.raises(TypeError):
        await link.call("SET", f"{prefix}:none", None)  # refused before anything is written
    assert await link.call("PING") == b"PONG"


async def test_run_script_loads_an_unknown_script_through_redis_py(linked: Linked, prefix: str) -> None:
    redis, link = linked.redis, linked.link
    script = redis.register_script(f"return '{uuid.uuid4().hex}' .. ARGV[1]")  # never loaded before
    assert (await run_script(link, script, [f"{prefix}:k"], ["!"])).endswith(b"!")
    assert link.fallbacks == 1, "NOSCRIPT: redis-py's call loaded it"
    assert (await run_script(link, script, [f"{prefix}:k"], ["?"])).endswith(b"?")
    assert link.fallbacks == 1, "then it runs over the link"


async def test_a_cancelled_wait_closes_the_link_and_what_was_queued_behind_it_never_runs(
    linked: Linked, prefix: str
) -> None:
    redis, link = linked.redis, linked.link
    wake, marker = f"{prefix}:wake", f"{prefix}:marker"
    with anyio.move_on_after(0.2):
        await link.send([("BLPOP", wake, 5), ("SET", marker, "ran")], block_s=5)
    await redis.lpush(wake, "late")  # would unblock the old wait, were it still there
    await anyio.sleep(0.1)
    assert await redis.exists(marker) == 0, "the command queued behind the cancelled wait ran"
    assert await redis.lrange(wake, 0, -1) == [b"late"], "a dead wait took the wake-up"
    assert await link.call("PING") == b"PONG", "the next call connects afresh"


async def test_a_hot_link_waits_without_letting_the_event_loop_sleep_and_only_while_hot(
    linked: Linked, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis, link = linked.redis, linked.link
    selector: selectors.BaseSelector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    timeouts: list[float | None] = []
    select = selector.select

    def recording_select(timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        timeouts.append(timeout)
        return select(timeout)

    monkeypatch.setattr(selector, "select", recording_select)

    async def wait_for_push(wake: str) -> list[float | None]:
        timeouts.clear()
        waiting = asyncio.ensure_future(link.call("BLPOP", wake, 2, block_s=2))
        await anyio.sleep(0.05)
        seen = list(timeouts)
        await redis.lpush(wake, "go")
        assert await waiting == [wake.encode(), b"go"]
        return seen

    assert await link.call("PING") == b"PONG"  # connected: a connect itself is never polled for
    link.keep_hot(1.0)
    hot = await wait_for_push(f"{prefix}:hot")
    assert hot and all(t == 0 for t in hot), "a hot wait let the selector sleep"
    link.hot_until = 0.0
    cold = await wait_for_push(f"{prefix}:cold")
    assert max(t or 0 for t in cold) > 0, "a wait past the hot window still polls"


async def test_a_hot_wait_that_is_cancelled_still_closes_the_link(linked: Linked, prefix: str) -> None:
    redis, link = linked.redis, linked.link
    wake, marker = f"{prefix}:wake", f"{prefix}:marker"
    assert await link.call("PING") == b"PONG"  # connected: the cancel lands in the polling, not the connect
    link.keep_hot(5.0)
    with anyio.move_on_after(0.2):  # cancelled while polling, before the reply
        await link.send([("BLPOP", wake, 5), ("SET", marker, "ran")], block_s=5)
    assert asyncio.get_running_loop().time() < link.hot_until, "the cancel came after the hot window"
    await redis.lpush(wake, "late")
    await anyio.sleep(0.1)
    assert await redis.exists(marker) == 0, "the command queued behind the cancelled wait ran"
    assert await redis.lrange(wake, 0, -1) == [b"late"], "a dead wait took the wake-up"
    assert await link.call("PING") == b"PONG", "the next call connects afresh"


async def test_a_hot_call_whose_connection_dies_as_its_caller_is_cancelled_leaves_no_unread_error(
    linked: Linked, prefix: str
) -> None:
    link = linked.link
    assert await link.call("PING") == b"PONG"
    link.keep_hot(5.0)
    waiting = asyncio.ensure_future(link.call("BLPOP", f"{prefix}:never", 5, block_s=5))
    await anyio.sleep(0.01)
    unread: list[object] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unread.append(context))
    # The reply fails and the caller is cancelled in the same turn: the poll never sees the failure.
    link._wire.fail(redis_errors.ConnectionError("cut"))  # type: ignore[union-attr]
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    del waiting
    for _ in range(3):
        await anyio.lowlevel.checkpoint()
        gc.collect()
    loop.set_exception_handler(None)
    assert unread == [], "a failed reply's error was never read"
    assert await link.call("PING") == b"PONG"


async def test_a_killed_connection_fails_the_call_in_flight_and_the_next_one_reconnects(
    linked: Linked, prefix: str
) -> None:
    redis, link = linked.redis, linked.link
    name = f"{prefix}-link"
    await link.call("CLIENT", "SETNAME", name)
    waiting = asyncio.ensure_future(link.call("BLPOP", f"{prefix}:never", 5, block_s=5))
    await anyio.sleep(0.05)
    await redis.client_kill_filter(_type=None, skipme=True, addr=await _addr_of(redis, name))
    with anyio.fail_after(2), pytest.raises(redis_errors.ConnectionError):
        await waiting
    assert await link.call("PING") == b"PONG"


async def test_run_script_rides_out_a_link_that_cannot_connect_through_redis_py(linked: Linked, prefix: str) -> None:
    script = linked.redis.register_script("return ARGV[1]")
    nowhere = connect(f"redis://127.0.0.1:{free_port()}/0")
    link = link_of(nowhere)
    assert await run_script(link, script, [f"{prefix}:k"], ["after"]) == b"after"
    assert link.fallbacks == 1
    await nowhere.aclose()


async def _addr_of(redis: object, name: str) -> str:
    clients = await redis.client_list()  # type: ignore[attr-defined]
    return next(c["addr"] for c in clients if c["name"] == name)


async def test_a_reply_that_never_comes_times_out_after_the_client_s_socket_timeout(
    redis_url: str, prefix: str
) -> None:
    redis = aioredis.Redis.from_url(redis_url, socket_timeout=0.2)
    link = link_of(redis)
    with anyio.fail_after(5), pytest.raises(redis_errors.TimeoutError):
        await link.call("BLPOP", f"{prefix}:never", 3)  # blocks 3 s, but the caller allowed 0 + 0.2
    assert await link.call("PING") == b"PONG"
    assert await link.call("BLPOP", f"{prefix}:never", 0.3, block_s=0.3) is None, "its own block time is allowed"
    await link.aclose()
    await redis.aclose()


@pytest.mark.parametrize("hot", [False, True], ids=["asleep", "hot"])
async def test_a_cancelled_call_that_does_not_block_leaves_the_others_alone(hot: bool) -> None:
    """Its reply is dropped when it comes; the calls queued behind it run once and get their own.  Hot: it
    is cancelled while it polls (:meth:`RespLink.keep_hot`), not while it awaits its reply."""
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        link = link_of(redis)
        assert await link.call("PING") == b"PONG"
        link.keep_hot(5.0 if hot else 0.0)
        busy = """local function now() local t = redis.call('TIME') return t[1] * 1e6 + t[2] end
        local t0 = now() repeat until now() - t0 > 200000 return 1"""  # 0.2 s of Lua
        slow = asyncio.ensure_future(link.call("EVAL", busy, 0))
        await anyio.sleep(0.02)
        behind = asyncio.ensure_future(link.call("INCR", "n"))
        await anyio.sleep(0.02)
        slow.cancel()
        assert await behind == 1
        assert await link.call("GET", "n") == b"1", "ran once, in step"
        await link.aclose()


async def test_a_closed_link_stays_closed_even_mid_connect(redis_url: str) -> None:
    async with open_client(redis_url) as redis:
        link = link_of(redis)
        connecting = asyncio.ensure_future(link.call("PING"))
        await asyncio.sleep(0)  # the call is in _connect now
        await link.aclose()
        with pytest.raises(redis_errors.ConnectionError):
            await connecting
        with pytest.raises(redis_errors.ConnectionError):
            await link.call("PING")
        with pytest.raises(ValueError):
            await link.send([])


async def test_after_a_failed_connect_calls_fail_at_once_for_a_moment() -> None:
    redis = connect(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    link = link_of(redis)
    with pytest.raises(redis_errors.ConnectionError, match="cannot connect"):
        await link.call("PING")
    with pytest.raises(redis_errors.ConnectionError, match="moments ago"):
        await link.call("PING")
    await redis.aclose()


async def test_the_link_follows_the_client_s_password_and_database() -> None:
    async with EmbeddedRedis(extra_args=["--requirepass", "s3cret"]) as server:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/3"
        async with open_client(url) as redis:
            link = link_of(redis)
            await link.call("SET", "where", "db3")
            assert await redis.get("where") == b"db3"
            await link.aclose()
        async with open_client(f"redis://:wrong@127.0.0.1:{server.port}/3") as redis:
            link = link_of(redis)
            with pytest.raises(redis_errors.AuthenticationError):
                await link.call("PING")
            with pytest.raises(redis_errors.AuthenticationError):
                await run_script(link_of(redis), redis.register_script("return 1"), [], [])


def test_no_link_where_it_cannot_follow_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    assert open_link(connect("redis://127.0.0.1:6379/0")) is not None
    provider = UsernamePasswordCredentialProvider("u", "p")
    monkeypatch.setattr(resp_link, "_said", set())
    with capture_logs() as logs:
        assert open_link(aioredis.Redis(credential_provider=provider)) is None
        monkeypatch.setenv(resp_link.ENV, "0")
        assert open_link(connect("redis://127.0.0.1:6379/0")) is None
        assert open_link(connect("redis://127.0.0.1:6379/0")) is None  # said once per process
    assert [(e["event"], e["reason"]) for e in logs] == [
        ("redis_link.off", "a credential provider"),
        ("redis_link.off", f"{resp_link.ENV}=0"),
    ]


async def test_the_link_speaks_tls_with_the_client_s_own_context(tmp_path: Path) -> None:
    ca, cert, key = make_test_ca(tmp_path)
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
    with PrivateRedis(tmp_path, [*tls, "--tls-auth-clients", "no"], tls=True) as server:
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={ca}"
        server.start(url)
        async with open_client(url) as redis:
            link = link_of(redis)
            script = redis.register_script("return redis.call('INCR', KEYS[1])")
            await script(keys=["n"], args=[])  # loaded
            assert await run_script(link, script, ["n"], []) == 2
            assert link.fallbacks == 0, "the call went over the TLS link"
            await link.aclose()
        untrusted = f"rediss://127.0.0.1:{server.port}/0"
        async with open_client(untrusted) as redis:
            with pytest.raises(redis_errors.ConnectionError):
                await link_of(redis).call("PING")


@pytest.mark.parametrize("over", ["link", "redis-py"])
async def test_run_transaction_raises_the_first_error_as_redis_py_does_and_a_queued_error_runs_nothing(
    linked: Linked, prefix: str, over: str
) -> None:
    redis, link = linked.redis, (linked.link if over == "link" else None)
    key, counter = f"{prefix}:t", f"{prefix}:n"
    assert await run_transaction(link, redis, [("SET", key, "v", "EX", 60), ("INCR", counter), ("GET", key)]) == [
        True if link is None else b"OK",
        1,
        b"v",
    ]
    await redis.set(f"{prefix}:s", "x")
    with pytest.raises(redis_errors.ResponseError, match="WRONGTYPE"):  # fails at EXEC: the others ran
        await run_transaction(link, redis, [("INCR", counter), ("LPUSH", f"{prefix}:s", "y")])
    assert await redis.get(counter) == b"2"
    with pytest.raises(redis_errors.ResponseError):  # refused while queued: EXEC runs nothing
        await run_transaction(link, redis, [("INCR", counter), ("NO-SUCH-COMMAND",)])
    assert await redis.get(counter) == b"2"
    if link is not None:
        assert await link.call("PING") == b"PONG", "the link is in step after both failures"


async def test_transactions_and_plain_calls_share_a_link_without_interleaving(linked: Linked, prefix: str) -> None:
    redis, link = linked.redis, linked.link
    got: dict[int, list[object]] = {}

    async def transaction(i: int) -> None:
        got[i] = await run_transaction(link, redis, [("INCR", f"{prefix}:a"), ("RPUSH", f"{prefix}:l", i)])

    async def plain(i: int) -> None:
        await link.call("INCR", f"{prefix}:b")

    async with anyio.create_task_group() as tg:
        for i in range(100):
            tg.start_soon(transaction, i)
            tg.start_soon(plain, i)
    assert sorted(int(r[0]) for r in got.values()) == list(range(1, 101))  # type: ignore[call-overload]
    assert await redis.get(f"{prefix}:b") == b"100" and await redis.llen(f"{prefix}:l") == 100


async def test_run_transaction_rides_out_a_link_that_cannot_connect_through_redis_py(
    linked: Linked, prefix: str
) -> None:
    nowhere = connect(f"redis://127.0.0.1:{free_port()}/0")
    link = link_of(nowhere)
    assert await run_transaction(link, linked.redis, [("SET", f"{prefix}:k", "after")]) == [True]
    assert link.fallbacks == 1 and await linked.redis.get(f"{prefix}:k") == b"after"
    await nowhere.aclose()
