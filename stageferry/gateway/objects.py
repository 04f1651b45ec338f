"""The API's response objects (OpenAI's video object, as vLLM-Omni serves it) and how a status maps on.

Our request states are richer than OpenAI's four: ``rejected`` and ``cancelled`` show as ``failed`` with
the stageferry ``error.code`` (``invalid_job``, ``cancelled``), and the exact state stays visible as
``stageferry_state``.  ``progress`` (0-100) counts finished stages plus the running stage's steps.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from stageferry.gateway.errors import rename_fields
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.video_record import VideoMeta

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]

_STATUS: dict[RequestState, VideoStatus] = {
    RequestState.QUEUED: "queued",
    RequestState.RUNNING: "in_progress",
    RequestState.DONE: "completed",
    RequestState.FAILED: "failed",
    RequestState.REJECTED: "failed",
    RequestState.CANCELLED: "failed",
}


class VideoError(BaseModel):
    code: str
    message: str
    field_errors: list[dict[str, Any]] = Field(default_factory=list)


class VideoObject(BaseModel):
    """OpenAI's video object, with vLLM-Omni's extensions and the pipeline's own state."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: VideoStatus
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    size: str | None = None
    seconds: str | None = None
    quality: str = "default"
    remixed_from_video_id: str | None = None
    error: VideoError | None = None
    media_type: Literal["video/mp4"] = "video/mp4"
    inference_time_s: float | None = None
    stage_durations: dict[str, float] = Field(default_factory=dict)
    stageferry_state: RequestState
    stageferry_note: str | None = Field(
        None, description="Set while the job waits on a stage with no live worker (the status alone says running)."
    )
    task: str | None = Field(
        None,
        description="Which task ran: t2va, fl2va, ref2va or i2va (inferred from the uploads when none was named).",
    )


class VideoList(BaseModel):
    """One page of ``GET /v1/videos`` (OpenAI's cursor page: pass ``last_id`` as ``after`` for the next)."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class Health(BaseModel):
    status: Literal["ok", "unhealthy"]
    redis: bool
    stages: dict[str, list[str]] = Field(description="Each stage's replicas with a fresh heartbeat.")
    gave_up: dict[str, list[str]] = Field(
        default_factory=dict, description="Replicas whose supervisor gave up restarting them (until started again)."
    )
    problems: list[str] = Field(default_factory=list)
    failover: str | None = Field(
        None,
        description="Behind Sentinel: what the sentinels say of the Redis master while a failover runs "
        "(e.g. 'o_down,failover_in_progress'); requests in flight wait for the new master, none is lost.",
    )


def progress_percent(status: RequestStatus, stages: list[str]) -> int:
    """0-100 over the whole pipeline: stages before the current one count as done."""
    if status.state is RequestState.DONE:
        return 100
    if status.state is not RequestState.RUNNING or status.stage not in stages:
        return 0
    index = stages.index(status.stage)
    fraction = 0.0
    if status.progress is not None and status.progress.total > 0:
        fraction = min(1.0, status.progress.step / status.progress.total)
    return min(99, int(100 * (index + fraction) / len(stages)))


def video_object(
    status: RequestStatus,
    meta: VideoMeta | None,
    *,
    stages: list[str],
    default_model: str,
    ttl_s: int,
    note: str | None = None,
) -> VideoObject:
    """The video object for a request; ``meta`` is absent for requests enqueued without the gateway."""
    created = meta.created_at if meta is not None else int(status.updated_at)
    terminal = status.state.terminal
    error = None
    if status.error is not None:
        error = VideoError(
            code=status.error.code,
            message=status.error.message,
            field_errors=rename_fields(status.error.details.get("field_errors") or [], meta.origin if meta else {}),
        )
    size, seconds = (meta.size, meta.seconds) if meta is not None else (None, None)
    media = status.result.media if status.result is not None else {}
    if "width" in media and "height" in media:
        size = f"{media['width']}x{media['height']}"
    if "duration_s" in media:
        seconds = f"{float(media['duration_s']):g}"
    return VideoObject(
        id=status.request_id,
        model=meta.model if meta is not None else default_model,
        status=_STATUS[status.state],
        progress=progress_percent(status, stages),
        created_at=created,
        completed_at=int(status.updated_at) if terminal else None,
        expires_at=int(status.updated_at) + ttl_s if terminal else None,
        prompt=meta.prompt if meta is not None else None,
        size=size,
        seconds=seconds,
        error=error,
        inference_time_s=round(sum(t.seconds for t in status.timings), 3) if status.timings else None,
        stage_durations={t.stage: round(t.seconds, 3) for t in status.timings},
        stageferry_state=status.state,
        stageferry_note=note,
        task=meta.task if meta is not None and meta.task else None,
    )
