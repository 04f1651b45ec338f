"""``Idempotency-Key``: a client that retries a request it is unsure about attaches to the same job.

A sync request whose answer was lost (a timeout on the client's side, a dropped connection, a 503 from a
Redis blip) leaves the client unsure whether its job runs.  Retrying it blindly runs it twice.  With an
``Idempotency-Key: <opaque>`` header the gateway remembers which request the key created, at
``<p>:idem:<digest>`` for ``request_ttl_s`` (the request's own lifetime), and a retry with the same key
gets that request — waited on again for ``/v1/videos/sync``, described again for ``/v1/videos`` —
instead of a new one.

- Keys are scoped to the caller: the digest covers the ``Authorization`` header's digest (anonymous
  callers share one scope) and the key, so two API keys never see each other's jobs by guessing keys.
- A key reused for a *different* request (another prompt, other media) is refused with 422
  ``idempotency_key_reused``, as a mistaken reuse must not silently return someone else's video.
- A submission that fails (queue full, invalid job) releases its key, so the retry can submit.

The record (:mod:`stageferry.broker.control.idempotency`) is claimed with ``SET NX`` before the job is
enqueued, so two retries racing each other still make one job.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from stageferry.broker.control.idempotency import IdempotencyRecords
from stageferry.broker.control.keys import Keys
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError, invalid
from stageferry.schemas.idempotency import IdempotencyRecord

HEADER = "Idempotency-Key"
#: Printable ASCII without spaces, as the IETF draft's examples; long enough for a UUID or a hash.
KEY_PATTERN = re.compile(r"[\x21-\x7e]{1,255}")


def fingerprint(job: Mapping[str, Any], uploads: Mapping[str, bytes]) -> str:
    """A digest of what was asked for: the job and every uploaded file."""
    digest = hashlib.sha256(json.dumps(job, sort_keys=True, separators=(",", ":"), default=str).encode())
    for name in sorted(uploads):
        digest.update(b"\0" + name.encode() + b"\0" + hashlib.sha256(uploads[name]).digest())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class IdempotencyKey:
    """A checked key and the caller's scope."""

    scope: str
    key: str

    @classmethod
    def from_headers(cls, key: str | None, authorization: str | None) -> IdempotencyKey | None:
        if key is None:
            return None
        if not KEY_PATTERN.fullmatch(key):
            raise invalid(HEADER, "must be 1-255 printable ASCII characters without spaces", "idempotency_key")
        scope = "anonymous" if not authorization else hashlib.sha256(authorization.encode()).hexdigest()
        return cls(scope, key)

    def digest(self) -> str:
        return hashlib.sha256(f"{self.scope}\0{self.key}".encode()).hexdigest()


class IdempotencyStore:
    """The HTTP side of key records (:class:`~stageferry.broker.control.idempotency.IdempotencyRecords`):
    a key held for something else is a 409 or a 422."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self._records = IdempotencyRecords(redis, keys, ttl_s=ttl_s)

    async def claim(self, key: IdempotencyKey, request_id: str, print_: str) -> str | None:
        """Make ``key`` name ``request_id``; ``None`` if claimed now, else the request it already names.

        422 when the key already names a request for something else (another fingerprint)."""
        claim = await self._records.claim(key.digest(), IdempotencyRecord(request_id=request_id, fingerprint=print_))
        if claim.claimed:
            return None
        if claim.existing is None:
            message = f"the record of this {HEADER} is unreadable; use another key"
            raise ApiError.of(GatewayCode.IDEMPOTENCY_KEY_UNUSABLE, message)
        existing = claim.existing
        if existing.fingerprint != print_:
            raise ApiError.of(
                GatewayCode.IDEMPOTENCY_KEY_REUSED,
                f"{HEADER} was already used for a different request ({existing.request_id})",
                headers={"X-Request-Id": existing.request_id},
            )
        return existing.request_id

    async def release(self, key: IdempotencyKey, request_id: str) -> None:
        """Forget ``key`` if it still names ``request_id`` (its submission failed: a retry may submit)."""
        await self._records.release(key.digest(), request_id)


__all__ = ["HEADER", "IdempotencyKey", "IdempotencyStore", "fingerprint"]
