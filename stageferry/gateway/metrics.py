"""The gateway's Prometheus metrics and the ASGI middleware that records them.

``GET /metrics`` exposes the whole process registry: these plus anything else the process defines.
Routes are labelled by their template (``/v1/videos/{video_id}``), never by the raw path, so that the
label set stays bounded.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

REQUESTS = Counter(
    "stageferry_gateway_requests_total", "HTTP requests answered by the gateway", ["method", "route", "status"]
)
LATENCY = Histogram(
    "stageferry_gateway_request_seconds", "Time to answer an HTTP request", ["method", "route"], buckets=_SECONDS
)
UPLOAD_BYTES = Counter("stageferry_gateway_upload_bytes_total", "Media bytes accepted in requests", ["field"])
JOBS = Counter("stageferry_gateway_jobs_total", "Video jobs by endpoint and outcome", ["endpoint", "outcome"])


class MetricsMiddleware:
    """Counts every HTTP request by method, route template and status, and times it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            REQUESTS.labels(scope["method"], template, str(status)).inc()
            LATENCY.labels(scope["method"], template).observe(time.perf_counter() - started)
