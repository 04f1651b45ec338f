"""The console's list of recent requests: the newest job ids the gateways accepted, with their states.

Listing requests by scanning ``<p>:req:*`` would walk the whole keyspace on every page load; instead each
accepted job is noted in the deployment's recent list (:class:`~stageferry.broker.control.video_index.VideoIndex`,
capped at :data:`~stageferry.broker.control.video_index.RECENT_MAX` ids), shared by every gateway of the
deployment.  Reading it costs one XRANGE and one pipelined round trip for the statuses and the gateway's
job records (:meth:`~stageferry.broker.control.video_records.VideoRecords.views`).
"""

from __future__ import annotations

from stageferry.client import Client
from stageferry.gateway.listing import video_index, video_records
from stageferry.gateway.objects import progress_percent
from stageferry.schemas.console_api import RecentReport, RecentRequest


async def recent(client: Client, *, limit: int) -> RecentReport:
    """The newest ``limit`` jobs still known (expired ones drop out), newest first."""
    ids = await video_index(client).recent(limit=limit)
    if not ids:
        return RecentReport()
    stages = [s.name for s in client.pipeline.stages]
    out: list[RecentRequest] = []
    for view in await video_records(client).views(ids):
        status, meta = view.status, view.record
        if view.unreadable:  # a record that is not ours: skip it rather than fail the page
            continue
        if status is None or (meta is not None and meta.deleted_at is not None):  # deleted: gone, as in the API
            continue
        out.append(
            RecentRequest(
                id=view.request_id,
                state=status.state.value,
                stage=status.stage,
                progress=progress_percent(status, stages),
                prompt=meta.prompt[:200] if meta is not None else None,
                created_at=meta.created_at if meta is not None else None,
                error_code=status.error.code if status.error is not None else None,
            )
        )
    return RecentReport(requests=out)
