"""A Sentinel-managed Redis group for tests (:class:`~stageferry.chaos.sentinels.SentinelGroup`: real
``redis-server`` processes, three in sentinel mode, short failover timings), and waiting on it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from stageferry.chaos.sentinels import SentinelGroup

T = TypeVar("T")


@pytest.fixture
async def sentinel_group(tmp_path: Path) -> AsyncIterator[SentinelGroup]:
    """A fresh group (primary, two replicas, three sentinels) of this test's own, stopped afterwards."""
    async with SentinelGroup(tmp_path / "ha") as group:
        yield group


async def eventually(probe: Callable[[], Awaitable[T]], *, timeout: float, what: str) -> T:
    """``await probe()`` until it returns something true (an exception counts as not yet); that value."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = await probe()
        except Exception as exc:  # noqa: BLE001 (not yet: the failover is still running)
            last = exc
        else:
            if value:
                return value
        await anyio.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what} (last error: {last!r})")
