"""``GET /v1/videos``: the caller's video jobs, newest (or oldest) first, in OpenAI's cursor pages.

Each job a gateway accepts is appended to its tenant's video index
(:class:`~stageferry.broker.control.video_index.VideoIndex`), so a gateway lists only its own tenant's jobs.
The index's entry ids order the jobs by acceptance time; each job's gateway record
(:class:`~stageferry.schemas.video_record.VideoMeta`) keeps its entry id, so a page that ends at video
``X`` resumes with ``after=X`` at an exclusive range bound — one XRANGE/XREVRANGE per page, however long
the index.  The index is trimmed, with every append, to the request TTL: expired jobs fall off; a deleted
job's entry is removed at once (its record stays, as a tombstone, so that a cursor naming it still works).
The same round trip notes the job in the console's recent list (:mod:`.recent`).
"""

from __future__ import annotations

from dataclasses import dataclass

from stageferry.broker.control.video_index import Order, VideoIndex
from stageferry.broker.control.video_records import VideoRecords, VideoView
from stageferry.client import Client
from stageferry.gateway.errors import invalid
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.video_record import VideoMeta

#: OpenAI's bounds for ``limit``.
DEFAULT_LIMIT = 20
MAX_LIMIT = 100


@dataclass(frozen=True, slots=True)
class Listed:
    """One job of a page: its status and its gateway record."""

    status: RequestStatus
    meta: VideoMeta


@dataclass(frozen=True, slots=True)
class Page:
    items: list[Listed]
    has_more: bool


def video_index(client: Client) -> VideoIndex:
    """The client's tenant's video index (and the deployment's recent list)."""
    return VideoIndex(client.redis, client.keys, tenant=client.tenant, ttl_s=client.pipeline.retention.request_ttl_s)


def video_records(client: Client) -> VideoRecords:
    """The gateway's records and previews of the client's deployment."""
    return VideoRecords(client.redis, client.keys, ttl_s=client.pipeline.retention.request_ttl_s)


async def page(client: Client, *, limit: int, order: Order, after: VideoMeta | None) -> Page:
    """Up to ``limit`` jobs still known, after ``after``'s entry (exclusive), in ``order``.

    Entries whose job expired (or whose record is not ours) are skipped, reading on until the page is
    full or the index ends; ``has_more`` says whether anything lies beyond the last one returned."""
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid("limit", f"must be between 1 and {MAX_LIMIT}", "limit")
    index, records = video_index(client), video_records(client)
    first = client.pipeline.stages[0].name
    cursor = after.index_entry if after is not None and after.index_entry else None
    items: list[Listed] = []
    while True:
        entries = await index.read(order=order, after=cursor, count=limit)
        views = await records.views([e.request_id for e in entries], submitted=True)
        for entry, view in zip(entries, views, strict=True):
            cursor = entry.entry
            found = _listed(view, first)
            if found is not None:
                items.append(found)
                if len(items) == limit:
                    return Page(items, has_more=await index.any_after(order=order, after=cursor))
        if len(entries) < limit:
            return Page(items, has_more=False)


def _listed(view: VideoView, first_stage: str) -> Listed | None:
    """The job as a page lists it; ``None`` where its status or record is gone, deleted or not ours.  A job
    that only its "submitted" marker shows yet is queued at the first stage (as in ``Client.status``)."""
    if view.unreadable or view.record is None or view.record.deleted_at is not None:
        return None
    status = view.status
    if status is None and view.submitted:
        status = RequestStatus(request_id=view.request_id, state=RequestState.QUEUED, stage=first_stage)
    return Listed(status, view.record) if status is not None else None
