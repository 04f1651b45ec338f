"""A lean Redis connection for a stage's hot path: the stream wait, the read and the hand-off.

Why it exists: redis-py's asyncio client spends 100-250 µs of Python on every round trip (a pool
checkout, an ``asyncio.StreamReader`` read loop, a timeout context, response callbacks), and a hop pays
for two of them on its critical path: the producer's hand-off script and the consumer's wait-and-read
pipeline.  ``benchmarks/resp_link.py`` measures the same wake-up both ways side by side.

What it is: one socket per link, an :class:`asyncio.Protocol` that feeds hiredis's RESP parser as bytes
arrive, commands written at once and pipelined, replies matched to callers in FIFO order.  Error replies
come back as redis-py's own exception types (hiredis is given redis-py's error parser), so
:func:`~stageferry.broker.control.redis_conn.translated` maps them once, exactly as for redis-py.

What it is not: a general client.  It keeps no pool and retries nothing.  A broken or timed-out
connection fails the calls in flight with redis-py's ``ConnectionError`` / ``TimeoutError`` and is closed;
the next call connects afresh.  Callers (:func:`run_script`) then repeat the call through redis-py, whose
retries and back-off ride out an outage as before; an unknown script (``NOSCRIPT``) goes the same way, and
redis-py loads it.  A caller cancelled while waiting closes the connection: a blocked ``BLPOP``'s reply,
and any command queued behind it, must not reach the next caller (Redis drops a closed client's queued
commands, so a read script queued behind the wait never runs).

Where it cannot follow the client's configuration it is not used (:func:`open_link` returns None, and
the caller uses redis-py alone): a credential provider, a connection class other than redis-py's TCP, TLS,
Unix-socket and Sentinel-managed ones, or ``STAGEFERRY_REDIS_LINK=0`` (``=redis-py``: one dedicated redis-py
connection in its place, for comparison).  TLS reuses the client's own SSL
context.

Behind Sentinel (a ``redis+sentinel://`` URL) the link follows the master: each connect asks the client's
own Sentinel pool where the master is now (``SentinelConnectionPool.get_master_address``), so after a
failover it reconnects to the new one.  While no master is known (the sentinels are still electing one) the
connect fails and the calls go to redis-py, whose Sentinel client waits for the election with its retries;
after :data:`CONNECT_COOLDOWN_S` the link tries again.  A ``READONLY`` reply — the server this link talks
to was a master and has been demoted — closes the connection and fails the call as a broken connection
would (nothing of it ran: Redis refuses a write before running it, a ``MULTI`` with one aborts whole), so
it too is repeated through redis-py, on the new master.
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Sequence
from typing import Any

import hiredis
import structlog
from redis import exceptions as redis_errors
from redis._parsers.base import BaseParser
from redis.asyncio import Redis
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedConnection, SentinelManagedSSLConnection
from redis.commands.core import AsyncScript

from stageferry.broker.control.functions import BoundFunction, invocation, unknown
from stageferry.broker.control.redis_conn import (
    FollowingConnection,
    FollowingSSLConnection,
    is_connection_error,
    is_stale_master_reply,
)
from stageferry.broker.control.tally import Tally, TallyMixin, process_tally

log = structlog.get_logger(__name__)

#: Set to ``0`` to send everything through redis-py (for comparison, or to rule the link out).
ENV = "STAGEFERRY_REDIS_LINK"
#: ``STAGEFERRY_REDIS_LINK=redis-py``: the link is one dedicated redis-py connection instead
#: (:mod:`~stageferry.broker.control.redispy_link`), to measure the two side by side.
REDIS_PY = "redis-py"
#: A reply may come this long after the command's own blocking time before the link gives up on it,
#: when the client has no socket timeout of its own.
REPLY_MARGIN_S = 10.0
#: After a failed connect, calls go straight to redis-py for this long (no connect timeout paid per call).
CONNECT_COOLDOWN_S = 1.0

Command = Sequence[Any]


class _Target:
    """Where and how to connect, taken from a redis-py client's pool (no I/O)."""

    __slots__ = (
        "connect_timeout", "db", "host", "password", "path", "port", "reply_timeout", "sentinel", "ssl", "username"
    )  # fmt: skip

    def __init__(self, conn: Connection) -> None:
        #: The client's Sentinel pool, asked where the master is on each connect (None: a fixed address).
        self.sentinel: SentinelConnectionPool | None = getattr(conn, "connection_pool", None)
        self.path: str | None = conn.path if isinstance(conn, UnixDomainSocketConnection) else None
        self.host: str = getattr(conn, "host", "")
        self.port: int = int(getattr(conn, "port", 0) or 0)
        self.ssl = conn.ssl_context.get() if isinstance(conn, SSLConnection) else None
        self.username: str | None = conn.username
        self.password: str | None = conn.password
        self.db = int(conn.db or 0)
        self.connect_timeout = conn.socket_connect_timeout or REPLY_MARGIN_S
        self.reply_timeout = conn.socket_timeout or REPLY_MARGIN_S

    async def address(self) -> tuple[str, int]:
        """Where to connect now: the fixed address, or the master the sentinels name (redis-py's
        ``MasterNotFoundError``, a ``ConnectionError``, while they name none)."""
        if self.sentinel is None:
            return self.host, self.port
        host, port = await self.sentinel.get_master_address()
        return str(host), int(port)

    def hello(self) -> list[Command]:
        """The commands a fresh connection sends first (RESP2: the replies are plain arrays)."""
        cmds: list[Command] = []
        if self.password is not None:
            cmds.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
        if self.db:
            cmds.append(("SELECT", self.db))
        return cmds


#: The redis-py connection classes a link can stand in for.
_FOLLOWED = (
    Connection, SSLConnection, UnixDomainSocketConnection, SentinelManagedConnection, SentinelManagedSSLConnection,
    FollowingConnection, FollowingSSLConnection,
)  # fmt: skip


def open_link(redis: Redis) -> RespLink | None:
    """A link to the server ``redis`` talks to, with its credentials and database; None where the link
    cannot follow the client's configuration (see the module docstring; logged as ``redis_link.off``, and
    redis-py carries everything).  Connects on first use."""
    if os.environ.get(ENV, "1") == "0":
        _say_off(f"{ENV}=0")
        return None
    if os.environ.get(ENV) == REDIS_PY:  # the comparison: redis-py's own connection, without its pool
        from stageferry.broker.control.redispy_link import RedisPyLink

        _say_off(f"{ENV}={REDIS_PY}: one dedicated redis-py connection")
        return RedisPyLink(redis)  # type: ignore[return-value]  # RespLink's interface, measured against it
    pool = redis.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)
    cls = type(conn)
    if issubclass(cls, TallyMixin):  # the tally's subclass (redis_conn.connect) of one of redis-py's
        cls = cls.__bases__[1]
    if conn.credential_provider is not None or cls not in _FOLLOWED:
        _say_off(
            "a credential provider" if conn.credential_provider is not None else f"connection class {cls.__name__}"
        )
        return None
    return RespLink(_Target(conn), process_tally())


_said: set[str] = set()


def _say_off(reason: str) -> None:
    """Log ``redis_link.off`` once per process and reason (each stream asks for two links)."""
    if reason not in _said:
        _said.add(reason)
        log.info("redis_link.off", reason=reason)


#: What hiredis answers while a reply is still incomplete (a sentinel: ``False`` is a RESP3 reply).
_INCOMPLETE = object()


class _Wire(asyncio.Protocol):
    """The socket's protocol: parse replies as they arrive and hand each caller its own, in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader(
            protocolError=redis_errors.InvalidResponse, replyError=BaseParser.parse_error, notEnoughData=_INCOMPLETE
        )
        self.waiting: collections.deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not _INCOMPLETE:
                future, want, got = self.waiting[0]
                got.append(reply)
                if len(got) == want:
                    self.waiting.popleft()
                    if not future.done():  # a caller cancelled mid-call: its reply is dropped, in step
                        future.set_result(got)
        except (redis_errors.InvalidResponse, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.fail(redis_errors.ConnectionError(f"redis link out of step: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(redis_errors.ConnectionError(f"redis link closed: {exc or 'by the server'}"))

    def fail(self, error: Exception) -> None:
        """Fail every caller still waiting and close the socket; the link connects afresh next time."""
        self.lost = self.lost or error
        while self.waiting:
            future, _, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class RespLink:
    """One lean connection (see the module docstring); safe for many tasks of one event loop at once,
    which pipeline on it.  A blocking call (``block_s`` > 0) whose caller is cancelled closes the
    connection, failing the calls behind it: give blocking calls a link of their own."""

    def __init__(self, target: _Target, tally: Tally | None = None) -> None:
        self._target = target
        self._tally = tally
        self._wire: _Wire | None = None
        self._connecting: asyncio.Lock | None = None
        self._closed = False
        self._down_until = 0.0  # after a failed connect, calls fail at once (to redis-py) until then
        #: Calls :func:`run_script` repeated through redis-py (unknown script, connection trouble).
        self.fallbacks = 0
        #: Until this event-loop time a call polls for its reply instead of sleeping (:meth:`keep_hot`).
        self.hot_until = 0.0

    def keep_hot(self, seconds: float) -> None:
        """For the next ``seconds``, a caller waiting for a reply keeps the event loop turning instead of
        letting it sleep in the selector (:func:`poll_until_done`).

        Why: a process that sleeps, even for the 50 µs of a round trip, wakes slowly.  On the GPU host (a
        virtual machine) its Python then runs 2–3× slower for a few hundred µs, which a hop paid on every
        step after the wake-up (issue 20's step timings).  A stage keeps its links hot for a moment after
        each entry (``Timeouts.hot_wait``), so a next entry that follows closely finds it awake; the price
        is one core busy for that moment, and nothing while the stage is idle.  Measured side by side
        (``transfer.py --hot-asleep``, ``throughput.py --hot-wait``; ``benchmarks/RESULTS.md`` §15): a hop
        4–12 % shorter on the GPU host; within the noise on a 2-core box."""
        self.hot_until = asyncio.get_running_loop().time() + seconds

    async def call(self, *args: Any, block_s: float = 0.0) -> Any:
        """One command's reply; an error reply is raised (as redis-py's exception type)."""
        (reply,) = await self.send([args], block_s=block_s)
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def send(self, commands: Sequence[Command], *, block_s: float = 0.0) -> list[Any]:
        """Send ``commands`` in one write and return their replies, error replies as exception values.
        ``block_s``: how long the commands may block in Redis (a ``BLPOP``'s timeout), on top of which the
        replies get the client's socket timeout before the connection is given up."""
        if not commands:
            raise ValueError("nothing to send")
        packet = b"".join(hiredis.pack_command(tuple(c)) for c in commands)  # a bad argument fails here
        wire = self._wire
        if wire is None or wire.lost is not None:
            wire = await self._connect()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        wire.waiting.append((future, len(commands), []))
        if self._tally is not None:
            self._tally.count([str(c[0]).upper() for c in commands])
        assert wire.transport is not None
        wire.transport.write(packet)
        timer = loop.call_later(block_s + self._target.reply_timeout, _expire, wire, future)
        try:
            if loop.time() < self.hot_until:
                await poll_until_done(future, self.hot_until)
            replies = await future
        except asyncio.CancelledError:
            if not future.done():  # cancelled while polling: as if while awaiting it
                future.cancel()
            elif not future.cancelled():  # it failed meanwhile: nobody else reads its error
                future.exception()
            if block_s > 0 and future.cancelled():  # no reply yet: it, and what is queued behind it, must not run
                wire.fail(redis_errors.ConnectionError("redis link: a blocked caller was cancelled"))
            raise
        finally:
            timer.cancel()
        if any(_demoted(reply, behind_sentinel=self._target.sentinel is not None) for reply in replies):
            wire.fail(redis_errors.ConnectionError("redis link: not the master (READONLY or NOREPLICAS)"))
            raise redis_errors.ConnectionError("redis link: not the master (READONLY or NOREPLICAS): reconnecting")
        return replies

    async def aclose(self) -> None:
        """Close the socket for good (calls in flight fail; later ones too, and fall back to redis-py)."""
        self._closed = True
        wire, self._wire = self._wire, None
        if wire is not None:
            wire.fail(redis_errors.ConnectionError("redis link closed"))

    async def _connect(self) -> _Wire:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._wire is not None and self._wire.lost is None:
                return self._wire  # another task connected while this one waited
            if self._closed:
                raise redis_errors.ConnectionError("redis link closed")
            loop = asyncio.get_running_loop()
            if loop.time() < self._down_until:
                raise redis_errors.ConnectionError("redis link: the last connect failed moments ago")
            try:
                wire = await self._open()
            except (redis_errors.ConnectionError, redis_errors.TimeoutError):
                self._down_until = loop.time() + CONNECT_COOLDOWN_S
                raise
            if self._closed:  # closed while connecting
                wire.fail(redis_errors.ConnectionError("redis link closed"))
                raise redis_errors.ConnectionError("redis link closed")
            self._wire = wire
            return wire

    async def _open(self) -> _Wire:
        """A fresh, authenticated socket on the right database."""
        target, loop = self._target, asyncio.get_running_loop()
        try:
            async with asyncio.timeout(target.connect_timeout):
                if target.path is not None:
                    _, wire = await loop.create_unix_connection(_Wire, target.path)
                else:
                    address, port = await target.address()
                    host = address if target.ssl else None
                    _, wire = await loop.create_connection(_Wire, address, port, ssl=target.ssl, server_hostname=host)
                hello = target.hello()
                if hello:
                    future: asyncio.Future[list[Any]] = loop.create_future()
                    wire.waiting.append((future, len(hello), []))
                    assert wire.transport is not None
                    wire.transport.write(b"".join(hiredis.pack_command(tuple(c)) for c in hello))
                    for reply in await future:
                        if isinstance(reply, Exception):
                            wire.fail(redis_errors.ConnectionError("redis link: refused at hello"))
                            raise reply
        except TimeoutError as exc:
            raise redis_errors.TimeoutError(f"redis link: no connection in {target.connect_timeout} s") from exc
        except OSError as exc:
            raise redis_errors.ConnectionError(f"redis link: cannot connect: {exc}") from exc
        return wire


def _demoted(reply: Any, *, behind_sentinel: bool) -> bool:
    """A ``READONLY`` error reply, also inside an ``EXEC``'s (``EXECABORT`` carries it in its text) or a
    script's: the server is a replica now.  Behind Sentinel ``NOREPLICAS`` too: the server may be a master
    deposed without knowing it yet (see ``redis_conn.FollowingConnection``)."""
    if isinstance(reply, list):
        return any(_demoted(item, behind_sentinel=behind_sentinel) for item in reply)
    return isinstance(reply, redis_errors.ReadOnlyError) or (
        isinstance(reply, redis_errors.ResponseError)
        and ("READONLY" in str(reply) or (behind_sentinel and is_stale_master_reply(reply)))
    )


def _expire(wire: _Wire, future: asyncio.Future[list[Any]]) -> None:
    if not future.done():
        wire.fail(redis_errors.TimeoutError("redis link: no reply in time"))


async def run_script(
    link: RespLink | None, script: AsyncScript | BoundFunction, keys: Sequence[Any], args: Sequence[Any]
) -> Any:
    """Run a registered redis-py ``script`` or a library function over ``link`` (one ``EVALSHA`` or
    ``FCALL``); through the client it is bound to when there is no link, when Redis does not know it (that
    call loads it) or when the link's connection fails (redis-py retries).  Errors are redis-py's: wrap the
    call in ``translated()``."""
    if link is not None:
        try:
            return await link.call(*invocation(script, keys, args))
        except redis_errors.ResponseError as exc:
            if not unknown(exc):
                raise
            link.fallbacks += 1
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            fall_back(link, exc)
    return await script(keys=list(keys), args=list(args))


async def run_pipeline(
    link: RespLink | None, redis: Redis, commands: Sequence[Command], *, block_s: float
) -> list[Any]:
    """``commands`` in one write over ``link`` (see :meth:`RespLink.send`: error replies as values); as a
    redis-py pipeline when there is no link or its connection fails (redis-py retries)."""
    if link is not None:
        try:
            return await link.send(commands, block_s=block_s)
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            fall_back(link, exc)
    async with redis.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return await pipe.execute(raise_on_error=False)


async def run_transaction(
    link: RespLink | None, redis: Redis, commands: Sequence[Command], *, raise_errors: bool = True
) -> list[Any]:
    """``commands`` as one ``MULTI``/``EXEC`` in one write over ``link`` (a link writes each send at once,
    so other callers' commands never land inside it); their replies, the first error raised as redis-py's
    ``pipeline(transaction=True)`` raises it — or, with ``raise_errors=False``, the errors of commands that
    ran (a transaction does not roll back) as values in their places, for a caller that undoes the rest;
    an error that ran nothing (``EXECABORT``, a refused ``MULTI``) is raised either way.  Through that
    redis-py pipeline when there is no link or its connection fails (redis-py retries).  As with redis-py's
    own retries, a connection lost after ``EXEC`` was written may run the commands twice: give it only
    commands that may.  As with :func:`run_pipeline`, a link's replies are RESP's own (``b"OK"`` where
    redis-py's callbacks say ``True``): read only replies whose two forms agree (bytes, integers, an
    entry id)."""
    if link is not None:
        try:
            replies = await link.send([("MULTI",), *commands, ("EXEC",)])
        except (redis_errors.ConnectionError, redis_errors.TimeoutError) as exc:
            fall_back(link, exc)
        else:
            executed = replies[-1]
            ran = executed if isinstance(executed, list) and raise_errors else ()
            for reply in (*replies[:-1], executed, *ran):
                if isinstance(reply, Exception):
                    raise reply
            return list(executed)
    async with redis.pipeline(transaction=True) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=raise_errors))


async def poll_until_done(future: asyncio.Future[Any], until: float) -> None:
    """Return once ``future`` is done or the event loop's clock passes ``until``, keeping the loop turning
    meanwhile: each round yields to every other ready task and polls the selector with a zero timeout, so
    the reply is read the moment it lands and no task waits longer than it would have."""
    loop = asyncio.get_running_loop()
    while not future.done() and loop.time() < until:  # noqa: ASYNC110 (polling is the point)
        await asyncio.sleep(0)


def fall_back(link: RespLink, exc: Exception) -> None:
    """Count a call that redis-py repeats, or raise ``exc`` when no retry can heal it (refused credentials
    are a ``ConnectionError`` to redis-py)."""
    if not is_connection_error(exc):
        raise exc
    link.fallbacks += 1
