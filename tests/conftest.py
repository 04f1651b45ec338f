"""Shared fixtures: a real Redis, a private key prefix per test (deleted afterwards), asyncio for anyio."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator

import pytest
import redis as sync_redis
import structlog

#: The suite runs on one host, and one of its tests (tests/reliability/test_across_hosts.py) adds and deletes
#: IP-bearing veths in this namespace while the other worker makes NIXL agents.  A UCX worker advertises every
#: interface it opened, so an agent made while such a veth existed lists it for its whole life, and every
#: peer's handshake with it then fails ("Destination is unreachable": the address is gone) — the failure CI
#: met.  Agents here use loopback (shared memory and CUDA transports are not network devices and are kept);
#: the netns services pin their own data link.  An operator pins a stage with STAGEFERRY_ADVERTISE_ADDRESS.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules holding a ``slow`` test first, each module's tests in their own order: the suite's two
    workers (pytest-xdist's load scheduling hands tests out in collection order) start on the longest
    instead of one worker being left with them at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group is kept


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def redis_url() -> str:
    """The test Redis (``STAGEFERRY_TEST_REDIS_URL``, default the local server on 6379)."""
    return os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted at the end."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    delete_prefix(redis_url, name)


def delete_prefix(redis_url: str, name: str) -> None:
    """Delete every key under ``name:`` (a test's own prefix) and under the prefixes derived from it
    (``name-a:``, as tests that run several deployments name theirs)."""
    client = sync_redis.Redis.from_url(redis_url)
    try:
        keys = [*client.scan_iter(match=f"{name}:*", count=1000), *client.scan_iter(match=f"{name}-*:*", count=1000)]
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """Each test starts and ends with structlog's defaults and no bound context."""
    yield
    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    root = logging.getLogger()  # configure_logging routes the standard library's logging through structlog
    root.handlers[:] = [h for h in root.handlers if type(h).__name__ != "_ToStructlog"]
    logging.captureWarnings(False)
