"""The gateway's operations on the pipeline, through one :class:`~stageferry.client.Client`.

Routes stay thin: they parse HTTP and call these.  Validation is the project's own — the schema
(:func:`~stageferry.client.validate_job`) and the deployment limits
(:func:`~stageferry.schemas.validation.check_job_limits`, the same check the first stage runs) — so a bad
step count or LoRA is a 400 before anything is enqueued.  Media are checked by the first stage; a
synchronous request whose job that stage rejects gets the same 400 with the same field names.

Besides the request's own keys, the gateway keeps one small record per job it accepted, at
``<p>:req-video:<id>`` (:class:`~stageferry.schemas.video_record.VideoMeta`: model, prompt, size, seconds,
created_at; same TTL as the request), so that a video object can echo what was asked for.  Its Redis work
(records, previews, the video index) is :mod:`stageferry.broker.control`'s
(:mod:`~stageferry.broker.control.video_records`, :mod:`~stageferry.broker.control.video_index`).
"""

from __future__ import annotations

import contextlib
import re
import time

import anyio
import structlog

from stageferry.broker.control.liveness import FRESH_S, unheld_note
from stageferry.broker.control.video_index import Order
from stageferry.client import Client, new_request_id, validate_job, with_upload_refs
from stageferry.errors import ControlPlaneError, QueueFullError, RejectedError, StageferryError
from stageferry.gateway import listing
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError, clip, from_exception, from_status_error, invalid, with_request_id
from stageferry.gateway.form import MappedJob
from stageferry.gateway.idempotency import IdempotencyKey, IdempotencyStore, fingerprint
from stageferry.gateway.objects import VideoDeleted, VideoList, VideoObject, video_object
from stageferry.gateway.previews import PreviewError, Previews, render
from stageferry.gateway.results import ResultFile, ResultFiles, ResultRefused, refuse_logged
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.job import REQUEST_ID_PATTERN, tenant_of
from stageferry.schemas.validation import check_job_limits
from stageferry.schemas.video_record import VideoMeta

log = structlog.get_logger(__name__)


class VideoService:
    """Submit, wait for, describe, fetch and delete video jobs of one deployment."""

    def __init__(
        self, client: Client, *, model_name: str, results: ResultFiles | None = None, fresh_s: float = FRESH_S
    ) -> None:
        self.client = client
        #: A stage counts as live while a worker's heartbeat is at most this old.
        self.fresh_s = fresh_s
        self.model_name = model_name
        #: Where result files too large for Redis may be served from (nowhere else, whatever a status says).
        self.results = results or ResultFiles(client.pipeline.output_dir)
        self.idempotency = IdempotencyStore(client.redis, client.keys, ttl_s=client.pipeline.retention.request_ttl_s)
        self.stages = [s.name for s in client.pipeline.stages]
        self.records = listing.video_records(client)
        self.index = listing.video_index(client)
        #: One preview rendering at a time per gateway (each decodes a whole video).
        self._rendering = anyio.Lock()

    async def submit(
        self, mapped: MappedJob, *, id_kind: str = "video_sync", idempotency: IdempotencyKey | None = None
    ) -> tuple[str, bool]:
        """Check the job as the first stage would, enqueue it with its media: (request id, created); the id
        is ``<id_kind>-<hex>`` (``video_sync`` for synchronous requests, ``video`` for async jobs).

        With an ``Idempotency-Key`` already used for the same request, nothing is enqueued and the
        earlier request's id comes back (``created`` False); see :mod:`.idempotency`."""
        limits = self.client.pipeline.limits
        keys = self.client.keys
        try:
            refs = {name: keys.upload("precheck", name) for name in mapped.uploads}
            checked = validate_job(with_upload_refs(mapped.job, refs), limits)
            check_job_limits(checked, limits, upload_prefix=keys.upload_prefix())
            rid, created = new_request_id(self.client.tenant, kind=id_kind), True
            asked_at = int(time.time())  # before the submission: a fast job may end before its record is put
            if idempotency is not None:
                earlier = await self.idempotency.claim(idempotency, rid, fingerprint(mapped.job, mapped.uploads))
                rid, created = (earlier, False) if earlier is not None else (rid, True)
            try:  # a retry after an unclear first attempt makes sure the job is in, under the same id
                if created or await self.client.status(rid) is None:
                    await self.client.submit(mapped.job, request_id=rid, uploads=mapped.uploads)
            except (RejectedError, QueueFullError):
                if idempotency is not None and created:  # refused for sure: the retry may submit anew
                    with anyio.CancelScope(shield=True), contextlib.suppress(StageferryError):
                        await self.idempotency.release(idempotency, rid)
                raise
            except ControlPlaneError as exc:  # it may have been enqueued: name it, so it can be followed
                raise with_request_id(from_exception(exc), rid) from exc
        except StageferryError as exc:
            raise from_exception(exc, origin=mapped.origin) from exc
        try:
            meta = VideoMeta(
                model=mapped.model or self.model_name,
                prompt=checked.prompt,
                size=f"{checked.width}x{checked.height}",
                seconds=f"{checked.frame_count / checked.fps:g}",
                origin=mapped.origin,
                task=checked.task.value,
                index_entry=await self.index.append(rid) if created else None,
                created_at=asked_at,
            )
            await self.records.put(rid, meta, only_new=not created)
        except StageferryError as exc:  # the job is in: the answer must still name it
            raise with_request_id(from_exception(exc), rid) from exc
        return rid, created

    async def status(self, request_id: str) -> RequestStatus:
        """The request's status; 404 when unknown, expired or not a request id at all."""
        status = await self.client.status(request_id) if re.fullmatch(REQUEST_ID_PATTERN, request_id) else None
        if status is None:
            raise ApiError.of(GatewayCode.NOT_FOUND, f"no video {clip(request_id, 100)!r} (unknown or expired)")
        return status

    async def meta(self, request_id: str) -> VideoMeta | None:
        """The gateway's record of a job; ``None`` for a job enqueued without a gateway, or whose record
        is unreadable (the video is then described from its status alone)."""
        read = await self.records.get(request_id)
        if read.unreadable:
            log.warning("gateway.video_record_unreadable", request_id=request_id)
        return read.record

    async def video(self, request_id: str) -> tuple[RequestStatus, VideoMeta | None]:
        """The status and record of a video that exists: 404 when unknown, expired or deleted."""
        status = await self.status(request_id)
        meta = await self.meta(request_id)
        if meta is not None and meta.deleted_at is not None:
            raise ApiError.of(GatewayCode.NOT_FOUND, f"no video {clip(request_id, 100)!r} (deleted)")
        return status, meta

    async def describe(self, request_id: str) -> VideoObject:
        status, meta = await self.video(request_id)
        note = await unheld_note(self.client.redis, self.client.keys, status, fresh_s=self.fresh_s)
        return self._object(status, meta, note)

    def _object(self, status: RequestStatus, meta: VideoMeta | None, note: str | None = None) -> VideoObject:
        return video_object(
            status,
            meta,
            stages=self.stages,
            default_model=self.model_name,
            ttl_s=self.client.pipeline.retention.request_ttl_s,
            note=note,
        )

    async def content(self, status: RequestStatus) -> bytes | ResultFile:
        """The MP4 of a finished request: its bytes from Redis, or — when it was too large for Redis — the
        file, if it lies inside this deployment's output directory (:mod:`.results`; never a path that a
        status names freely).  409 while running, 422 when it failed, 404 when deleted or gone."""
        if not status.state.terminal:
            raise ApiError.of(GatewayCode.NOT_READY, f"video {status.request_id} is still {status.state.value}")
        if status.state is not RequestState.DONE:
            error = from_status_error(status.error)
            raise ApiError.of(
                GatewayCode.GENERATION_FAILED, f"video generation ended {status.state.value}: {error.message}"
            )
        data = await self.client.result_bytes(status.request_id)
        if data:
            return data
        result = status.result
        if result is not None and result.redis_key is None:  # never stored in Redis: the file, if ours
            try:
                return await anyio.to_thread.run_sync(
                    lambda: self.results.open(result.location, expected_bytes=result.bytes)
                )
            except ResultRefused as exc:
                refuse_logged(status.request_id, result.location, exc)
        raise ApiError.of(
            GatewayCode.NOT_FOUND, f"the output of {status.request_id} is not available (deleted or expired)"
        )

    async def list(self, *, limit: int, order: Order, after: str | None) -> VideoList:
        """A page of this gateway's (tenant's) videos; ``after`` is the last id of the previous page."""
        cursor = None
        if after is not None:
            ours = re.fullmatch(REQUEST_ID_PATTERN, after) and tenant_of(after) == self.client.tenant
            cursor = await self.meta(after) if ours else None
            if cursor is None or cursor.index_entry is None:
                raise invalid(
                    "after", f"no video {after!r} to page from (unknown, expired or not a video id)", "unknown"
                )
        page = await listing.page(self.client, limit=limit, order=order, after=cursor)
        data = [self._object(item.status, item.meta) for item in page.items]
        return VideoList(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=page.has_more,
        )

    async def preview(self, request_id: str, variant: str) -> bytes:
        """A finished video's thumbnail or spritesheet, made once (:mod:`.previews`) and kept in Redis."""
        status, _meta = await self.video(request_id)
        stored = await self.records.preview(request_id, variant)
        if stored is not None:
            return stored
        async with self._rendering:
            stored = await self.records.preview(request_id, variant)  # another request may have made it
            if stored is not None:
                return stored
            content = await self.content(status)
            source = content.file if isinstance(content, ResultFile) else content
            try:
                previews: Previews = await anyio.to_thread.run_sync(render, source)
            except PreviewError as exc:
                raise ApiError.of(GatewayCode.GENERATION_FAILED, f"no {variant} for {request_id}: {exc}") from None
            finally:
                if isinstance(content, ResultFile):
                    content.close()
            await self.records.put_previews(request_id, {name: previews.variant(name) for name in PREVIEW_VARIANTS})
        return previews.variant(variant)

    async def delete(self, request_id: str) -> VideoDeleted:
        """Cancel a job still in flight: not deleted (``deleted`` false), it stays, as cancelled, until a
        later ``DELETE``; a finished one is gone: its output and previews are dropped, and its record
        becomes a tombstone (404 from now on; a list cursor still)."""
        status, meta = await self.video(request_id)
        if not status.state.terminal:
            await self.client.cancel(request_id)
            return VideoDeleted(id=request_id, deleted=False)
        tomb = (meta or VideoMeta(model=self.model_name, prompt="")).model_copy(update={"deleted_at": int(time.time())})
        await self.records.tombstone(request_id, tomb, previews=PREVIEW_VARIANTS)
        if meta is not None and meta.index_entry is not None:
            await self.index.remove(meta.index_entry)
        return VideoDeleted(id=request_id, deleted=True)


#: What ``?variant=`` may ask for besides the video.
PREVIEW_VARIANTS = ("thumbnail", "spritesheet")
