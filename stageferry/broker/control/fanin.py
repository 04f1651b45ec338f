"""One blocking reader per process for request event streams, fanned in to every waiter.

A waiter (a gateway's synchronous request, ``Client.wait``, ``stageferry submit --wait``) blocks until its
request's events stream (``<p>:req:<id>:events``) gets a terminal status.  Giving every waiter its own
``XREAD BLOCK`` holds one pooled connection per waiter: a few hundred concurrent waits exhaust any pool
(redis-py's, or the server's ``maxclients``) and starve every other command, health checks included.

Here all waiters of one :class:`EventFanIn` share **one** blocking read: a single ``XREAD BLOCK`` over the
streams of every waiter (each from the last id that waiter has seen), whose rows are dispatched to the
waiters they belong to.  No background task is needed: whichever waiter finds the reader role free takes
it (an :class:`anyio.Lock`), runs one read round, and gives it back; waiters that get their rows return,
and a waiter that leaves while others still wait hands the role on by waking one of them.  So at most one
connection blocks, however many requests wait; other commands (status reads, submits) borrow pooled
connections for a moment only.

Bounds: at most ``max_waiters`` subscriptions (more is :class:`~stageferry.errors.QueueFullError`), at most
``count`` rows per stream per round, and a waiter with ``max_buffered`` undelivered rows is left out of
the next reads until it catches up.  A newly registered waiter joins at the next round, at most
``block_ms`` later (rows written meanwhile are not lost: it reads from its own last id).

Cost: Redis pays for every stream a round names, whether it has rows or not (an ``XREAD`` over about a
thousand streams took 0.98 ms of its main thread on the 2-core box, 1 µs a stream: more than all of a
request's scripts together when each round carried a row or two).  So rounds start at least
:data:`ROUND_GAP_PER_STREAM_S` per stream named apart, :data:`ROUND_GAP_MAX_S` at most: a few waiters
read back to back as before, a thousand wait up to 20 ms longer for their rows and each round carries
many more of them.

Trouble is contained: a connection failure or a transient reply (``BUSY``, ``LOADING``) makes the reader
back off and try again (each waiter keeps its own deadline, so a wait rides through a Redis restart
within its timeout), and a key that makes the whole read fail — a client may ``SET`` something that is
not a stream under an events key — is found by probing each key alone; only the waiters of the bad keys
get the error.
"""

from __future__ import annotations

import random
import sys
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.redis_conn import is_transient_error, translated
from stageferry.errors import ControlPlaneError, QueueFullError, StageferryError

log = structlog.get_logger(__name__)


class _Waiters:
    """Requests waited on through this process's fan-in readers.  A Prometheus gauge too in processes
    that export metrics (stages, gateway: they have imported prometheus_client by the first wait); a
    client process only counts, so the client-only install (which lacks prometheus_client) works."""

    def __init__(self) -> None:
        self.count = 0
        self._gauge: Any = None

    def _metric(self) -> Any:
        if self._gauge is None and "prometheus_client" in sys.modules:
            from prometheus_client import Gauge

            self._gauge = Gauge("stageferry_event_waiters", "Requests waited on through the shared event reader")
            self._gauge.set(self.count)
        return self._gauge

    def inc(self) -> None:
        self.count += 1
        if (gauge := self._metric()) is not None:
            gauge.inc()

    def dec(self) -> None:
        self.count -= 1
        if (gauge := self._metric()) is not None:
            gauge.dec()


WAITERS = _Waiters()

Row = tuple[str, dict[str, str]]

#: A read round starts at least this long per stream it names after the last one started (see the
#: module docstring) ...
ROUND_GAP_PER_STREAM_S = 20e-6
#: ... and at most this long after it.
ROUND_GAP_MAX_S = 0.02


def text_rows(raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Row]:
    """A stream reply's rows as the shared reader hands them out: ids and fields as text."""
    return [
        (eid.decode(), {k.decode(errors="replace"): v.decode(errors="replace") for k, v in fields.items()})
        for eid, fields in raw
    ]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False, slots=True)
class _Sub:
    key: str
    last_id: str
    rows: deque[Row] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)
    error: StageferryError | None = None


class Subscription:
    """One waiter's view of its events stream, handed out by :meth:`EventFanIn.subscribe`."""

    def __init__(self, fanin: EventFanIn, sub: _Sub) -> None:
        self._fanin = fanin
        self._sub = sub

    async def next_rows(self, timeout: float) -> list[Row]:
        """The rows that arrived since the last call, waiting up to ``timeout`` seconds for some; ``[]`` when
        none came.  Raises the error of a read that failed because of this waiter's key."""
        return await self._fanin._next_rows(self._sub, timeout)


class EventFanIn:
    """The shared reader of one Redis client (see the module docstring)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        block_ms: int = 100,
        count: int = 100,
        max_waiters: int = 10_000,
        max_buffered: int = 1_000,
    ) -> None:
        self._redis = redis
        self._block_ms = block_ms
        self._count = count
        self._max_waiters = max_waiters
        self._max_buffered = max_buffered
        self._subs: dict[int, _Sub] = {}
        self._next = 0
        self._reader = anyio.Lock()
        self._backoff = 0.0
        self._last_round = -1e9  # when the last read round started (anyio's clock)
        #: Read rounds so far, and the most streams one round read (for benchmarks and tests).
        self.rounds = 0
        self.failed_rounds = 0  #: reads that met a transient error (Redis away, busy) and were retried
        self.widest_round = 0

    @property
    def waiters(self) -> int:
        return len(self._subs)

    @asynccontextmanager
    async def subscribe(self, key: str, last_id: str = "0-0") -> AsyncIterator[Subscription]:
        """Wait on the events stream ``key`` (from after ``last_id``) for the duration of the block."""
        if len(self._subs) >= self._max_waiters:
            raise QueueFullError(f"{len(self._subs)} requests are already waited on here; retry later")
        handle = self._next
        self._next += 1
        sub = _Sub(key, last_id)
        self._subs[handle] = sub
        WAITERS.inc()
        try:
            yield Subscription(self, sub)
        finally:
            del self._subs[handle]
            WAITERS.dec()
            self._hand_on()

    def _hand_on(self, leaving: _Sub | None = None) -> None:
        """Wake one waiter (other than ``leaving``) so that it takes the reader role, unless someone holds
        it already."""
        if not self._reader.locked():
            for sub in self._subs.values():
                if sub is not leaving:
                    sub.wake.set()
                    return

    async def _next_rows(self, sub: _Sub, timeout: float) -> list[Row]:
        deadline = anyio.current_time() + timeout
        while True:
            sub.wake = anyio.Event()  # reset before looking: a set() from here on is not lost
            if sub.error is not None:
                raise sub.error
            if sub.rows:
                rows = list(sub.rows)
                sub.rows.clear()
                return rows
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                return []
            if not self._reader.locked():
                try:
                    async with self._reader:
                        await self._round(max(1, min(self._block_ms, int(remaining * 1000))))
                finally:
                    if sub.rows or sub.error is not None:
                        self._hand_on(sub)  # this waiter is about to leave with its rows
                continue
            with anyio.move_on_after(remaining):
                await sub.wake.wait()

    async def _round(self, block_ms: int) -> None:
        """One read for every waiter not already holding ``max_buffered`` rows; dispatch what came."""
        if self._backoff:
            await anyio.sleep(self._backoff)
        streams: dict[str, str] = {}
        for sub in self._subs.values():
            if sub.error is None and len(sub.rows) < self._max_buffered:
                known = streams.get(sub.key)
                if known is None or _id_key(sub.last_id) < _id_key(known):
                    streams[sub.key] = sub.last_id
        if not streams:
            await anyio.sleep(block_ms / 1000)
            return
        gap = min(ROUND_GAP_MAX_S, len(streams) * ROUND_GAP_PER_STREAM_S)
        wait = self._last_round + gap - anyio.current_time()
        if wait > 0:  # many streams: let rows gather rather than pay for every stream on every row
            await anyio.sleep(min(wait, block_ms / 1000))
        self._last_round = anyio.current_time()
        self.rounds += 1
        self.widest_round = max(self.widest_round, len(streams))
        try:
            with translated():
                reply = await self._redis.xread(streams, count=self._count, block=block_ms)  # type: ignore[arg-type]
        except ControlPlaneError as exc:
            if is_transient_error(exc):  # connection trouble, BUSY, LOADING, ...
                self.failed_rounds += 1
                self._backoff = min(2.0, max(0.1, self._backoff * 2)) * (0.5 + random.random() / 2)
                log.warning("events.read_failed", error=exc.message, waiters=len(self._subs), retry_in=self._backoff)
                return
            await self._isolate(streams, exc)
            return
        if self._backoff:
            log.info("events.read_recovered", waiters=len(self._subs))
            self._backoff = 0.0
        self._dispatch(reply or [])

    def _dispatch(self, reply: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]) -> None:
        by_key: dict[str, list[_Sub]] = {}
        for sub in self._subs.values():
            by_key.setdefault(sub.key, []).append(sub)
        for raw_key, raw_rows in reply:
            key = raw_key.decode(errors="replace")
            rows = text_rows(raw_rows)
            for sub in by_key.get(key, []):
                after = _id_key(sub.last_id)
                fresh = [row for row in rows if _id_key(row[0]) > after]
                if fresh:
                    sub.rows.extend(fresh)
                    sub.last_id = fresh[-1][0]
                    sub.wake.set()

    async def _isolate(self, streams: dict[str, str], exc: ControlPlaneError) -> None:
        """The shared read failed for a reason other than the connection: probe each key alone and fail
        only the waiters of the keys at fault (all of them if no single key is)."""
        try:
            with translated():
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, last_id in streams.items():
                        pipe.xread({key: last_id}, count=1)
                    results = await pipe.execute(raise_on_error=False)
        except ControlPlaneError as probe_exc:
            results = [probe_exc] * len(streams)
        bad = {key for key, result in zip(streams, results, strict=True) if isinstance(result, Exception)}
        failing = bad or set(streams)
        log.warning("events.read_refused", error=exc.message, keys=len(failing), isolated=bool(bad))
        for sub in self._subs.values():
            if sub.key in failing:
                sub.error = ControlPlaneError(
                    f"cannot read the events of this request: {exc.message}", redis_error=exc.details.get("redis_error")
                )
                sub.wake.set()


@dataclass(eq=False, slots=True)
class _Ask:
    key: str
    wake: anyio.Event = field(default_factory=anyio.Event)
    done: bool = False
    value: bytes | None = None
    error: BaseException | None = None


class FieldReads:
    """Concurrent reads of one hash field (``HGET <key> <field>``) fanned in to one round trip.

    A thousand waits that start at once each read their request's status first; one ``HGET`` each is a
    thousand round trips through the pool, and the client's CPU goes into them.  Here the reads that are
    asked for while another is being sent share the next pipeline (at most ``max_batch`` keys): the first
    asker sends, after letting every task that is ready ask too (one turn of the event loop); whoever
    asks meanwhile waits for that send and then takes the role for the next one.  A lone read is a
    plain ``HGET``.  Each caller gets its own key's value, or its own key's error (a key of another type
    fails only its reader); a send that fails for the connection fails the readers of its batch, and a
    sender that is cancelled hands its batch back to the queue for the next sender."""

    def __init__(self, redis: aioredis.Redis, field_name: str, *, max_batch: int = 512) -> None:
        self._redis = redis
        self._field = field_name
        self._max_batch = max_batch
        self._queue: deque[_Ask] = deque()
        self._sending = False
        #: Sends so far, and the most keys one carried (for benchmarks and tests).
        self.sends = 0
        self.widest_send = 0

    async def get(self, key: str) -> bytes | None:
        ask = _Ask(key)
        self._queue.append(ask)
        try:
            while not ask.done:
                if not self._sending:
                    await self._send_until(ask)
                    continue
                ask.wake = anyio.Event()  # reset before waiting: a set() from here on is not lost
                await ask.wake.wait()
        except BaseException:
            if not ask.done and ask in self._queue:
                self._queue.remove(ask)
            self._hand_on()
            raise
        if ask.error is not None:
            raise ask.error
        return ask.value

    def _hand_on(self) -> None:
        """Wake the next asker in the queue to send, unless a send is under way."""
        if not self._sending and self._queue:
            self._queue[0].wake.set()

    async def _send_until(self, ask: _Ask) -> None:
        self._sending = True
        try:
            await anyio.lowlevel.checkpoint()  # every task that is ready now asks before this send goes
            while not ask.done and self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch))]
                try:
                    results = await self._read(batch)
                except ControlPlaneError as exc:
                    results = [exc] * len(batch)
                except BaseException:
                    self._queue.extendleft(reversed(batch))  # cancelled: the next sender sends them
                    raise
                for one, result in zip(batch, results, strict=True):
                    one.done = True
                    if isinstance(result, BaseException):
                        one.error = result
                    else:
                        one.value = result
                    one.wake.set()
        finally:
            self._sending = False
            self._hand_on()

    async def _read(self, batch: list[_Ask]) -> list[Any]:
        self.sends += 1
        self.widest_send = max(self.widest_send, len(batch))
        if len(batch) == 1:
            with translated():
                return [await self._redis.hget(batch[0].key, self._field)]  # type: ignore[misc]
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                for one in batch:
                    pipe.hget(one.key, self._field)
                replies = await pipe.execute(raise_on_error=False)
        return [_translated(reply) if isinstance(reply, Exception) else reply for reply in replies]


def _translated(exc: Exception) -> BaseException:
    """A redis-py error reply as the :class:`ControlPlaneError` :func:`translated` would raise."""
    try:
        with translated():
            raise exc
    except ControlPlaneError as translated_exc:
        return translated_exc
    return exc  # pragma: no cover - translated() turns every redis-py error into a ControlPlaneError


__all__ = ["WAITERS", "EventFanIn", "FieldReads", "Subscription"]
