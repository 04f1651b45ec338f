"""Structured logging: one configuration function, request context, and forwarding to Redis.

* :func:`configure_logging` is the only function that changes structlog's global configuration: JSON
  lines for services, a pretty console on a TTY; ISO UTC timestamps; ``service`` and ``pid`` on every
  event.
* :func:`bound_request` binds ``request_id`` (and ``key``, ``stage``, ``rank``) to every event logged
  inside it, through :mod:`structlog.contextvars`, so concurrent requests never mix their context.
* :func:`forward_to_sink` (a processor in the configured chain) copies each event that carries a
  ``request_id`` into a bounded in-memory queue — dropping the oldest, and counting the drops, when it
  is full, so that a logging call never blocks or awaits.  The process's one :class:`EventSink` drains
  that queue into the request's events stream (``RequestStore.append_event``), which ``stageferry
  trace`` reads.  With no sink running, nothing is queued.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import threading
from collections import deque
from collections.abc import Iterator, MutableMapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

import anyio
import structlog
from anyio.abc import TaskStatus

from stageferry.errors import ConfigError, StageferryError

if TYPE_CHECKING:
    from stageferry.broker.control.requests import RequestStore

LogFormat = Literal["auto", "json", "console"]

#: Events held for the sink at most; beyond this the oldest are dropped (and counted).
QUEUE_MAX_EVENTS = 10_000

log = structlog.get_logger(__name__)


def configure_logging(
    *, fmt: LogFormat = "auto", level: str = "info", service: str, capture_native: bool = False
) -> None:
    """Configure structlog for this process; ``fmt="auto"`` is console on a TTY, JSON lines otherwise.

    Libraries' own Python logging (NIXL, redis-py, asyncio) and warnings are routed through the same
    chain, so a service's log is one format.  ``capture_native`` (services writing JSON) also wraps what
    native code writes to fds 1 and 2 (UCX, NIXL's C++ side, stray prints) into JSON lines; see
    :func:`capture_native_output`."""
    level_no = logging.getLevelNamesMapping().get(level.upper())
    if level_no is None:
        raise ConfigError(f"unknown log level {level!r}", level=level)
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    stream: Any = sys.stderr
    if capture_native and not use_console:
        stream = capture_native_output(service)

    def add_service(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("service", service)
        event.setdefault("pid", os.getpid())  # per event: forked children report their own
        return event

    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        add_service,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        forward_to_sink,
    ]
    if use_console:
        processors.append(structlog.dev.ConsoleRenderer())
    else:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # one write() per line: no interleaving
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _ToStructlog)] + [_ToStructlog()]
    root.setLevel(max(level_no, logging.INFO))  # libraries' debug chatter stays out even at debug
    logging.captureWarnings(True)
    adopt_library_logger("nixl")


class _ToStructlog(logging.Handler):
    """A stdlib handler that re-emits each record as a structlog event (``library.log``), so that
    libraries' lines get the same format, context and sink as ours."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"logger": record.name, "message": record.getMessage()}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            structlog.get_logger(record.name).log(record.levelno, "library.log", **fields)
        except Exception:
            self.handleError(record)


def adopt_library_logger(name: str) -> None:
    """Route logger ``name`` through the root handler: drop the handlers a library installed for itself
    (NIXL prints ``... NIXL INFO _api.py:405 ...`` to stdout) and let its records propagate.  Called
    again after the library is imported, since that is when it installs them."""
    logger = logging.getLogger(name)
    logger.handlers[:] = []
    logger.propagate = True


#: The CLI's one-line expected error (``stageferry.cli.display.error_line``), and words that make a line an error.
_ERROR_LINE = re.compile(r"error \[([a-z0-9_]{1,64})\]: (.*)")
_ERROR_WORD = re.compile(r"\b(error|fatal)\b")


class _NativeOutput:
    """fds 1 and 2 turned into a pipe whose lines come out on the real stderr as JSON lines.

    Native code (UCX's warnings, NIXL's C++ logging, a progress bar) writes to the fds directly,
    below anything Python can configure.  Lines that already are JSON objects pass unchanged;
    every other line becomes ``{"event": "native.output", "line": ...}``.  structlog itself writes to
    a duplicate of the real stderr, so our own lines never wait on the pipe and are never lost when a
    rank leaves with ``os._exit``."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.real_fd = os.dup(2)
        self.stream = os.fdopen(os.dup(self.real_fd), "w", buffering=1, encoding="utf-8", errors="replace")
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._reader = threading.Thread(target=self._pump, args=(read_fd,), name="native-output", daemon=True)
        self._reader.start()

    def _pump(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for raw in pipe:
                self._forward(raw.decode("utf-8", errors="replace").rstrip("\r\n"))

    def _forward(self, line: str) -> None:
        if not line.strip():
            return
        if line.startswith("{") and line.endswith("}"):
            try:
                json.loads(line)
            except ValueError:
                pass
            else:
                os.write(self.real_fd, (line + "\n").encode())
                return
        fatal = _ERROR_LINE.fullmatch(line)
        lowered = line.lower()
        level = "error" if fatal or _ERROR_WORD.search(lowered) else "warning" if " warn" in lowered else "info"
        event: dict[str, Any] = {"event": "native.output", "line": line.replace("\r", " ")[-4000:]}
        if fatal:  # the CLI's own one-line error (a service that cannot start): an error event, not output
            event = {"event": "service.error", "code": fatal[1], "message": fatal[2][-4000:]}
        event |= {
            "level": level,
            "service": self.service,
            "pid": os.getpid(),
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        }
        os.write(self.real_fd, (json.dumps(event) + "\n").encode())

    def flush(self, timeout: float = 1.0) -> None:
        """Let lines already in the pipe come out (before ``os._exit``): point fds 1 and 2 back at the real
        stderr, which closes the pipe's last writer, and wait for the reader to drain it."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.real_fd, 1)
        os.dup2(self.real_fd, 2)
        self._reader.join(timeout)


_native: _NativeOutput | None = None


def capture_native_output(service: str) -> Any:
    """Start wrapping fds 1 and 2 (once per process); the stream structlog should write to.

    Also keeps progress bars out of service logs: ``TQDM_DISABLE`` for libraries that use tqdm."""
    global _native
    os.environ.setdefault("TQDM_DISABLE", "1")
    if _native is None:
        _native = _NativeOutput(service)
        atexit.register(_native.flush)
    return _native.stream


def flush_native_output() -> None:
    """Drain captured native output; call before ``os._exit`` (a no-op when nothing is captured)."""
    if _native is not None:
        _native.flush()


@contextlib.contextmanager
def bound_request(
    request_id: str, *, key: str | None = None, stage: str | None = None, rank: int | None = None
) -> Iterator[None]:
    """Bind a request's identity to every event logged inside the block (and in tasks started in it)."""
    fields: dict[str, Any] = {"request_id": request_id, "key": key, "stage": stage, "rank": rank}
    with structlog.contextvars.bound_contextvars(**{k: v for k, v in fields.items() if v is not None}):
        yield


class _EventQueue:
    """Bounded, thread-safe FIFO of ``(request_id, event)``; full means the oldest is dropped."""

    def __init__(self, maxlen: int = QUEUE_MAX_EVENTS) -> None:
        self._items: deque[tuple[str, dict[str, Any]]] = deque()
        self._maxlen = maxlen
        self._lock = threading.Lock()
        self.dropped = 0

    def put(self, request_id: str, event: dict[str, Any]) -> None:
        with self._lock:
            if len(self._items) >= self._maxlen:
                self._items.popleft()
                self.dropped += 1
            self._items.append((request_id, event))

    def take(self, limit: int) -> list[tuple[str, dict[str, Any]]]:
        with self._lock:
            n = min(limit, len(self._items))
            return [self._items.popleft() for _ in range(n)]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


_queue = _EventQueue()
_active_sink: EventSink | None = None
_sink_lock = threading.Lock()
#: True inside the sink's own task, so that its own log lines are never forwarded back to itself.
_inside_sink: contextvars.ContextVar[bool] = contextvars.ContextVar("stageferry_inside_sink", default=False)


def forward_to_sink(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: queue a copy of events that carry ``request_id``, when a sink is running."""
    request_id = event.get("request_id")
    if request_id is None or _active_sink is None or _inside_sink.get():
        return event
    copy = dict(event)
    if copy.get("exc_info"):
        copy = dict(structlog.processors.format_exc_info(None, "", copy))
    copy.pop("exc_info", None)
    _queue.put(str(request_id), copy)
    return event


class EventSink:
    """Drains forwarded events into each request's events stream; one per process.

    Start it with ``await tg.start(sink.run)``; while it runs, events carrying ``request_id`` are
    queued and written every ``interval`` seconds.  On cancellation it flushes what is left (shielded,
    for at most ``final_flush_s``), then unregisters.  Write failures drop the batch and count it in
    :attr:`dropped` rather than stall the service: the trace is diagnostics, not the result.
    """

    def __init__(
        self,
        store: RequestStore,
        *,
        interval: float = 0.05,
        batch_size: int = 500,
        final_flush_s: float = 2.0,
    ) -> None:
        self._store = store
        self._interval = interval
        self._batch_size = batch_size
        self._final_flush_s = final_flush_s
        self._write_drops = 0

    @property
    def dropped(self) -> int:
        """Events lost so far: queue overflow (process-wide) plus failed writes of this sink."""
        return _queue.dropped + self._write_drops

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Register as the process's sink and flush periodically until cancelled."""
        _register(self)
        token = _inside_sink.set(True)
        try:
            task_status.started()
            while True:
                await anyio.sleep(self._interval)
                await self.flush()
        finally:
            with anyio.move_on_after(self._final_flush_s, shield=True):
                await self.flush()
            _unregister(self)
            _inside_sink.reset(token)

    async def flush(self) -> None:
        """Write every queued event now, oldest first."""
        token = _inside_sink.set(True)
        try:
            while batch := _queue.take(self._batch_size):
                await self._write(batch)
        finally:
            _inside_sink.reset(token)

    async def _write(self, batch: list[tuple[str, dict[str, Any]]]) -> None:
        """The whole batch in one round trip (``RequestStore.append_events``); lost together on failure."""
        try:
            await self._store.append_events(batch)
        except StageferryError as exc:
            self._write_drops += len(batch)
            log.warning("logs.forward_failed", error=str(exc), dropped=len(batch))


def _register(sink: EventSink) -> None:
    global _active_sink
    with _sink_lock:
        if _active_sink is not None and _active_sink is not sink:
            raise RuntimeError("an EventSink is already running in this process")
        _queue.clear()
        _active_sink = sink


def _unregister(sink: EventSink) -> None:
    global _active_sink
    with _sink_lock:
        if _active_sink is sink:
            _active_sink = None


__all__ = [
    "EventSink",
    "LogFormat",
    "adopt_library_logger",
    "bound_request",
    "capture_native_output",
    "configure_logging",
    "flush_native_output",
    "forward_to_sink",
]
