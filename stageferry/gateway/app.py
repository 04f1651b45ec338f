"""The ASGI app: one :class:`~stageferry.client.Client` (one Redis pool) for the app's lifetime, the routes,
metrics middleware, and the handlers that turn every error into a JSON body — never an HTML page or a
bare 500 for input the client got wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from stageferry.broker.control.liveness import FRESH_S
from stageferry.client import DEFAULT_REDIS_URL, Client, new_request_id
from stageferry.config import PipelineConfig, Settings
from stageferry.errors import StageferryError, field_error
from stageferry.gateway.auth import require_token
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError, clip, from_exception, invalid_fields
from stageferry.gateway.events_sse import MAX_EVENT_STREAMS
from stageferry.gateway.health import HealthMonitor, health_connection
from stageferry.gateway.metrics import MetricsMiddleware
from stageferry.gateway.results import ResultFiles
from stageferry.gateway.routes import error_response, router
from stageferry.gateway.service import VideoService
from stageferry.gateway.web_console import install_console
from stageferry.logs import EventSink
from stageferry.schemas.envelope import request_key

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What one gateway serves: a deployment (Redis, prefix, pipeline) and its HTTP-side settings."""

    redis_url: str = DEFAULT_REDIS_URL
    prefix: str = "sf"
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    #: ``model`` in answers when the request named none.
    model_name: str = "stageferry"
    #: Longest a synchronous request waits; ``None`` is the pipeline's request deadline.
    sync_timeout_s: float | None = None
    #: A stage counts as live when a worker's heartbeat is at most this old.
    health_fresh_s: float = FRESH_S
    #: Where result files too large for Redis are served from; ``None`` is the pipeline's ``output_dir``
    #: (relative to the gateway's working directory).  Nothing outside it is ever served.
    output_dir: str | None = None
    #: Run the process's :class:`~stageferry.logs.EventSink` (one per process: off when embedding the app
    #: next to another sink).
    trace_events: bool = True
    #: When set, API calls need ``Authorization: Bearer <token>`` (:mod:`.auth`); the console asks for it.
    api_token: str | None = None
    #: Server-sent event streams served at once (each holds a blocking Redis read).
    event_streams: int = MAX_EVENT_STREAMS
    #: Stage ``/metrics`` URLs whose counters the console shows next to the gateway's own.
    metrics_urls: tuple[str, ...] = ()
    #: The tenant this gateway submits as (``STAGEFERRY_TENANT``): its ids are ``<tenant>.video-…``, its
    #: jobs go through the tenant's intake, and ``GET /v1/videos`` lists that tenant's jobs only.
    tenant: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: object) -> GatewayConfig:
        """The configured deployment (``STAGEFERRY_REDIS_URL``/``PREFIX``/``PIPELINE``), plus overrides."""
        base = cls(
            redis_url=settings.redis_url or DEFAULT_REDIS_URL,
            prefix=settings.prefix,
            pipeline=settings.load_pipeline(),
            api_token=settings.gateway_token,
            tenant=settings.tenant,
        )
        return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app for ``config``; Redis is connected lazily on first use, closed at shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with (
            Client(config.redis_url, prefix=config.prefix, pipeline=config.pipeline, tenant=config.tenant) as client,
            anyio.create_task_group() as tg,
        ):
            if config.trace_events:  # the gateway's events (submitted, timed out, ...) join each request's trace
                await tg.start(EventSink(client.store).run)
            results = ResultFiles(config.output_dir or config.pipeline.output_dir)
            app.state.videos = VideoService(
                client, model_name=config.model_name, results=results, fresh_s=config.health_fresh_s
            )
            app.state.sync_timeout_s = config.sync_timeout_s or config.pipeline.timeouts.request
            app.state.health_fresh_s = config.health_fresh_s  # the console's stage panel
            health_redis = health_connection(config.redis_url)
            app.state.health = HealthMonitor(client, health_redis, fresh_s=config.health_fresh_s)
            await tg.start(app.state.health.run)
            log.info("gateway.started", prefix=config.prefix, stages=[s.name for s in config.pipeline.stages])
            yield
            log.info("gateway.stopped")
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await health_redis.aclose()

    app = FastAPI(
        title="stageferry gateway",
        summary="vLLM-Omni compatible /v1/videos API in front of a stageferry pipeline",
        version="1",
        lifespan=lifespan,
    )
    app.include_router(router, dependencies=[Depends(require_token)])
    install_console(
        app, api_token=config.api_token, max_event_streams=config.event_streams, metrics_urls=config.metrics_urls
    )
    app.add_middleware(MetricsMiddleware)
    _install_error_handlers(app)
    return app


def _refused(request: Request, exc: ApiError | StageferryError) -> JSONResponse:
    """The answer for an error; a 4xx refusal is logged under a request key of its own, which the answer
    names, so a client's report finds the log line: ``X-Request-Id`` when the refusal is about a request
    that exists (an idempotency conflict names the earlier job), else ``X-Refusal-Id`` — a refusal before
    submission has no request, no trace in Redis, and so no request id (``stageferry trace`` on it would
    say ``not_found``)."""
    api = exc if isinstance(exc, ApiError) else from_exception(exc)
    if 400 <= api.status < 500:
        rid = api.headers.get("X-Request-Id")
        if rid is None:
            rid = api.headers["X-Refusal-Id"] = new_request_id(kind="refused")
        first = api.field_errors[0].get("field") if api.field_errors else None
        log.info("gateway.refused", key=request_key(rid, -1), status=api.status, code=api.code,
                 method=request.method, path=clip(request.url.path, 300), field=first)  # fmt: skip
    return error_response(api)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _refused(request, exc)

    @app.exception_handler(StageferryError)
    async def stageferry_error(request: Request, exc: StageferryError) -> JSONResponse:
        return _refused(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            field_error(".".join(str(p) for p in e.get("loc", ())[1:]) or "request", str(e.get("msg", "")), e["type"])
            for e in exc.errors()[:20]
        ]
        return _refused(request, invalid_fields(errors))  # "invalid request: limit: …", as every 400 reads

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        known = {404: GatewayCode.NOT_FOUND, 405: GatewayCode.METHOD_NOT_ALLOWED}.get(exc.status_code)
        if known is None:
            return _refused(request, ApiError.of(GatewayCode.HTTP_ERROR, str(exc.detail), status=exc.status_code))
        return _refused(request, ApiError.of(known, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("gateway.internal_error", error=type(exc).__name__)
        return error_response(ApiError.of(GatewayCode.INTERNAL, f"internal error: {type(exc).__name__}"))
