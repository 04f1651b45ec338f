"""Running the gateway with uvicorn (``stageferry gateway``)."""

from __future__ import annotations

import signal
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from stageferry.errors import ConfigError
from stageferry.gateway.app import GatewayConfig, create_app
from stageferry.heap import GATEWAY_YOUNG_THRESHOLD, settle_heap


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM is a normal end.

    uvicorn drains on SIGTERM and then raises the signal again, so the process dies of it (exit 143,
    which ``docker compose stop`` reports as a failure).  A stop is what an orchestrator asks for: after
    the drain the gateway exits 0.  SIGINT keeps uvicorn's behaviour (a Ctrl-C is an interruption)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and isinstance(captured, list) and sig in captured:
            captured.remove(sig)


#: The largest request head (request line and headers) that is always read whole, in bytes.  h11 answers a
#: bare ``400`` once an *incomplete* head outgrows its buffer (16 KiB by default), so a long URL got a 400
#: or the gateway's typed answer depending on how many reads its bytes took.  This bound sits above the
#: longest URL an HTTP client sends (httpx: 64 KiB) with room for headers; a longer head still gets h11's
#: 400, and every answer the gateway writes is bounded whatever the client sent.
MAX_REQUEST_HEAD_BYTES = 80 * 1024


def uvicorn_config(app: ASGIApp, *, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """The uvicorn settings of every gateway (``serve``, the tests', the benchmarks'): h11, with
    :data:`MAX_REQUEST_HEAD_BYTES`; uvicorn's access log and its logging configuration off."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http="h11",
        h11_max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        log_config=None,
    )


def serve(config: GatewayConfig, *, host: str = "127.0.0.1", port: int = 8091, log_level: str = "info") -> None:
    """Serve until SIGTERM (drain, exit 0) or SIGINT (drain, then the interruption).

    uvicorn's own access log is off (the metrics middleware counts every request) and so is its logging
    configuration: its loggers propagate to the root handler that :func:`stageferry.logs.configure_logging`
    installed, so the gateway's log is JSON lines like every service's.
    """
    quiet = "warning" if log_level == "info" else log_level
    server = _Server(uvicorn_config(create_app(config), host=host, port=port, log_level=quiet))
    # Collections mid-burst stalled every request, /health too (see stageferry.heap for the figures).
    settle_heap("gateway.heap_settled", young_threshold=GATEWAY_YOUNG_THRESHOLD)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind: one typed line, not a stray exit status
        if server.started:
            raise
    if not server.started:
        raise ConfigError(f"the gateway could not start on {host}:{port} (the log line above says why)")
