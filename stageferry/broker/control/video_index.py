"""The gateway's streams of the jobs it accepted: the video index ``GET /v1/videos`` pages through, and
the console's recent list — typed replies.

The index is a stream at ``<p>:gateway:videos`` (``<p>:gateway:videos:<tenant>`` for a tenant's gateway,
:meth:`Keys.video_index`) of ``{"id": <request id>}`` entries; its entry ids order the jobs by acceptance
time, and every append trims entries older than the request TTL (``MINID``).  The recent list is a stream
at ``<p>:gateway:recent`` (:meth:`Keys.recent_videos`), shared by every gateway of the deployment and
capped at :data:`RECENT_MAX` entries.  Streams rather than lists or sorted sets because the stage ACL user
already has XADD/XRANGE (``compose/redis-acl.conf``).  Redis errors come out as
:class:`~stageferry.errors.ControlPlaneError` (translated here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated

#: Ids kept in the recent stream.
RECENT_MAX = 200

Order = Literal["asc", "desc"]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One entry of the index: its stream id and the job it names (``""`` when it names none)."""

    entry: str
    request_id: str


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _entries(rows: list[tuple[bytes, dict[bytes, bytes]]]) -> list[IndexEntry]:
    return [IndexEntry(_text(entry), _text(fields.get(b"id", b""))) for entry, fields in rows]


class VideoIndex:
    """One tenant's video index, and the deployment's recent list."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, tenant: str | None, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._index = keys.video_index(tenant)
        self._ttl_ms = ttl_s * 1000

    async def append(self, request_id: str) -> str:
        """Index an accepted job and note it in the recent list (one round trip); its index entry id."""
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                minid = max(0, int(time.time() * 1000) - self._ttl_ms)
                pipe.xadd(self._index, {"id": request_id}, minid=minid, approximate=True)
                pipe.xadd(self._keys.recent_videos(), {"id": request_id}, maxlen=RECENT_MAX, approximate=False)
                entry, _ = await pipe.execute()
        return _text(entry)

    async def remove(self, entry: str) -> None:
        """Drop one entry (a deleted job's) from the index."""
        with translated():
            await self._redis.xdel(self._index, entry)

    async def read(self, *, order: Order, after: str | None, count: int) -> list[IndexEntry]:
        """Up to ``count`` entries in ``order``, after the entry id ``after`` (exclusive; from the start
        when ``None``)."""
        bound = f"({after}" if after else None
        with translated():
            if order == "desc":
                rows = await self._redis.xrevrange(self._index, max=bound or "+", min="-", count=count)
            else:
                rows = await self._redis.xrange(self._index, min=bound or "-", max="+", count=count)
        return _entries(rows)

    async def any_after(self, *, order: Order, after: str) -> bool:
        """Whether any entry lies beyond the entry id ``after`` in ``order``."""
        return bool(await self.read(order=order, after=after, count=1))

    async def recent(self, *, limit: int) -> list[str]:
        """The newest ``limit`` distinct job ids of the recent list, newest first."""
        with translated():
            rows = await self._redis.xrange(self._keys.recent_videos())
        ids: list[str] = []
        for item in reversed(_entries(rows)):
            if len(ids) >= limit:
                break
            if item.request_id and item.request_id not in ids:
                ids.append(item.request_id)
        return ids


__all__ = ["RECENT_MAX", "IndexEntry", "Order", "VideoIndex"]
