"""The HTTP routes: vLLM-Omni's ``/v1/videos`` family, health and metrics.

Every route is thin: read the form (:mod:`.uploads`), map it (:mod:`.form`), call the service
(:mod:`.service`), shape the answer (:mod:`.objects`).  Errors leave as :class:`~.errors.ApiError` and
are rendered by the app's handlers.
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

import anyio
import structlog
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.requests import ClientDisconnect

from stageferry.errors import DeadlineExceededError, StageferryError
from stageferry.gateway import listing
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError, from_exception, from_status_error, invalid, with_request_id
from stageferry.gateway.form import LARGE_TEXT_FIELDS, MEDIA_FIELDS, MappedJob, map_form, openapi_request_body
from stageferry.gateway.idempotency import HEADER as IDEMPOTENCY_HEADER
from stageferry.gateway.idempotency import IdempotencyKey
from stageferry.gateway.live import live_response
from stageferry.gateway.metrics import JOBS, UPLOAD_BYTES
from stageferry.gateway.objects import Health, VideoDeleted, VideoList, VideoObject
from stageferry.gateway.previews import MEDIA_TYPES
from stageferry.gateway.results import ResultFile
from stageferry.gateway.service import VideoService
from stageferry.gateway.uploads import body_cap, read_form
from stageferry.schemas import MediaInputs, RequestState, RequestStatus

log = structlog.get_logger(__name__)
router = APIRouter()

#: Header with which a client asks for a shorter synchronous wait than the gateway's default.
TIMEOUT_HEADER = "X-Stageferry-Timeout"

#: How long a waiter gives a request it attached to (``Idempotency-Key``) to appear before it is not found.
ATTACH_GRACE_S = 10.0

_ERROR = {
    "description": "OpenAI-style error object; `param` and `field_errors` name the fields at fault.  Once a job "
    "was accepted, every answer also names it: `request_id`, `status_url` and `cancel` in the body, "
    "`X-Request-Id` and `Location` headers (and `Retry-After` with a 503)."
}
_FORM = {"requestBody": openapi_request_body()}


def _service(request: Request) -> VideoService:
    service: VideoService = request.app.state.videos
    return service


async def _read_job(request: Request, service: VideoService) -> MappedJob:
    """The multipart body, streamed under the upload caps, mapped onto a job."""
    limit = service.client.pipeline.limits.max_upload_bytes
    try:
        form = await read_form(
            request.headers,
            request.stream(),
            max_file_bytes=limit,
            max_body_bytes=body_cap(limit, len(MediaInputs.model_fields)),
            large_text_fields=LARGE_TEXT_FIELDS,
        )
    except ClientDisconnect:
        raise ApiError.of(GatewayCode.INVALID_FORM, "the client went away before sending the whole form") from None
    for upload in form.files:
        UPLOAD_BYTES.labels(upload.field if upload.field in MEDIA_FIELDS else "other").inc(len(upload.data))
    return map_form(form, service.client.pipeline.limits.tasks)


def _sync_timeout(request: Request, header: str | None) -> float:
    """The gateway's synchronous wait, or the client's shorter one from :data:`TIMEOUT_HEADER`."""
    default: float = request.app.state.sync_timeout_s
    if header is None:
        return default
    try:
        asked = float(header)
    except ValueError:
        asked = math.nan
    if not math.isfinite(asked) or asked <= 0:
        raise invalid(TIMEOUT_HEADER, "must be a positive number of seconds", "timeout")
    return min(asked, default)


async def _wait_for_result(request: Request, service: VideoService, rid: str, timeout: float) -> RequestStatus | None:
    """Block until the request ends; ``None`` when the client went away first (the job is then cancelled).

    A request that does not end within ``timeout`` is cancelled and answered 504.
    """
    outcome: list[RequestStatus | StageferryError] = []
    disconnected = False

    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:  # exists_within: a retry that attached to a job may come before that job is enqueued
                outcome.append(await service.client.wait(rid, timeout=timeout, exists_within=ATTACH_GRACE_S))
            except StageferryError as exc:
                outcome.append(exc)
            tg.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            nonlocal disconnected
            while (await request.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        tg.start_soon(wait)
        tg.start_soon(watch_disconnect)

    if disconnected and not outcome:
        await service.client.cancel(rid)
        JOBS.labels("sync", "disconnected").inc()
        log.info("gateway.client_gone", request_id=rid)
        return None
    result = outcome[0]
    if isinstance(result, DeadlineExceededError):
        await service.client.cancel(rid)
        JOBS.labels("sync", "timeout").inc()
        raise from_exception(DeadlineExceededError(f"no result within {timeout:g}s; request {rid} was cancelled"))
    if isinstance(result, StageferryError):
        raise from_exception(result)
    return result


@router.post(
    "/v1/videos/sync",
    openapi_extra=_FORM,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "The MP4."},
        400: _ERROR,
        413: _ERROR,
        422: _ERROR,
        503: _ERROR,
        504: _ERROR,
    },
    response_class=Response,
    summary="Generate a video and wait for it; the MP4 in the body",
)
async def create_video_sync(
    request: Request,
    timeout_header: Annotated[str | None, Header(alias=TIMEOUT_HEADER)] = None,
    idempotency_key: Annotated[str | None, Header(alias=IDEMPOTENCY_HEADER)] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:
    service = _service(request)
    timeout = _sync_timeout(request, timeout_header)
    idempotency = IdempotencyKey.from_headers(idempotency_key, authorization)
    mapped = await _read_job(request, service)
    started = time.perf_counter()
    rid, created = await service.submit(mapped, idempotency=idempotency)
    log.info("gateway.submitted", request_id=rid, endpoint="sync", attached=not created)
    try:  # from here on the job is accepted: every answer names it
        return await _answer_sync(request, service, mapped, rid, timeout, started)
    except ApiError as exc:
        raise with_request_id(exc, rid) from None
    except StageferryError as exc:
        raise with_request_id(from_exception(exc, origin=mapped.origin), rid) from exc


async def _answer_sync(
    request: Request, service: VideoService, mapped: MappedJob, rid: str, timeout: float, started: float
) -> Response:
    status = await _wait_for_result(request, service, rid, timeout)
    if status is None:
        return Response(status_code=499)
    if status.state is not RequestState.DONE:
        JOBS.labels("sync", status.state.value).inc()
        raise from_status_error(status.error, origin=mapped.origin)
    content = await service.content(status)
    JOBS.labels("sync", "done").inc()
    headers = {
        "X-Request-Id": rid,
        "X-Model": mapped.model or service.model_name,
        "X-Inference-Time-S": f"{time.perf_counter() - started:.3f}",
        "X-Stage-Durations": json.dumps({t.stage: round(t.seconds, 3) for t in status.timings}, separators=(",", ":")),
    }
    return _video_response(content, headers)


@router.post(
    "/v1/videos",
    openapi_extra=_FORM,
    responses={400: _ERROR, 413: _ERROR, 422: _ERROR, 503: _ERROR},
    summary="Create a video job; poll GET /v1/videos/{video_id}",
)
async def create_video(
    request: Request,
    idempotency_key: Annotated[str | None, Header(alias=IDEMPOTENCY_HEADER)] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> VideoObject:
    service = _service(request)
    idempotency = IdempotencyKey.from_headers(idempotency_key, authorization)
    mapped = await _read_job(request, service)
    rid, created = await service.submit(mapped, id_kind="video", idempotency=idempotency)
    log.info("gateway.submitted", request_id=rid, endpoint="async", attached=not created)
    JOBS.labels("async", "submitted" if created else "attached").inc()
    try:
        return await service.describe(rid)
    except ApiError as exc:
        raise with_request_id(exc, rid) from None
    except StageferryError as exc:
        raise with_request_id(from_exception(exc), rid) from exc


#: OpenAI's videos operations this gateway does not offer, by route: each answers 501 ``not_supported``
#: naming itself (they used to meet the id routes' 404 and 405, which read as an unknown video).
UNSUPPORTED = (
    ("POST", "/v1/videos/{video_id}/remix", "remix"),
    ("POST", "/v1/videos/edits", "edit"),
    ("POST", "/v1/videos/extensions", "extend"),
    ("POST", "/v1/videos/characters", "create_character"),
    ("GET", "/v1/videos/characters/{character_id}", "get_character"),
)
OFFERED = "create, create_and_poll, retrieve, list, delete, download_content (docs/gateway.md)"


def _refuse(operation: str) -> Any:
    async def refuse() -> None:
        raise ApiError.of(
            GatewayCode.NOT_SUPPORTED, f"this gateway does not offer videos.{operation}; it offers {OFFERED}"
        )

    return refuse


for _method, _path, _operation in UNSUPPORTED:
    router.add_api_route(
        _path,
        _refuse(_operation),
        methods=[_method],
        responses={501: _ERROR},
        summary=f"Not offered here: OpenAI's videos.{_operation}",
        operation_id=f"unsupported_{_operation}",
    )


@router.get("/v1/videos", responses={400: _ERROR}, summary="This gateway's video jobs, in cursor pages")
async def list_videos(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=listing.MAX_LIMIT)] = listing.DEFAULT_LIMIT,
    after: Annotated[str | None, Query(max_length=200, description="The last id of the previous page.")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time.")] = "desc",
) -> VideoList:
    return await _service(request).list(limit=limit, order=order, after=after)


@router.get("/v1/videos/{video_id}", responses={404: _ERROR}, summary="A video job's status and progress")
async def retrieve_video(request: Request, video_id: str) -> VideoObject:
    return await _service(request).describe(video_id)


@router.get(
    "/v1/videos/{video_id}/content",
    response_class=Response,
    responses={
        200: {"content": {"video/mp4": {}, "image/webp": {}, "image/jpeg": {}}},
        404: _ERROR,
        409: _ERROR,
        422: _ERROR,
    },
    summary="Download a finished video (variant=video), its thumbnail (WebP) or its spritesheet (JPEG); a "
    "running one whose last stage writes a fragmented MP4 as it goes: its bytes as they are written",
)
async def download_video(request: Request, video_id: str, variant: Annotated[str, Query()] = "video") -> Response:
    service = _service(request)
    if variant in MEDIA_TYPES:
        image = await service.preview(video_id, variant)
        return Response(image, media_type=MEDIA_TYPES[variant])
    if variant != "video":
        raise invalid("variant", "one of 'video', 'thumbnail', 'spritesheet'", "unsupported")
    status, _meta = await service.video(video_id)
    if not status.state.terminal and (live := await live_response(service, video_id)) is not None:
        return live  # its MP4 as it is written (docs/streaming.md)
    content = await service.content(status)
    return _video_response(content, {"Content-Disposition": f'attachment; filename="{video_id}.mp4"'})


def _video_response(content: bytes | ResultFile, headers: dict[str, str]) -> Response:
    """The MP4 from Redis bytes, or streamed from an opened result file (closed when the stream ends)."""
    if isinstance(content, ResultFile):
        headers = {**headers, "Content-Length": str(content.size)}
        return StreamingResponse(content.chunks(), media_type="video/mp4", headers=headers)
    return Response(content, media_type="video/mp4", headers=headers)


@router.delete(
    "/v1/videos/{video_id}", responses={404: _ERROR}, summary="Cancel a job in flight, or delete a finished video"
)
async def delete_video(request: Request, video_id: str) -> VideoDeleted:
    return await _service(request).delete(video_id)


@router.head("/health", include_in_schema=False)  # a load balancer's probe may be a HEAD: the status alone
@router.get(
    "/health",
    responses={503: {"model": Health, "description": "Redis or a stage is down."}},
    summary="200 when Redis answers and every stage has a live worker (checked every second, in the background)",
)
async def health(request: Request) -> JSONResponse:
    """The background monitor's latest report when healthy (at once, whatever the load on Redis's pool);
    an unhealthy one is checked again first, so that a deployment that just came up is not reported down."""
    monitor = request.app.state.health
    report = monitor.report()
    if report.status != "ok":  # a healthy answer may be a second old; an unhealthy one is checked again now
        report = await monitor.check()
    return JSONResponse(report.model_dump(), status_code=200 if report.status == "ok" else 503)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics of this process")
async def metrics() -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def error_response(exc: ApiError | StageferryError) -> JSONResponse:
    """The JSON answer for an error raised by a route (stageferry errors are mapped on the way)."""
    api = exc if isinstance(exc, ApiError) else from_exception(exc)
    body: dict[str, Any] = api.body()
    return JSONResponse(body, status_code=api.status, headers=api.headers)
