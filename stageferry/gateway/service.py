"""The gateway's operations on the pipeline, through one :class:`~stageferry.client.Client`.

Routes stay thin: they parse HTTP and call these.  Validation is the project's own — the schema
(:func:`~stageferry.client.validate_job`) and the deployment limits
(:func:`~stageferry.schemas.validation.check_job_limits`, the same check the first stage runs) — so a bad
step count or LoRA is a 400 before anything is enqueued.  Media are checked by the first stage; a
synchronous request whose job that stage rejects gets the same 400 with the same field names.

Besides the request's own keys, the gateway keeps one small JSON record per job it accepted, at
``<p>:req-video:<id>`` (model, prompt, size, seconds, created_at; same TTL as the request), so that a
video object can echo what was asked for.
"""

from __future__ import annotations

import contextlib
import re

import anyio

from stageferry.broker.control.redis_conn import translated
from stageferry.client import Client, new_request_id, validate_job, with_upload_refs
from stageferry.errors import ControlPlaneError, QueueFullError, RejectedError, StageferryError
from stageferry.gateway import recent
from stageferry.gateway.errors import ApiError, clip, from_exception, from_status_error, with_request_id
from stageferry.gateway.form import MappedJob
from stageferry.gateway.idempotency import IdempotencyKey, IdempotencyStore, fingerprint
from stageferry.gateway.objects import VideoDeleted, VideoMeta, VideoObject, video_object
from stageferry.gateway.results import ResultFile, ResultFiles, ResultRefused, refuse_logged
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.job import REQUEST_ID_PATTERN
from stageferry.schemas.validation import check_job_limits


class VideoService:
    """Submit, wait for, describe, fetch and delete video jobs of one deployment."""

    def __init__(self, client: Client, *, model_name: str, results: ResultFiles | None = None) -> None:
        self.client = client
        self.model_name = model_name
        #: Where result files too large for Redis may be served from (nowhere else, whatever a status says).
        self.results = results or ResultFiles(client.pipeline.output_dir)
        self.idempotency = IdempotencyStore(client.redis, client.keys, ttl_s=client.pipeline.retention.request_ttl_s)
        self.stages = [s.name for s in client.pipeline.stages]

    def meta_key(self, request_id: str) -> str:
        return self.client.keys.video_meta(request_id)

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
            checked = validate_job(with_upload_refs(mapped.job, refs))
            check_job_limits(checked, limits, upload_prefix=keys.upload_prefix())
            rid, created = new_request_id(self.client.tenant, kind=id_kind), True
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
        meta = VideoMeta(
            model=mapped.model or self.model_name,
            prompt=checked.prompt,
            size=f"{checked.width}x{checked.height}",
            seconds=f"{checked.frame_count / checked.fps:g}",
            origin=mapped.origin,
        )
        try:
            with translated():
                await self.client.redis.set(
                    self.meta_key(rid),
                    meta.model_dump_json(),
                    ex=self.client.pipeline.retention.request_ttl_s,
                    nx=not created,
                )
            if created:
                await recent.record(self.client, rid)  # the console's list of recent requests
        except StageferryError as exc:  # the job is in: the answer must still name it
            raise with_request_id(from_exception(exc), rid) from exc
        return rid, created

    async def status(self, request_id: str) -> RequestStatus:
        """The request's status; 404 when unknown, expired or not a request id at all."""
        status = await self.client.status(request_id) if re.fullmatch(REQUEST_ID_PATTERN, request_id) else None
        if status is None:
            raise ApiError(404, "not_found", f"no video {clip(request_id, 100)!r} (unknown or expired)")
        return status

    async def describe(self, request_id: str) -> VideoObject:
        status = await self.status(request_id)
        with translated():
            raw = await self.client.redis.get(self.meta_key(request_id))
        meta = VideoMeta.model_validate_json(raw) if raw else None
        return video_object(
            status,
            meta,
            stages=self.stages,
            default_model=self.model_name,
            ttl_s=self.client.pipeline.retention.request_ttl_s,
        )

    async def content(self, status: RequestStatus) -> bytes | ResultFile:
        """The MP4 of a finished request: its bytes from Redis, or — when it was too large for Redis — the
        file, if it lies inside this deployment's output directory (:mod:`.results`; never a path that a
        status names freely).  409 while running, 422 when it failed, 404 when deleted or gone."""
        if not status.state.terminal:
            raise ApiError(409, "not_ready", f"video {status.request_id} is still {status.state.value}")
        if status.state is not RequestState.DONE:
            error = from_status_error(status.error)
            raise ApiError(422, "generation_failed", f"video generation ended {status.state.value}: {error.message}")
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
        raise ApiError(404, "not_found", f"the output of {status.request_id} is not available (deleted or expired)")

    async def delete(self, request_id: str) -> VideoDeleted:
        """Cancel a job still in flight; for a finished one drop its stored output (the status stays)."""
        status = await self.status(request_id)
        if not status.state.terminal:
            await self.client.cancel(request_id)
        else:
            with translated():
                await self.client.redis.delete(self.client.keys.result(request_id), self.meta_key(request_id))
        return VideoDeleted(id=request_id, deleted=True)
