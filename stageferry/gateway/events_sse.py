"""Live progress pushed to browsers: ``GET /v1/videos/{id}/events`` as server-sent events.

Each frame is one row of the request's events stream (a status change or a logged event) as an
:class:`~stageferry.schemas.console_api.EventFrame`; the stream replays the rows written so far, then follows
new ones with blocking reads (XREAD BLOCK, no polling), and closes after the terminal status.  A comment
line goes out when nothing happened for :data:`KEEPALIVE_S`, so proxies and browsers keep the connection.

Bounded: each open stream holds one blocking read on a pooled Redis connection, so a gateway serves at
most ``max_streams`` at once (429 ``too_many_streams`` beyond), and no stream outlives the pipeline's
request deadline.  Where the rows come from is one function, :func:`request_events`: when the gateway
shares one Redis reader for all request events, that function is the one to swap.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import anyio
import structlog
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from stageferry.client import Client
from stageferry.errors import StageferryError
from stageferry.gateway.codes import GatewayCode
from stageferry.gateway.errors import ApiError
from stageferry.schemas.console_api import EventFrame
from stageferry.trace.events import TraceEvent

log = structlog.get_logger(__name__)

#: Concurrent event streams one gateway serves by default.
MAX_EVENT_STREAMS = 32
#: A comment line after this long without an event.
KEEPALIVE_S = 15.0


async def request_events(client: Client, request_id: str, *, timeout: float) -> AsyncIterator[TraceEvent]:
    """The request's events, past then live, ending after its terminal status (the swap point for a
    shared reader).  :class:`~stageferry.errors.DeadlineExceededError` after ``timeout``."""
    async for event in client.watch(request_id, timeout=timeout):
        yield event


def event_frame(event: TraceEvent) -> EventFrame:
    """What the page needs of one event: state, stage and step for the progress bar, the rest for the log."""
    status = event.status
    step = total = None
    if status is not None and status.progress is not None:
        step, total = status.progress.step, status.progress.total
    elif "step" in event.raw:
        step, total = _int(event.raw.get("step")), _int(event.raw.get("total"))
    return EventFrame(
        id=event.entry_id,
        kind="status" if event.kind == "status" else "log",
        event=event.event,
        timestamp=event.timestamp,
        state=status.state.value if status is not None else None,
        stage=event.stage,
        service=event.service,
        rank=event.rank,
        step=step,
        total=total,
        transport=event.transport,
        bytes=event.bytes,
        seconds=event.seconds if event.seconds is None or math.isfinite(event.seconds) else None,
        detail=event.detail[:500],
        terminal=status is not None and status.state.terminal,
    )


def sse_message(frame: EventFrame) -> bytes:
    """One SSE message: ``id``, ``event`` (status/log) and the frame as one ``data`` line of JSON."""
    return f"id: {frame.id}\nevent: {frame.kind}\ndata: {frame.model_dump_json()}\n\n".encode()


class EventStreams:
    """The gateway's open event streams, at most ``max_streams`` at a time."""

    def __init__(self, *, max_streams: int = MAX_EVENT_STREAMS, keepalive_s: float = KEEPALIVE_S) -> None:
        self.max_streams = max_streams
        self.keepalive_s = keepalive_s
        self.open = 0

    def response(self, client: Client, request_id: str) -> Response:
        """A streaming answer for a request known to exist; 429 when every slot is taken."""
        if self.open >= self.max_streams:
            raise ApiError.of(
                GatewayCode.TOO_MANY_STREAMS,
                f"this gateway serves at most {self.max_streams} event streams at once; retry later",
                headers={"Retry-After": "5"},
            )
        self.open += 1
        return _EventStreamResponse(self, client, request_id)

    def _release(self) -> None:
        self.open -= 1


class _EventStreamResponse(Response):
    """The SSE answer: one task group per stream (the reader, the disconnect watch, the writer), so that
    the stream's slot and its Redis read end together, whichever side ends first."""

    media_type = "text/event-stream"

    def __init__(self, streams: EventStreams, client: Client, request_id: str) -> None:
        super().__init__(headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # streamed: chunked
        self.streams = streams
        self.client = client
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b": stream open\n\n", "more_body": True})
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
                await self._forward(send)
                tg.cancel_scope.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client's socket went away under a send
            log.info("events.client_gone", request_id=self.request_id)
        finally:
            self.streams._release()

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    async def _forward(self, send: Send) -> None:
        """Frames from the reader as they come, a keepalive comment when it is quiet, until the end."""
        client = self.client
        writer, reader = anyio.create_memory_object_stream[bytes](16)

        async def pump() -> None:
            async with writer:
                try:
                    async for event in request_events(
                        client, self.request_id, timeout=client.pipeline.timeouts.request
                    ):
                        await writer.send(sse_message(event_frame(event)))
                except StageferryError as exc:  # deadline or Redis trouble: tell the page, then close
                    log.info("events.stream_ended", request_id=self.request_id, code=exc.code)
                    await writer.send(f'event: end\ndata: {{"code": "{exc.code}"}}\n\n'.encode())

        async with anyio.create_task_group() as tg, reader:
            tg.start_soon(pump)
            while True:
                message = b": keepalive\n\n"
                with anyio.move_on_after(self.streams.keepalive_s):
                    try:
                        message = await reader.receive()
                    except anyio.EndOfStream:
                        return
                await send({"type": "http.response.body", "body": message, "more_body": True})


def _int(value: object) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


__all__ = ["KEEPALIVE_S", "MAX_EVENT_STREAMS", "EventStreams", "event_frame", "request_events", "sse_message"]
