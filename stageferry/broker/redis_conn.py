"""The Redis boundary: one connection factory, and the one place redis-py errors become ours.

URLs may be ``redis://`` or ``rediss://`` (TLS; ``ssl_ca_certs`` etc. as URL query parameters), with
``user:password@`` for an ACL user.  Commands are retried by redis-py with exponential backoff and
jitter on connection and timeout errors; what still fails leaves here as :class:`ControlPlaneError`.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator

import anyio
import redis.asyncio as aioredis
import structlog
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from stageferry.errors import ControlPlaneError

log = structlog.get_logger(__name__)

#: Longest a single blocking read waits; sockets time out a little after it.
BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = BLOCK_MS / 1000 + 10


def connect(url: str, *, retries: int = 4) -> aioredis.Redis:
    """A client for ``url`` with bounded, jittered retries; no I/O happens until first use."""
    return aioredis.from_url(
        url,
        decode_responses=False,
        socket_timeout=_SOCKET_TIMEOUT_S,
        socket_connect_timeout=5,
        health_check_interval=15,
        retry=Retry(ExponentialWithJitterBackoff(cap=2.0, base=0.05), retries),
        retry_on_error=[redis_errors.ConnectionError, redis_errors.TimeoutError],
    )


def is_connection_error(exc: BaseException) -> bool:
    """True for failures that a reconnect may heal (as opposed to protocol or script errors)."""
    cause = exc.__cause__ if isinstance(exc, ControlPlaneError) else exc
    return isinstance(cause, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError)


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Translate redis-py errors raised inside the block into :class:`ControlPlaneError`."""
    try:
        yield
    except redis_errors.RedisError as exc:
        raise ControlPlaneError(f"redis: {type(exc).__name__}: {exc}", redis_error=type(exc).__name__) from exc
    except OSError as exc:
        raise ControlPlaneError(f"redis: {exc}", redis_error=type(exc).__name__) from exc


async def wait_until_reachable(client: aioredis.Redis, *, timeout: float) -> None:
    """Ping until Redis answers, with jittered backoff; :class:`ControlPlaneError` after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    attempt = 0
    while True:
        attempt += 1
        try:
            with translated():
                await client.ping()
            if attempt > 1:
                log.info("redis.reachable", attempts=attempt)
            return
        except ControlPlaneError as exc:
            if not is_connection_error(exc) or time.monotonic() >= deadline:
                raise
            log.warning("redis.unreachable", attempt=attempt, error=exc.message, retry_in=round(delay, 3))
            await anyio.sleep(delay)
            delay = min(2.0, delay * 2) * (0.5 + random.random())


@contextlib.asynccontextmanager
async def open_client(url: str) -> AsyncIterator[aioredis.Redis]:
    """A client that is closed on exit."""
    client = connect(url)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
