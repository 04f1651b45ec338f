"""The Redis boundary's retry loop (:func:`reconnecting`): what it retries, how long, and what it logs."""

from __future__ import annotations

import time

import anyio
import pytest
from structlog.testing import capture_logs

from stageferry.broker.control import redis_conn
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import (
    open_client,
    reconnecting,
    translated,
    wait_until_reachable,
    with_reconnects,
)
from stageferry.errors import ControlPlaneError

pytestmark = pytest.mark.anyio

NOWHERE = "redis://127.0.0.1:1/0"  # nothing listens on port 1


async def test_unreachable_redis_is_retried_with_backoff_then_raised() -> None:
    async with open_client(NOWHERE) as redis:
        started = time.monotonic()
        with capture_logs() as logs, pytest.raises(ControlPlaneError):
            await wait_until_reachable(redis, timeout=2.0)
    assert 2.0 <= time.monotonic() - started < 30
    retries = [e for e in logs if e["event"] == "redis.unreachable"]
    assert retries and [e["attempt"] for e in retries] == list(range(1, len(retries) + 1))
    assert all(0 <= e["retry_in"] <= 2.0 for e in retries)


async def test_reachable_redis_answers_at_once(redis_url: str) -> None:
    async with open_client(redis_url) as redis:
        with capture_logs() as logs:
            await wait_until_reachable(redis, timeout=5)
    assert not [e for e in logs if e["event"] in ("redis.unreachable", "redis.reachable")]


async def test_other_errors_are_not_retried(redis_url: str, prefix: str) -> None:
    """A command Redis refuses (here: a wrong type) is no outage: it leaves after one attempt."""
    calls = 0
    async with open_client(redis_url) as redis:
        key = Keys(prefix).request("x")
        await redis.set(key, b"a string")

        async def op() -> None:
            nonlocal calls
            calls += 1
            with translated():
                await redis.hget(key, "state")

        with capture_logs() as logs, pytest.raises(ControlPlaneError, match="WRONGTYPE"):
            async for attempt in reconnecting(within=5, event="test.retry"):
                with attempt:
                    await op()
    assert calls == 1 and not logs


async def test_abandon_stops_retrying_early() -> None:
    async with open_client(NOWHERE) as redis:
        started = time.monotonic()
        with pytest.raises(ControlPlaneError):
            async for attempt in reconnecting(within=60, event="test.retry", cap=0.5, abandon=lambda: True):
                with attempt, translated():
                    await redis.ping()
    assert time.monotonic() - started < 30  # gave up after about 5 s, not 60


async def test_with_reconnects_logs_the_bare_attempt_as_zero_and_retries_until_redis_answers(redis_url: str) -> None:
    """The first two attempts go to a port nobody listens on (a real refusal), the third to the test Redis."""
    calls = 0
    async with open_client(NOWHERE) as nowhere, open_client(redis_url) as redis:

        async def op() -> str:
            nonlocal calls
            calls += 1
            with translated():
                await (nowhere if calls <= 2 else redis).ping()
            return "answered"

        with capture_logs() as logs:
            assert await with_reconnects(op, within=10, event="test.retry") == "answered"
    assert calls == 3
    retries = [e for e in logs if e["event"] == "test.retry"]
    assert [e["attempt"] for e in retries] == [0, 1], "the bare attempt's failure, then the policy's first"
    assert 0 <= retries[0]["retry_in"] <= 0.05, "waited on as the policy's first retry would be"


async def test_with_reconnects_builds_no_policy_for_a_call_that_succeeds_or_is_refused(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_policy(**_: object) -> None:
        raise AssertionError("the retry policy was built")

    monkeypatch.setattr(redis_conn, "reconnecting", no_policy)
    async with open_client(redis_url) as redis:
        key = Keys(prefix).request("x")
        await redis.set(key, b"a string")

        async def refused() -> None:
            with translated():
                await redis.hget(key, "state")

        with capture_logs() as logs:
            assert await with_reconnects(redis.ping, within=5, event="test.retry") is True
            with pytest.raises(ControlPlaneError, match="WRONGTYPE"):
                await with_reconnects(refused, within=5, event="test.retry")
    assert not logs


async def test_with_reconnects_counts_its_deadline_from_the_bare_attempt() -> None:
    """A first attempt that fails only after the whole ``within`` leaves the policy one attempt, not a
    fresh ``within`` of its own."""
    calls = 0
    async with open_client(NOWHERE) as nowhere:

        async def op() -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                await anyio.sleep(1.2)  # a slow failure: a timeout, say
            with translated():
                await nowhere.ping()

        with pytest.raises(ControlPlaneError):
            await with_reconnects(op, within=1.0, event="test.retry", initial=0.01)
    assert calls == 2
