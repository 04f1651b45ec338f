"""The Redis boundary's retry loop (:func:`reconnecting`): what it retries, how long, and what it logs."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client, reconnecting, translated, wait_until_reachable
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
