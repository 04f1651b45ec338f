"""The console's list of recent requests: a capped stream of the job ids the gateways accepted.

Listing requests by scanning ``<p>:req:*`` would walk the whole keyspace on every page load; instead each
accepted job appends its id to ``<p>:gateway:recent`` (:meth:`Keys.recent_videos`), trimmed to
:data:`RECENT_MAX` entries, shared by every gateway of the deployment.  A stream rather than a list or a
sorted set because the stage ACL user already has XADD/XRANGE (``compose/redis-acl.conf``).  Reading it
costs one XRANGE and one pipelined round trip for the statuses and the gateway's job records.
"""

from __future__ import annotations

from pydantic import ValidationError
from redis.asyncio.client import Pipeline

from stageferry.broker.control.redis_conn import translated
from stageferry.client import Client
from stageferry.gateway.objects import VideoMeta, progress_percent
from stageferry.schemas import RequestStatus
from stageferry.schemas.console import RecentReport, RecentRequest

#: Ids kept in the recent stream.
RECENT_MAX = 200


def record(pipe: Pipeline, client: Client, request_id: str) -> None:
    """Note an accepted job (newest last) on ``pipe``; the oldest fall off past :data:`RECENT_MAX`."""
    pipe.xadd(client.keys.recent_videos(), {"id": request_id}, maxlen=RECENT_MAX, approximate=False)


async def recent(client: Client, *, limit: int) -> RecentReport:
    """The newest ``limit`` jobs still known (expired ones drop out), newest first."""
    with translated():
        rows = await client.redis.xrange(client.keys.recent_videos())
    ids: list[str] = []
    for _entry, fields in reversed(rows):
        rid = fields.get(b"id", b"").decode(errors="replace")
        if rid and rid not in ids:
            ids.append(rid)
        if len(ids) >= limit:
            break
    if not ids:
        return RecentReport()
    keys = client.keys
    with translated():
        async with client.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.hget(keys.request(rid), "status")
                pipe.get(keys.video_meta(rid))
            replies = await pipe.execute()
    stages = [s.name for s in client.pipeline.stages]
    out: list[RecentRequest] = []
    for i, rid in enumerate(ids):
        raw_status, raw_meta = replies[2 * i], replies[2 * i + 1]
        try:
            status = RequestStatus.model_validate_json(raw_status) if raw_status else None
            meta = VideoMeta.model_validate_json(raw_meta) if raw_meta else None
        except ValidationError:  # a record that is not ours: skip it rather than fail the page
            continue
        if status is None or (meta is not None and meta.deleted_at is not None):  # deleted: gone, as in the API
            continue
        out.append(
            RecentRequest(
                id=rid,
                state=status.state.value,
                stage=status.stage,
                progress=progress_percent(status, stages),
                prompt=meta.prompt[:200] if meta is not None else None,
                created_at=meta.created_at if meta is not None else None,
                error_code=status.error.code if status.error is not None else None,
            )
        )
    return RecentReport(requests=out)
