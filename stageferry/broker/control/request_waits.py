"""Waiting for a request: following its events to its end, through the store's one shared reader.

A waiter blocks on the request's events stream (``<p>:req-events:<id>``) through
:class:`~stageferry.broker.control.fanin.EventFanIn`, so that a thousand waiters hold one connection; after
a quiet spell it reads the record itself (the events may have expired while the request ended, or Redis
restarted empty), and it tells a request that vanished after being seen (``request_lost``) from one never
seen (``not_found``, after a grace).  Redis being unreachable is waited out within the timeout.
:class:`RequestWaits` is the half of :class:`~stageferry.broker.control.requests.RequestStore` that reads
and waits; the store adds the writes.
"""

from __future__ import annotations

import abc
import functools
import math
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import redis.asyncio as aioredis

from stageferry.broker.control.fanin import EventFanIn, Row, text_rows
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import BLOCK_MS, is_transient_error, reconnecting, translated
from stageferry.errors import ControlPlaneError, DeadlineExceededError, RequestLostError, RequestNotFoundError
from stageferry.schemas import TERMINAL_STATES, RequestStatus

T = TypeVar("T")

#: How long a waiter gives an id that it never saw (neither a record nor a "submitted" marker) before
#: calling it not found: a raw client's submission may carry no marker, and is known only once a first stage (maybe
#: still starting) takes it.  Not "lost": such an entry may still run, and a waiter told ``request_lost``
#: must never see the request end otherwise (issue 34).  An id seen and then gone is lost at once (nothing
#: can bring it back: stages write records only for entries they hold, ``held.py``).
UNKNOWN_GRACE_S = 30.0
#: A waiter that heard nothing for this long reads the status itself (events may have expired, or Redis
#: restarted empty); jittered so that many waiters do not check at once.
QUIET_CHECK_S = 2.0
#: The states a request's record or its status event says it ended in (their ``state`` field).
TERMINAL_NAMES = frozenset(state.value for state in TERMINAL_STATES)


def _is_terminal(fields: Mapping[str, str]) -> bool:
    return fields.get("kind") == "status" and fields.get("state") in TERMINAL_NAMES


class RequestWaits(abc.ABC):
    """Follow and wait for requests under one key prefix (see the module docstring).  The store that
    subclasses it provides the connection, the keys, the shared reader and the two record reads."""

    _redis: aioredis.Redis
    _keys: Keys
    #: The one blocking reader every wait and follow of this store shares.
    fanin: EventFanIn

    @abc.abstractmethod
    async def get(self, request_id: str) -> RequestStatus | None:
        """The request's status; None: no record."""

    @abc.abstractmethod
    async def known(self, request_id: str) -> bool:
        """Whether the request has a record or a "submitted" marker."""

    async def follow(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        on_quiet: Callable[[], Awaitable[None]] | None = None,
        exists_within: float | None = None,
        seen: bool = False,
    ) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """Yield the request's events (entry id, fields) as they arrive, from the first, through the shared
        reader; stop after a terminal status.  :class:`DeadlineExceededError` if not terminal within
        ``timeout``; :class:`RequestLostError` if its record and marker vanish after being seen (final:
        nothing writes a vanished request's record again but a stage's ``failed`` ``request_lost``);
        :class:`RequestNotFoundError` if it stays unknown for ``exists_within`` seconds (default
        :data:`UNKNOWN_GRACE_S`: a raw client's entry that no stage picked up, or an id never submitted).
        ``on_quiet`` runs after each quiet spell (a caller's own check, e.g. for its entry's refusal).
        ``seen``: the caller knows the request existed (it submitted it), so it is lost, not unknown, if
        it vanishes before this waiter first finds it.  Redis being unreachable is waited out within
        ``timeout``."""
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        last = "0-0"
        next_check = started + QUIET_CHECK_S * random.random()
        async with self.fanin.subscribe(self._keys.events(request_id)) as events:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise DeadlineExceededError("timed out waiting for the result", request_id=request_id)
                wait_s = BLOCK_MS / 1000 if deadline is None else min(BLOCK_MS / 1000, deadline - now)
                rows = await events.next_rows(min(wait_s, max(0.0, next_check - now)) or 0.001)
                for entry_id, fields in rows:
                    seen, last = True, entry_id
                    yield entry_id, fields
                    if _is_terminal(fields):
                        return
                if rows:  # it is heard from: the next check only after a quiet spell (no HGET per wait)
                    next_check = max(next_check, time.monotonic() + QUIET_CHECK_S * (0.75 + random.random() / 2))
                    continue
                if time.monotonic() < next_check:
                    continue
                next_check = time.monotonic() + QUIET_CHECK_S * (0.75 + random.random() / 2)
                try:  # a quiet spell: the events may have expired while the request ended, or Redis lost it
                    current = await self.get(request_id)
                    known = current is not None or await self.known(request_id)
                    # A terminal record's event went on the stream with it (one script) and may not have
                    # reached the shared reader yet: the rest of the trace is read here, not skipped.
                    ended = current is not None and current.state.terminal
                    rest = await self._rows_after(request_id, last) if ended else []
                except ControlPlaneError as exc:
                    if not is_transient_error(exc):
                        raise
                    continue  # Redis is away or busy: keep waiting within the deadline
                if ended:
                    for entry_id, fields in rest:
                        yield entry_id, fields
                        if _is_terminal(fields):
                            break
                    return
                now = time.monotonic()
                if known:
                    seen = True
                elif seen:
                    raise _lost(request_id)
                elif now - started >= (UNKNOWN_GRACE_S if exists_within is None else exists_within):
                    raise _not_found(request_id)
                if on_quiet is not None:
                    await on_quiet()

    async def _rows_after(self, request_id: str, last: str) -> list[Row]:
        """The trace's rows after entry ``last``, as the shared reader hands them out."""
        with translated():
            return text_rows(await self._redis.xrange(self._keys.events(request_id), min=f"({last}"))

    async def wait(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        on_quiet: Callable[[], Awaitable[None]] | None = None,
        exists_within: float | None = None,
        seen: bool = False,
    ) -> RequestStatus:
        """Block until the request is terminal (see :meth:`follow` for the errors and ``seen``); with
        ``exists_within=0`` an unknown id is :class:`RequestNotFoundError` at once."""
        status, _ = await self.wait_ended(
            request_id, timeout=timeout, on_quiet=on_quiet, exists_within=exists_within, seen=seen
        )
        return status

    async def wait_ended(
        self,
        request_id: str,
        *,
        timeout: float | None = None,
        on_quiet: Callable[[], Awaitable[None]] | None = None,
        exists_within: float | None = None,
        seen: bool = False,
    ) -> tuple[RequestStatus, str | None]:
        """:meth:`wait`, and the digest of the job the request ended as, when its terminal status event
        named it (``job_sha``: the entry-life scripts write it there); None when the status came from the
        record, or the event names no job (then :meth:`owner` tells, one HGET)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        # Redis away at the start is an outage like any other: waited out within the timeout.  A caller's
        # own submission (``seen``) is followed at once: its events from the first, its terminal status
        # among them, say what the record would (one HGET fewer per wait).
        own = seen and exists_within is None
        status = None if own else await self._get_retrying(request_id, deadline)
        at_once = status is None and exists_within is not None and exists_within <= 0
        if at_once and not await self._retrying(functools.partial(self.known, request_id), deadline):
            raise _not_found(request_id)
        if status is None or not status.state.terminal:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            last: dict[str, str] = {}
            async for _entry_id, fields in self.follow(
                request_id, timeout=remaining, on_quiet=on_quiet, exists_within=exists_within, seen=seen
            ):
                last = fields
            # The terminal status event carries the status JSON the same script wrote to the record (a
            # terminal status is written once): read it from there, not with one more HGET per wait.
            status = _terminal_status(last, request_id)
            if status is not None:
                return status, last.get("job_sha") or None
            status = await self._get_retrying(request_id, deadline)
        if status is None:  # its terminal event came, then the record went (expired, or Redis lost it)
            raise _lost(request_id)
        return status, None

    async def _get_retrying(self, request_id: str, deadline: float | None) -> RequestStatus | None:
        """:meth:`get`, retried (:func:`reconnecting`) while Redis is unreachable and ``deadline`` is ahead."""
        return await self._retrying(functools.partial(self.get, request_id), deadline)

    async def _retrying(self, op: Callable[[], Awaitable[T]], deadline: float | None) -> T:
        within = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
        async for attempt in reconnecting(within=within, event="request.status_retry"):
            with attempt:
                return await op()
        raise AssertionError("unreachable: reconnecting() returns or raises")


def _terminal_status(fields: Mapping[str, str], request_id: str) -> RequestStatus | None:
    """The status a terminal status event of ``request_id`` carries; None for any other row (or one that
    does not parse, or names another request: then the record is read instead, and judged)."""
    if fields.get("kind") != "status" or fields.get("state") not in TERMINAL_NAMES or "status" not in fields:
        return None
    try:
        status = RequestStatus.model_validate_json(fields["status"])
    except ValueError:
        return None
    return status if status.state.terminal and status.request_id == request_id else None


def _not_found(request_id: str) -> RequestNotFoundError:
    return RequestNotFoundError(f"no request {request_id} (unknown id, or expired)", request_id=request_id)


def _lost(request_id: str) -> RequestLostError:
    return RequestLostError(
        "the request is unknown, or was lost (did Redis restart without persistence?)", request_id=request_id
    )
