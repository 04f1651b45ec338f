"""Refusal records: how a raw client learns that the first stage refused its entry.

Most bad submissions end in the request's own status (``rejected`` with field errors).  Some cannot:
when the entry's ``request_id`` breaks the id rule, or names another tenant, the stage must not write
anything under that id — it may be a victim's.  Such an entry is dead-lettered, and its refusal is
recorded under the one name its submitter knows and nobody else chose: the *stream entry id* that its
``XADD`` returned (ids are assigned by Redis, unique in the stream, and cannot name a request's keys)::

    <p>:refused:<entry-id>              an entry of the shared first-stage stream
    <p>:refused:<tenant>.<entry-id>     an entry of tenant <tenant>'s intake stream

Each is a hash, kept for the request TTL: ``code`` (``invalid_request_id``, ``tenant_mismatch``,
``invalid_envelope``), ``message``, ``entry``, ``stream`` and ``request_id`` (printable ASCII only,
cut at 160 characters, for the submitter to recognise).  A client reads it with ``HGETALL``; a tenant's
ACL user can read only its own (``~<p>:refused:<tenant>.*``).  Schema version: ``version`` field, 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.errors import SubmissionRefusedError, error_from_code

log = structlog.get_logger(__name__)

#: Version of the refusal record's fields (bump when they change meaning).
REFUSAL_VERSION = 1
_MAX_SHOWN_ID = 160


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refusal record, as a client reads it."""

    entry: str
    code: str
    message: str
    request_id: str
    stream: str
    at: float

    def error(self) -> SubmissionRefusedError:
        """The typed error this refusal stands for."""
        error = error_from_code(self.code, self.message, {"entry": self.entry, "request_id": self.request_id})
        if isinstance(error, SubmissionRefusedError):
            return error
        return SubmissionRefusedError(self.message, reason_code=self.code, entry=self.entry)


def shown_id(raw: bytes | None) -> str:
    """A hostile id made safe to show back: printable ASCII only, bounded."""
    if raw is None:
        return ""
    text = raw[: _MAX_SHOWN_ID * 4].decode("utf-8", errors="replace")
    return "".join(c if 0x20 <= ord(c) < 0x7F else "?" for c in text)[:_MAX_SHOWN_ID]


class Refusals:
    """Writes (stages) and reads (clients) refusal records under one prefix."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl = ttl_s

    async def record(
        self, entry_id: str, *, tenant: str | None, stream: str, error: SubmissionRefusedError, request_id: bytes | None
    ) -> None:
        """Record why ``entry_id`` was refused (the stage calls this, then dead-letters the entry)."""
        key = self._keys.refused(entry_id, tenant)
        fields = {
            "version": str(REFUSAL_VERSION),
            "entry": entry_id,
            "code": error.code,
            "message": error.message[:1000],
            "request_id": shown_id(request_id),
            "stream": stream,
            "at": f"{time.time():.3f}",
        }
        with translated():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
                pipe.expire(key, self._ttl)
                await pipe.execute()
        log.warning("submission.refused", entry=entry_id, code=error.code, tenant=tenant)

    async def get(self, entry_id: str, tenant: str | None = None) -> Refusal | None:
        """The refusal of ``entry_id``, or None if it was not refused (or not yet looked at)."""
        with translated():
            raw = await self._redis.hgetall(self._keys.refused(entry_id, tenant))
        if not raw:
            return None
        fields = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        return Refusal(
            entry=fields.get("entry", entry_id),
            code=fields.get("code", SubmissionRefusedError.code),
            message=fields.get("message", ""),
            request_id=fields.get("request_id", ""),
            stream=fields.get("stream", ""),
            at=float(fields.get("at", "0") or 0),
        )


__all__ = ["REFUSAL_VERSION", "Refusal", "Refusals", "shown_id"]
