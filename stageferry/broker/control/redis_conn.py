"""The Redis boundary: one connection factory, and the one place redis-py errors become ours.

URLs may be ``redis://`` or ``rediss://`` (TLS), with ``user:password@`` for an ACL user.  TLS options
ride in the URL's query, so one ``STAGEFERRY_REDIS_URL`` configures every process alike::

    rediss://stageferry:secret@redis.internal:6380/0?ssl_ca_certs=/etc/stageferry/ca.crt
    rediss://...?ssl_ca_certs=ca.crt&ssl_certfile=client.crt&ssl_keyfile=client.key   (mutual TLS)

The URL is checked before any I/O: an unknown query parameter, a TLS option on a plain ``redis://`` URL
or a certificate file that does not exist is a :class:`ConfigError` at start-up, not a TypeError at the
first command.  Commands are retried by redis-py with exponential backoff and jitter on connection and
timeout errors; what still fails leaves here as :class:`ControlPlaneError` — or :class:`AccessDeniedError`
when Redis refuses the credentials or an ACL forbids a command, which no retry can heal.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import anyio
import redis.asyncio as aioredis
import structlog
from redis import exceptions as redis_errors
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from stageferry.errors import AccessDeniedError, ConfigError, ControlPlaneError

log = structlog.get_logger(__name__)

#: Longest a single blocking read waits; sockets time out a little after it.
BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = BLOCK_MS / 1000 + 10


#: TLS options that redis-py takes from a ``rediss://`` URL's query (certificate files are checked).
TLS_QUERY_FILES = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
TLS_QUERY_OPTIONS = TLS_QUERY_FILES | {"ssl_cert_reqs", "ssl_ca_path", "ssl_check_hostname", "ssl_min_version"}
_SCHEMES = frozenset({"redis", "rediss", "unix"})


def check_url(url: str) -> None:
    """Refuse (:class:`ConfigError`) a URL that redis-py would only choke on later, or mis-handle silently."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ConfigError(f"redis URL must start with redis://, rediss:// or unix:// (got {parts.scheme!r})")
    for name, values in parse_qs(parts.query, keep_blank_values=True).items():
        if name in TLS_QUERY_OPTIONS:
            if parts.scheme != "rediss":
                raise ConfigError(f"redis URL option {name} needs a rediss:// (TLS) URL", option=name)
            if name in TLS_QUERY_FILES and not Path(values[-1]).is_file():
                raise ConfigError(f"redis URL option {name}: no such file {values[-1]!r}", option=name)
        elif name not in URL_QUERY_ARGUMENT_PARSERS:
            raise ConfigError(f"unknown redis URL option {name!r}", option=name)


def connect(url: str, *, retries: int = 4) -> aioredis.Redis:
    """A client for ``url`` with bounded, jittered retries; no I/O happens until first use.

    :class:`ConfigError` at once for a malformed URL (see :func:`check_url`)."""
    check_url(url)
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
    if isinstance(cause, redis_errors.AuthenticationError):  # a ConnectionError to redis-py, not to us
        return False
    return isinstance(cause, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError)


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Translate redis-py errors raised inside the block into :class:`ControlPlaneError`."""
    try:
        yield
    except (redis_errors.AuthenticationError, redis_errors.NoPermissionError) as exc:
        raise AccessDeniedError(f"redis refused access: {exc}", redis_error=type(exc).__name__) from exc
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
