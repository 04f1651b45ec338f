"""Refusal records: how a client learns that the first stage refused its submission.

Most bad submissions end in the request's own status too (``rejected`` with field errors).  Some cannot:
when the submission's ``request_id`` breaks the id rule, names another tenant, or already belongs to a
different job, the stage must not write anything under that id — it may be a victim's.  So every refused
submission is recorded under the one name its submitter knows and nobody else chose: the submission's
*ticket*, 128 random bits it sent with the job (:mod:`stageferry.schemas.submission`)::

    <p>:refused:<ticket>              a submission from the single-tenant intake
    <p>:refused:<tenant>.<ticket>     a submission from tenant <tenant>'s intake

Each is a hash, kept for the request TTL: ``code`` (``invalid_request_id``, ``tenant_mismatch``,
``submission_refused``, ``request_id_taken``, ``invalid_job``, ...), ``message``, ``ticket``, ``entry``
(the stream entry the stage moved it to), ``stream`` and ``request_id`` (printable ASCII only, cut at 160
characters, for the submitter to recognise).  The first refusal of a ticket is kept (a later one does not
overwrite it).  A client reads it with ``HGETALL``; a tenant's ACL user can read only its own
(``~<p>:refused:<tenant>.*``).  Schema version: ``version`` field, 2 (1 was keyed by the stream entry id,
when clients added entries themselves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.errors import RejectedError, SubmissionRefusedError, error_from_code

log = structlog.get_logger(__name__)

#: Version of the refusal record's fields (bump when they change meaning).
REFUSAL_VERSION = 2
_MAX_SHOWN_ID = 160


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refusal record, as a client reads it."""

    ticket: str
    entry: str
    code: str
    message: str
    request_id: str
    stream: str
    at: float

    def error(self) -> RejectedError:
        """The typed error this refusal stands for."""
        error = error_from_code(self.code, self.message, {"ticket": self.ticket, "request_id": self.request_id})
        if isinstance(error, RejectedError):
            return error
        return SubmissionRefusedError(self.message, reason_code=self.code, ticket=self.ticket)


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
        self,
        ticket: str,
        *,
        entry_id: str,
        tenant: str | None,
        stream: str,
        error: RejectedError,
        request_id: bytes | None,
    ) -> None:
        """Record why the submission with ``ticket`` was refused (the stage calls this, then settles the
        entry); a ticket refused before keeps its first record."""
        key = self._keys.refused(ticket, tenant)
        fields = {
            "version": str(REFUSAL_VERSION),
            "ticket": ticket,
            "entry": entry_id,
            "code": error.code,
            "message": error.message[:1000],
            "request_id": shown_id(request_id),
            "stream": stream,
            "at": f"{time.time():.3f}",
        }
        with translated():
            if await self._redis.exists(key):
                return  # the ticket's first refusal stands
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=fields)
                pipe.expire(key, self._ttl)
                await pipe.execute()
        log.warning("submission.refused", entry=entry_id, ticket=ticket, code=error.code, tenant=tenant)

    async def get(self, ticket: str, tenant: str | None = None) -> Refusal | None:
        """The refusal of the submission with ``ticket``, or None if it was not refused (or not yet looked at)."""
        with translated():
            raw = await self._redis.hgetall(self._keys.refused(ticket, tenant))
        if not raw:
            return None
        fields = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        return Refusal(
            ticket=fields.get("ticket", ticket),
            entry=fields.get("entry", ""),
            code=fields.get("code", SubmissionRefusedError.code),
            message=fields.get("message", ""),
            request_id=fields.get("request_id", ""),
            stream=fields.get("stream", ""),
            at=float(fields.get("at", "0") or 0),
        )


__all__ = ["REFUSAL_VERSION", "Refusal", "Refusals", "shown_id"]
