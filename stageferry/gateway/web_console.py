"""The web console: a page at ``/`` and the JSON it reads, served by the gateway process itself.

The page is static HTML/CSS/JS shipped as package data (``gateway/static/``): no build step, no Node at
run time, no CDN, so it works offline.  It submits through the ordinary ``POST /v1/videos`` (same limits,
same field errors), follows ``GET /v1/videos/{id}/events`` (:mod:`.events_sse`), plays and offers the
MP4 from ``/content``, and reads the JSON endpoints below.  Every JSON endpoint needs the gateway's token
when one is configured (:mod:`.auth`); ``/console/api/info`` says whether the page must ask for it.

=====================================  ==================================================================
``GET /``                              the console page
``GET /console/static/<file>``         its script and style sheet
``GET /console/api/info``              auth required?, tasks, stages, limits (no token needed)
``GET /v1/videos/{id}/events``         server-sent events: the request's progress, live
``GET /v1/videos/{id}/trace``          the request's trace as a timeline (:mod:`stageferry.trace.report`)
``GET /console/api/requests``          recent requests and their states (:mod:`.recent`)
``GET /console/api/stages``            replicas, heartbeats, placement, queues, pools (:mod:`.stage_health`)
``GET /console/api/counters``          data-plane and gateway counters (:mod:`.counters`)
=====================================  ==================================================================
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Sequence
from functools import cache
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from stageferry.gateway import counters, recent
from stageferry.gateway.auth import require_token
from stageferry.gateway.events_sse import MAX_EVENT_STREAMS, EventStreams
from stageferry.gateway.service import VideoService
from stageferry.gateway.stage_health import stage_report
from stageferry.schemas.console_api import (
    ConsoleInfo,
    ConsoleLimits,
    CountersReport,
    RecentReport,
    StagesReport,
    TraceReport,
)
from stageferry.trace.report import trace_report

router = APIRouter(dependencies=[Depends(require_token)])
_ERROR = {"description": "OpenAI-style error object."}


@cache
def _page() -> str:
    return (importlib.resources.files("stageferry.gateway") / "static" / "index.html").read_text()


def _service(request: Request) -> VideoService:
    service: VideoService = request.app.state.videos
    return service


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def page() -> HTMLResponse:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})


@router.get("/console/api/info", summary="What the console needs before anything else (no token needed)")
async def info(request: Request) -> ConsoleInfo:
    pipeline = _service(request).client.pipeline
    limits = pipeline.limits
    return ConsoleInfo(
        auth_required=bool(request.app.state.api_token),
        tasks=[t.value for t in limits.tasks],  # what this deployment serves (limits.tasks)
        stages=[s.name for s in pipeline.stages],
        limits=ConsoleLimits(
            max_steps=limits.max_steps,
            max_prompt_chars=limits.max_prompt_chars,
            max_upload_bytes=limits.max_upload_bytes,
            lora_adapters=list(limits.lora_adapters),
        ),
        max_event_streams=request.app.state.event_streams.max_streams,
    )


@router.get(
    "/v1/videos/{video_id}/events",
    response_class=Response,
    responses={200: {"content": {"text/event-stream": {}}}, 404: _ERROR, 429: _ERROR},
    summary="A job's progress as server-sent events, until it ends",
)
async def events(request: Request, video_id: str) -> Response:
    service = _service(request)
    await service.status(video_id)  # 404 for an unknown id, before any stream opens
    streams: EventStreams = request.app.state.event_streams
    return streams.response(service.client, video_id)


@router.get("/v1/videos/{video_id}/trace", responses={404: _ERROR}, summary="A job's trace as a timeline")
async def trace(request: Request, video_id: str) -> TraceReport:
    service = _service(request)
    status = await service.status(video_id)
    return trace_report(video_id, status, await service.client.trace(video_id), service.client.pipeline)


@router.get("/console/api/requests", summary="The newest jobs the gateways accepted, newest first")
async def recent_requests(request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20) -> RecentReport:
    return await recent.recent(_service(request).client, limit=limit)


@router.get("/console/api/stages", summary="Replicas, heartbeats, placement, queues and pools of each stage")
async def stages(request: Request) -> StagesReport:
    return await stage_report(_service(request).client, fresh_s=request.app.state.health_fresh_s)


@router.get("/console/api/counters", summary="Puts, gets, bytes, fallbacks, failures, outcomes")
async def counter_values(request: Request) -> CountersReport:
    return await counters.collect(request.app.state.metrics_urls)


def install_console(
    app: FastAPI,
    *,
    api_token: str | None = None,
    max_event_streams: int = MAX_EVENT_STREAMS,
    metrics_urls: Sequence[str] = (),
) -> None:
    """Register the page, its files and its endpoints on ``app`` (routes read their settings from
    ``app.state``, set here)."""
    app.state.api_token = api_token
    app.state.event_streams = EventStreams(max_streams=max_event_streams)
    app.state.metrics_urls = tuple(metrics_urls)
    app.include_router(router)
    app.mount("/console/static", StaticFiles(packages=[("stageferry.gateway", "static")]), name="console-static")
