"""Request records in Redis: submit once, status transitions, terminal results written once, waiting.

A request's record is the hash ``<p>:req:<id>`` (``state`` and ``status`` JSON); every status change is
also appended to ``<p>:req:<id>:events``, so a waiter blocks on that stream (XREAD BLOCK) instead of
polling.  All transitions run as Lua scripts, so that a terminal state is written exactly once even
when two replicas race after a crash.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import BLOCK_MS, translated
from stageferry.broker.control.streams import WAKE_LUA
from stageferry.errors import DeadlineExceededError, QueueFullError
from stageferry.schemas import TERMINAL_STATES, JobRequest, RequestState, RequestStatus

log = structlog.get_logger(__name__)

_TERMINAL_NAMES = frozenset(state.value for state in TERMINAL_STATES)
_TERMINAL_LUA = "local t = {done=true, failed=true, rejected=true, cancelled=true}\n"

# KEYS: request hash, events stream. ARGV: state, status json, ttl, events maxlen.
# Returns 1 if written, 0 if the request is already terminal.
_SET_STATUS = (
    _TERMINAL_LUA
    + """
local cur = redis.call('HGET', KEYS[1], 'state')
if cur and t[cur] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'status', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'kind', 'status', 'state', ARGV[1], 'status', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: request hash, events stream, first stage stream, its wake list.
# ARGV: status json, ttl, events maxlen, request id, job json, stream max length.
# Returns 1 if submitted, 0 if the id is already known, -1 if the stage stream is full.
_SUBMIT = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('XLEN', KEYS[3]) >= tonumber(ARGV[6]) then return -1 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'status', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'kind', 'status', 'state', 'queued', 'status', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('XADD', KEYS[3], '*', 'request_id', ARGV[4], 'job', ARGV[5])
"""
    + WAKE_LUA
    + """
return 1
"""
)


class RequestStore:
    """Reads and writes request records under one key prefix."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int, events_maxlen: int) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl = ttl_s
        self._maxlen = events_maxlen
        self._set_status = redis.register_script(_SET_STATUS)
        self._submit = redis.register_script(_SUBMIT)

    async def submit(self, request_id: str, job: JobRequest, first_stage: str, *, stream_maxlen: int) -> bool:
        """Enqueue a job once: False if ``request_id`` was already submitted (nothing is enqueued)."""
        status = RequestStatus(request_id=request_id, state=RequestState.QUEUED, stage=first_stage)
        keys = [
            self._keys.request(request_id),
            self._keys.events(request_id),
            self._keys.stage_stream(first_stage),
            self._keys.wake(first_stage),
        ]
        args = [status.model_dump_json(), self._ttl, self._maxlen, request_id, job.model_dump_json(), stream_maxlen]
        with translated():
            result = int(await self._submit(keys=keys, args=args))
        if result < 0:
            raise QueueFullError("the first stage's queue is full; retry later", stage=first_stage)
        return result == 1

    async def set_status(self, status: RequestStatus) -> bool:
        """Write a status unless the request is already terminal; True if written."""
        rid = status.request_id
        with translated():
            written = await self._set_status(
                keys=[self._keys.request(rid), self._keys.events(rid)],
                args=[status.state.value, status.model_dump_json(), self._ttl, self._maxlen],
            )
        return bool(written)

    async def get(self, request_id: str) -> RequestStatus | None:
        with translated():
            raw = await self._redis.hget(self._keys.request(request_id), "status")
        return None if raw is None else RequestStatus.model_validate_json(raw)

    async def request_cancel(self, request_id: str) -> bool:
        """Flag the request; stages stop it at their next boundary. False if it is unknown or finished."""
        status = await self.get(request_id)
        if status is None or status.state.terminal:
            return False
        with translated():
            await self._redis.set(self._keys.cancel(request_id), b"1", ex=self._ttl)
        return True

    async def is_cancelled(self, request_id: str) -> bool:
        with translated():
            return bool(await self._redis.exists(self._keys.cancel(request_id)))

    async def append_event(self, request_id: str, event: dict[str, Any]) -> None:
        """Add one trace event (a structured log line) to the request's events stream."""
        body = json.dumps(event, default=str, separators=(",", ":"))
        key = self._keys.events(request_id)
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xadd(key, {"kind": "log", "event": body}, maxlen=self._maxlen, approximate=True)
                pipe.expire(key, self._ttl)
                await pipe.execute()

    async def events(self, request_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The request's whole trace, oldest first, as (entry id, fields) with JSON bodies decoded."""
        with translated():
            rows = await self._redis.xrange(self._keys.events(request_id))
        return [(eid.decode(), _decode_event(fields)) for eid, fields in rows]

    async def follow(
        self, request_id: str, *, timeout: float | None = None
    ) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """Yield the request's events (entry id, fields) as they arrive, from the first, by blocking reads;
        stop after a terminal status.  :class:`DeadlineExceededError` if not terminal within ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last_id = "0-0"
        key = self._keys.events(request_id)
        while True:
            block = BLOCK_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceededError("timed out waiting for the result", request_id=request_id)
                block = max(1, min(BLOCK_MS, int(remaining * 1000)))
            with translated():
                reply = await self._redis.xread({key: last_id}, block=block, count=100)
            for _stream, rows in reply or []:
                for raw_id, raw_fields in rows:
                    last_id = raw_id.decode()
                    fields = {k.decode(): v.decode(errors="replace") for k, v in raw_fields.items()}
                    yield last_id, fields
                    if fields.get("kind") == "status" and fields.get("state") in _TERMINAL_NAMES:
                        return
            if not reply:  # a quiet spell: the events may have expired while the request ended
                current = await self.get(request_id)
                if current is not None and current.state.terminal:
                    return

    async def wait(self, request_id: str, *, timeout: float | None = None) -> RequestStatus:
        """Block (XREAD BLOCK on the events stream, no polling) until the request is terminal."""
        status = await self.get(request_id)
        if status is None or not status.state.terminal:
            async for _event in self.follow(request_id, timeout=timeout):
                pass
            status = await self.get(request_id)
        assert status is not None
        return status


def _decode_event(fields: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
    for name in ("event", "status"):
        if name in out:
            try:
                out[name] = json.loads(out[name])
            except ValueError:
                pass
    return out
