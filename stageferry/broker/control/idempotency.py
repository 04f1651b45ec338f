"""The gateway's ``Idempotency-Key`` records in Redis: claim one, look it up, release it — typed replies.

One record per key digest at ``<p>:idem:<digest>`` (:meth:`Keys.idempotency`), an
:class:`~stageferry.schemas.idempotency.IdempotencyRecord` that names the request the key created and
what was asked for (its fingerprint), kept ``ttl_s``.  It is claimed with ``SET NX`` before the job is
enqueued, so two retries racing each other make one job.  No Lua: the client ACL user may not run scripts.
Redis errors come out as :class:`~stageferry.errors.ControlPlaneError` (translated here); what a claim
means for the HTTP answer is the gateway's (:mod:`stageferry.gateway.idempotency`).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.schemas.idempotency import IdempotencyRecord


@dataclass(frozen=True, slots=True)
class Claim:
    """The reply of :meth:`IdempotencyRecords.claim`: ``claimed`` (the key is ours now), else the record
    that already holds it (``existing``; ``None`` with ``unreadable`` when it does not parse)."""

    claimed: bool
    existing: IdempotencyRecord | None = None
    unreadable: bool = False


class IdempotencyRecords:
    """Claims, looks up and releases key records under one prefix."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s

    async def claim(self, digest: str, record: IdempotencyRecord) -> Claim:
        """Make the key ``digest`` hold ``record`` unless it holds one already (then: that one)."""
        name = self._keys.idempotency(digest)
        while True:
            with translated():
                if await self._redis.set(name, record.model_dump_json(), nx=True, ex=self._ttl_s):
                    return Claim(claimed=True)
                raw = await self._redis.get(name)
            if raw is None:  # expired between the two commands: claim again
                continue
            try:
                return Claim(claimed=False, existing=IdempotencyRecord.model_validate_json(raw))
            except ValidationError:
                return Claim(claimed=False, unreadable=True)

    async def release(self, digest: str, request_id: str) -> bool:
        """Forget the key ``digest`` if it still names ``request_id``; whether it did."""
        name = self._keys.idempotency(digest)
        with translated():
            raw = await self._redis.get(name)
            if raw is None or _request_of(raw) != request_id:
                return False
            await self._redis.delete(name)
        return True


def _request_of(raw: bytes) -> str | None:
    try:
        return IdempotencyRecord.model_validate_json(raw).request_id
    except ValidationError:
        return None


__all__ = ["Claim", "IdempotencyRecords"]
