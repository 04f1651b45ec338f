"""The Redis boundary: one connection factory, and the one place redis-py errors become ours.

URLs may be ``redis://`` or ``rediss://`` (TLS), with ``user:password@`` for an ACL user, or
``redis+sentinel://host:port,host:port/<service>`` for the master of a Sentinel-managed group
(:mod:`.redis_url` has the forms).  Options ride in the URL's query, so one ``STAGEFERRY_REDIS_URL``
configures every process alike::

    rediss://stageferry:secret@redis.internal:6380/0?ssl_ca_certs=/etc/stageferry/ca.crt
    rediss://...?ssl_ca_certs=ca.crt&ssl_certfile=client.crt&ssl_keyfile=client.key   (mutual TLS)
    redis+sentinel://stageferry:secret@s1:26379,s2:26379,s3:26379/stageferry/0?wait_replicas=1

The URL is checked before any I/O: an unknown query parameter, a TLS option on a plain ``redis://`` URL
or a certificate file that does not exist is a :class:`ConfigError` at start-up, not a TypeError at the
first command.  A sentinel URL's client is redis-py's own (a ``SentinelConnectionPool``, here a blocking
one): each new connection asks the sentinels for the master, and a ``READONLY`` reply (the master it
talked to was demoted) closes the connection and is retried on the new master like a broken
connection — a failover signal, never an error shown to a caller.

Each client's connection pool is bounded (:data:`MAX_CONNECTIONS`) and *blocking*: a burst of commands
beyond it waits its turn for a connection (up to :data:`POOL_WAIT_S`) instead of
failing with ``MaxConnectionsError`` or opening connections without bound.  Commands are retried by
redis-py with exponential backoff and jitter on connection and timeout errors (a few times, within
seconds); longer outages are ridden out by :func:`reconnecting`, the one retry loop on top of that.
What still fails leaves here as :class:`ControlPlaneError` — or :class:`AccessDeniedError` when Redis
refuses the credentials or an ACL forbids a command, which no retry can heal.
"""

from __future__ import annotations

import contextlib
import functools
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

import anyio
import redis.asyncio as aioredis
import structlog
import tenacity
from redis import exceptions as redis_errors
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import ExponentialWithJitterBackoff

from stageferry.broker.control.redis_url import Durability, SentinelTarget, parse_url
from stageferry.broker.control.redis_url import check_url as check_url  # re-exported: the URL check of record
from stageferry.broker.control.tally import process_tally, tallied
from stageferry.errors import AccessDeniedError, ControlPlaneError, NotReplicatedError

log = structlog.get_logger(__name__)

#: Longest a single blocking read waits; sockets time out a little after it.
BLOCK_MS = 1000
_SOCKET_TIMEOUT_S = BLOCK_MS / 1000 + 10
#: A retry loop asked to ``abandon`` (a draining worker) still tries this long before giving up.
_ABANDON_AFTER_S = 5.0
T = TypeVar("T")


#: Connections one client (one process's pool) opens at most; waits share one (``fanin.py``).
MAX_CONNECTIONS = 64
#: Longest a command waits for a free pooled connection before it fails (as unreachable).
POOL_WAIT_S = 30.0


def connect(url: str, *, retries: int = 4, max_connections: int = MAX_CONNECTIONS) -> aioredis.Redis:
    """A client for ``url`` with bounded, jittered retries and a bounded, blocking pool; no I/O happens
    until first use.  For a ``redis+sentinel://`` URL the pool is redis-py's Sentinel one (each new
    connection goes to the current master).

    :class:`ConfigError` at once for a malformed URL (see :func:`check_url`)."""
    parsed = parse_url(url)
    common: dict[str, Any] = {
        "max_connections": max_connections,
        "timeout": POOL_WAIT_S,
        "decode_responses": False,
        "socket_timeout": _SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5,
        "health_check_interval": 15,
        "retry": Retry(ExponentialWithJitterBackoff(cap=2.0, base=0.05), retries),
        "retry_on_error": [redis_errors.ConnectionError, redis_errors.TimeoutError],
    }
    pool: aioredis.ConnectionPool
    if parsed.sentinel is None:
        pool = aioredis.BlockingConnectionPool.from_url(parsed.url, **common)
    else:
        pool = _sentinel_pool(parsed.sentinel, common)
    tally = process_tally()
    if tally is not None:  # opt-in profiling (STAGEFERRY_REDIS_TALLY): round trips per call site
        pool.connection_class = tallied(pool.connection_class, tally)
    client = aioredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # aclose() closes the pool too, as with from_url
    _DURABILITY[client] = parsed.durability
    return client


def durability_of(client: aioredis.Redis) -> Durability:
    """How many replicas the durable writes over ``client`` wait for (its URL's ``wait_replicas``)."""
    return _DURABILITY.get(client, _NO_WAIT)


_NO_WAIT = Durability()
_DURABILITY: WeakKeyDictionary[aioredis.Redis, Durability] = WeakKeyDictionary()


class BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):  # type: ignore[misc]
    """redis-py's Sentinel pool (master looked up on each connect, ``READONLY`` → reconnect), bounded and
    blocking as every other pool here; closing it closes its connections to the sentinels too."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if inuse_connections:  # closing for good (not the idle sweep after a master change)
            for sentinel in self.sentinel_manager.sentinels:
                await sentinel.connection_pool.disconnect()


#: Sentinel's flags on a master that mean a failover is running or about to (``SENTINEL MASTER``).
FAILOVER_FLAGS = ("failover_in_progress", "promoted", "o_down", "s_down")


async def ping(client: aioredis.Redis) -> None:
    """Ask Redis whether it answers; :class:`ControlPlaneError` when it does not."""
    with translated():
        await client.ping()


async def failover_state(client: aioredis.Redis) -> str | None:
    """What the sentinels say of ``client``'s master while a failover runs (``"o_down,failover_in_progress"``,
    ``"no master known"``, ...); None when the master is plain up, or ``client`` is not behind Sentinel.
    Asks the sentinels one by one (2 s each at most); never raises."""
    pool = client.connection_pool
    if not isinstance(pool, SentinelConnectionPool):
        return None
    reachable = False
    for sentinel in pool.sentinel_manager.sentinels:
        try:
            with anyio.fail_after(2):
                reply = await sentinel.execute_command("SENTINEL", "MASTER", pool.service_name)
        except (redis_errors.RedisError, OSError, TimeoutError):
            continue
        reachable = True
        fields = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=False))
        flags = {str(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}.get("flags", b"")
        text = flags.decode() if isinstance(flags, bytes) else str(flags)
        state = [flag for flag in text.split(",") if flag in FAILOVER_FLAGS]
        return ",".join(state) or None
    return "no sentinel answers" if not reachable else None


def is_stale_master_reply(exc: BaseException) -> bool:
    """``NOREPLICAS`` from a server behind Sentinel: it may be a master that lost its role without knowing
    yet (cut off, then back; the sentinels have not reconfigured it), so ask the sentinels again."""
    return isinstance(exc, redis_errors.ResponseError) and str(exc).lstrip().startswith("NOREPLICAS")


class FollowingConnection(SentinelManagedConnection):
    """redis-py's Sentinel connection, which reconnects (to the master the sentinels name) on ``READONLY``,
    doing the same on ``NOREPLICAS``: a client still connected to a deposed master would otherwise retry
    on it until the sentinels get round to demoting it (seconds), every write refused meanwhile."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis_errors.ResponseError as exc:
            if not (self.connection_pool.is_master and is_stale_master_reply(exc)):
                raise
            await self.disconnect()
            raise redis_errors.ConnectionError(f"{exc} (asking the sentinels for the master again)") from exc


class FollowingSSLConnection(FollowingConnection, SSLConnection):
    pass


def _sentinel_pool(target: SentinelTarget, common: dict[str, Any]) -> BlockingSentinelPool:
    tls = {name: value for name, value in target.options.items() if name.startswith("ssl_")}
    to_sentinels: dict[str, Any] = {
        "socket_timeout": 5,
        "socket_connect_timeout": 2,
        "username": target.sentinel_username,
        "password": target.sentinel_password,
        "decode_responses": False,
    }
    if target.ssl:
        to_sentinels.update(ssl=True, **tls)
    manager = Sentinel(list(target.sentinels), sentinel_kwargs=to_sentinels)
    options = {**common, **target.options}
    return BlockingSentinelPool(
        target.service,
        manager,
        connection_class=FollowingSSLConnection if target.ssl else FollowingConnection,
        db=target.db,
        username=target.username,
        password=target.password,
        **options,
    )


def is_connection_error(exc: BaseException) -> bool:
    """True for failures that a reconnect may heal (as opposed to protocol or script errors)."""
    cause = exc.__cause__ if isinstance(exc, ControlPlaneError) else exc
    if isinstance(cause, redis_errors.AuthenticationError):  # a ConnectionError to redis-py, not to us
        return False
    return isinstance(cause, redis_errors.ConnectionError | redis_errors.TimeoutError | OSError)


#: Replies that mean "Redis is up but cannot serve this right now": waited out, never a request failure.
#: BUSY: a script runs past lua-time-limit; LOADING: a restart is reading its dataset; MASTERDOWN,
#: TRYAGAIN: a replica or cluster in transition.
#: READONLY: the server was a master and is now a replica (a failover; redis-py's Sentinel pool turns it
#: into a reconnect itself); NOREPLICAS: a master short of ``min-replicas-to-write`` good replicas.
_TRANSIENT_REPLIES = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "READONLY", "NOREPLICAS")

#: The same replies as redis-py's own exception types (which keep only the text after the word).
_TRANSIENT_TYPES = (
    redis_errors.ReadOnlyError, redis_errors.BusyLoadingError, redis_errors.TryAgainError, redis_errors.MasterDownError
)  # fmt: skip


def is_transient_error(exc: BaseException) -> bool:
    """True for failures worth waiting out with backoff: connection trouble, a transient reply, or a
    submission not yet on enough replicas (resubmitting it is idempotent)."""
    if is_connection_error(exc) or isinstance(exc, NotReplicatedError):
        return True
    cause = exc.__cause__ if isinstance(exc, ControlPlaneError) else exc
    if not isinstance(cause, redis_errors.RedisError) or isinstance(cause, redis_errors.NoPermissionError):
        return False
    if isinstance(cause, _TRANSIENT_TYPES):  # redis-py parsed the word off the reply
        return True
    text = str(cause).lstrip()  # a script's error reply quotes the command's: "... BUSY Redis is busy"
    return any(text.startswith(word) or f" {word} " in text for word in _TRANSIENT_REPLIES)


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


def reconnecting(
    *,
    within: float,
    event: str,
    initial: float = 0.05,
    cap: float = 2.0,
    abandon: Callable[[], bool] | None = None,
    since: float | None = None,
) -> tenacity.AsyncRetrying:
    """The one retry policy for Redis outages that outlast redis-py's own retries (see :func:`connect`).

    Retries only transient failures (:func:`is_transient_error`: connection trouble, ``BUSY``, ``LOADING``,
    ...) — with exponential backoff and full jitter, from ``initial`` up to ``cap`` seconds — until
    ``within`` seconds have passed since the first attempt, or since ``since`` (``time.monotonic()`` of an
    attempt made before the policy: see :func:`with_reconnects`), or ``abandon()`` says stop, checked
    after 5 s of failures; then the last error is raised as
    itself.  Each retry is logged as ``event`` with the attempt, the error and the wait::

        async for attempt in reconnecting(within=60, event="worker.redis_retry"):
            with attempt:
                await op()
    """
    stop: tenacity.stop.stop_base = tenacity.stop_after_delay(within) if since is None else _After(within, since)
    if abandon is not None:
        stop = stop | _Abandon(abandon, since)
    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, ControlPlaneError) and is_transient_error(exc)),
        stop=stop,
        wait=tenacity.wait_random_exponential(multiplier=initial, max=cap),
        sleep=anyio.sleep,
        before_sleep=functools.partial(_log_retry, event),
        reraise=True,
    )


async def with_reconnects(
    op: Callable[[], Awaitable[T]],
    *,
    within: float,
    event: str,
    initial: float = 0.05,
    cap: float = 2.0,
    abandon: Callable[[], bool] | None = None,
) -> T:
    """``await op()`` under :func:`reconnecting`'s policy, its first attempt made bare: building the policy
    costs about 14 µs of Python a call, paid here only once an attempt has failed.  That failure is logged
    as attempt 0 and waited on as the policy's first would be (full jitter up to ``initial``), and the
    policy's ``within`` and ``abandon`` clocks count from it."""
    since = time.monotonic()
    try:
        return await op()
    except ControlPlaneError as exc:
        if not is_transient_error(exc):
            raise
        wait = random.uniform(0, initial)
        log.warning(event, attempt=0, error=exc.message, retry_in=round(wait, 3))
    await anyio.sleep(wait)
    async for attempt in reconnecting(
        within=within, event=event, initial=initial, cap=cap, abandon=abandon, since=since
    ):
        with attempt:
            return await op()
    raise AssertionError("unreachable: tenacity re-raises the last error")  # pragma: no cover


def _elapsed(since: float | None, retry_state: tenacity.RetryCallState) -> float:
    return time.monotonic() - since if since is not None else (retry_state.seconds_since_start or 0.0)


class _After(tenacity.stop.stop_base):
    """Stop once ``within`` seconds have passed since ``since`` (``time.monotonic()``)."""

    def __init__(self, within: float, since: float) -> None:
        self._within, self._since = within, since

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return _elapsed(self._since, retry_state) >= self._within


class _Abandon(tenacity.stop.stop_base):
    """Stop once ``abandon()`` holds and the failures have lasted :data:`_ABANDON_AFTER_S`."""

    def __init__(self, abandon: Callable[[], bool], since: float | None = None) -> None:
        self._abandon, self._since = abandon, since

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._abandon() and _elapsed(self._since, retry_state) > _ABANDON_AFTER_S


def _log_retry(event: str, state: tenacity.RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    message = error.message if isinstance(error, ControlPlaneError) else repr(error)
    log.warning(event, attempt=state.attempt_number, error=message, retry_in=round(wait, 3))


async def wait_until_reachable(client: aioredis.Redis, *, timeout: float) -> None:
    """Ping until Redis answers (:func:`reconnecting`); :class:`ControlPlaneError` after ``timeout``."""
    async for attempt in reconnecting(within=timeout, event="redis.unreachable"):
        with attempt, translated():
            await client.ping()
    if attempt.retry_state.attempt_number > 1:
        log.info("redis.reachable", attempts=attempt.retry_state.attempt_number)


@contextlib.asynccontextmanager
async def open_client(url: str) -> AsyncIterator[aioredis.Redis]:
    """A client that is closed on exit."""
    client = connect(url)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.aclose()
