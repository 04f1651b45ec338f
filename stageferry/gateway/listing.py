"""``GET /v1/videos``: the caller's video jobs, newest (or oldest) first, in OpenAI's cursor pages.

Each job a gateway accepts is appended to the deployment's video index, a stream at
``<p>:gateway:videos`` (``<p>:gateway:videos:<tenant>`` for a tenant's gateway, :meth:`Keys.video_index`),
so a gateway lists only its own tenant's jobs.  The stream's entry ids order the jobs by acceptance
time; each job's gateway record (:class:`~.objects.VideoMeta`) keeps its entry id, so a page that ends
at video ``X`` resumes with ``after=X`` at an exclusive range bound — one XRANGE/XREVRANGE per page,
however long the index.  The index is trimmed, with every append, to the request TTL (``MINID``):
expired jobs fall off; a deleted job's entry is removed at once (its record stays, as a tombstone, so
that a cursor naming it still works).  The same round trip notes the job in the console's recent list
(:mod:`.recent`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from stageferry.broker.control.redis_conn import translated
from stageferry.client import Client
from stageferry.gateway import recent
from stageferry.gateway.errors import invalid
from stageferry.gateway.objects import VideoMeta
from stageferry.schemas import RequestState, RequestStatus

#: OpenAI's bounds for ``limit``.
DEFAULT_LIMIT = 20
MAX_LIMIT = 100

Order = Literal["asc", "desc"]


@dataclass(frozen=True, slots=True)
class Listed:
    """One job of a page: its status and its gateway record."""

    status: RequestStatus
    meta: VideoMeta


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Listed]
    has_more: bool


def index_key(client: Client) -> str:
    return client.keys.video_index(client.tenant)


async def append(client: Client, request_id: str) -> str:
    """Index an accepted job (its entry id comes back, for its record), and note it in the console's recent
    list, in one round trip; index entries older than the request TTL are trimmed in the same command."""
    ttl_ms = client.pipeline.retention.request_ttl_s * 1000
    with translated():
        async with client.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(
                index_key(client), {"id": request_id}, minid=max(0, int(time.time() * 1000) - ttl_ms), approximate=True
            )
            recent.record(pipe, client, request_id)
            entry, _ = await pipe.execute()
    return entry.decode() if isinstance(entry, bytes) else str(entry)


async def remove(client: Client, entry: str) -> None:
    with translated():
        await client.redis.xdel(index_key(client), entry)


async def page(client: Client, *, limit: int, order: Order, after: VideoMeta | None) -> Page:
    """Up to ``limit`` jobs still known, after ``after``'s entry (exclusive), in ``order``.

    Entries whose job expired (or whose record is not ours) are skipped, reading on until the page is
    full or the index ends; ``has_more`` says whether anything lies beyond the last one returned."""
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid("limit", f"must be between 1 and {MAX_LIMIT}", "limit")
    key = index_key(client)
    cursor = f"({after.index_entry}" if after is not None and after.index_entry else None
    items: list[Listed] = []
    while True:
        with translated():
            if order == "desc":
                rows = await client.redis.xrevrange(key, max=cursor or "+", min="-", count=limit)
            else:
                rows = await client.redis.xrange(key, min=cursor or "-", max="+", count=limit)
        ids = [fields.get(b"id", b"").decode(errors="replace") for _entry, fields in rows]
        for (entry, _fields), found in zip(rows, await _load(client, ids), strict=True):
            cursor = f"({entry.decode()}"
            if found is not None:
                items.append(found)
                if len(items) == limit:
                    return Page(items, has_more=await _any_beyond(client, key, cursor, order))
        if len(rows) < limit:
            return Page(items, has_more=False)


async def _any_beyond(client: Client, key: str, cursor: str, order: Order) -> bool:
    with translated():
        if order == "desc":
            return bool(await client.redis.xrevrange(key, max=cursor, min="-", count=1))
        return bool(await client.redis.xrange(key, min=cursor, max="+", count=1))


async def _load(client: Client, request_ids: list[str]) -> list[Listed | None]:
    """Each job's status and record (one round trip), ``None`` where either is gone, deleted or not ours;
    a job that only its "submitted" marker shows yet is queued at the first stage (as in ``Client.status``)."""
    if not request_ids:
        return []
    keys = client.keys
    with translated():
        async with client.redis.pipeline(transaction=False) as pipe:
            for rid in request_ids:
                pipe.hget(keys.request(rid), "status")
                pipe.exists(keys.submitted(rid))
                pipe.get(keys.video_meta(rid))
            replies = await pipe.execute()
    first = client.pipeline.stages[0].name
    out: list[Listed | None] = []
    for rid, raw_status, submitted, raw_meta in zip(
        request_ids, replies[::3], replies[1::3], replies[2::3], strict=True
    ):
        try:
            status = RequestStatus.model_validate_json(raw_status) if raw_status else None
            meta = VideoMeta.model_validate_json(raw_meta) if raw_meta else None
        except ValidationError:
            status = meta = None
        if status is None and submitted:
            status = RequestStatus(request_id=rid, state=RequestState.QUEUED, stage=first)
        out.append(Listed(status, meta) if status and meta and meta.deleted_at is None else None)
    return out
