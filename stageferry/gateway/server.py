"""Running the gateway with uvicorn (``stageferry gateway``)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from types import FrameType

import h11
import structlog
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from stageferry.errors import ConfigError
from stageferry.gateway.app import GatewayConfig, create_app
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError
from stageferry.heap import GATEWAY_YOUNG_THRESHOLD, settle_heap


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM is a normal end.

    uvicorn drains on SIGTERM and then raises the signal again, so the process dies of it (exit 143,
    which ``docker compose stop`` reports as a failure).  A stop is what an orchestrator asks for: after
    the drain the gateway exits 0.  SIGINT keeps uvicorn's behaviour (a Ctrl-C is an interruption)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start, then one ``gateway.listening`` line with the URL (uvicorn's own says it at info,
        which the gateway keeps quiet: its loggers run at warning)."""
        await super().startup(sockets)
        if self.started:
            config = self.config
            log.info("gateway.listening", url=f"http://{config.host}:{config.port}", docs="/docs", console="/")

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

#: How long a connection has to send a whole request head (request line and headers), counted from the
#: connection's start or from the first byte of its next request, in seconds.  uvicorn has no such bound:
#: a client that connected and sent nothing, or a head a byte at a time, held its connection (a file
#: descriptor, a slot under any connection limit) for ever, so a few thousand of them shut every client out.
#: Once the head is whole, the body has its own idle bound (``uploads.BODY_IDLE_S``), and between requests
#: uvicorn's keep-alive timeout closes an idle connection.
HEAD_TIMEOUT_S = 30.0

log = structlog.get_logger(__name__)


class _HeadBoundedH11(H11Protocol):
    """uvicorn's h11 protocol with :data:`HEAD_TIMEOUT_S` on every request head: a head not whole in
    time is answered ``408`` with the gateway's error body (``head_stalled``) and the connection closed.
    h11 cannot send a response before it has read a request, so the answer is written as bytes."""

    head_timeout_s = HEAD_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the first bytes of a head (a later request's, too)
            self._arm_head_timer()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is whole (or h11 refused it)
            self._cancel_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request head did not arrive whole within {self.head_timeout_s:g} s: the connection is closed"
        body = json.dumps(ApiError.of(GatewayCode.HEAD_STALLED, message).body()).encode()
        head = (
            f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        log.warning("gateway.head_stalled", client=":".join(map(str, self.client or ())), seconds=self.head_timeout_s)
        self.transport.write(head.encode() + body)
        self.transport.close()


def uvicorn_config(
    app: ASGIApp, *, host: str, port: int, log_level: str = "warning", head_timeout_s: float = HEAD_TIMEOUT_S
) -> uvicorn.Config:
    """The uvicorn settings of every gateway (``serve``, the tests', the benchmarks'): h11, with
    :data:`MAX_REQUEST_HEAD_BYTES` and ``head_timeout_s`` (:data:`HEAD_TIMEOUT_S`) on each request
    head; uvicorn's access log and its logging configuration off."""
    protocol = type("HeadBoundedH11", (_HeadBoundedH11,), {"head_timeout_s": head_timeout_s})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
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
