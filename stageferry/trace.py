"""A request's trace: the rows of ``<p>:req-events:<id>`` turned into time-ordered events and a table.

Two kinds of rows land in that stream: ``status`` rows (written with every status change, fields
``state`` and ``status``) and ``log`` rows (structured log events forwarded by each service's
:class:`~stageferry.logs.EventSink`, field ``event``).  Log events are read by these keys, so that
services only need to log them: ``timestamp`` (ISO), ``service``, ``stage``, ``rank``, ``event``,
``transport``, ``bytes`` (or ``payload_bytes``/``nbytes``) and ``seconds`` (or ``elapsed_s``,
``duration_s``, ``transfer_seconds``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from stageferry.schemas import RequestStatus, Transport

_BYTES_KEYS = ("bytes", "payload_bytes", "nbytes")
_SECONDS_KEYS = ("seconds", "elapsed_s", "duration_s", "transfer_seconds")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One event of a request's trace; ``raw`` keeps the whole event as logged."""

    timestamp: float
    event: str
    kind: str = "log"
    service: str | None = None
    stage: str | None = None
    rank: int | None = None
    transport: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    entry_id: str = "0-0"
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> RequestStatus | None:
        """The status a ``status`` row carries (None for log rows or an unreadable status)."""
        body = self.raw.get("status")
        if self.kind != "status" or not isinstance(body, Mapping):
            return None
        try:
            return RequestStatus.model_validate(body)
        except ValueError:
            return None

    @property
    def detail(self) -> str:
        """A short human hint: progress, error code, fallback reason."""
        raw = self.raw
        if self.kind == "status":
            body = raw.get("status")
            progress = body.get("progress") if isinstance(body, Mapping) else None
            error = body.get("error") if isinstance(body, Mapping) else None
            if isinstance(progress, Mapping):
                return f"step {progress.get('step')}/{progress.get('total')}"
            if isinstance(error, Mapping):
                return f"{error.get('code')}: {error.get('message')}"
            return ""
        parts = [f"step {raw['step']}/{raw.get('total', '?')}"] if "step" in raw else []
        parts += [f"{k}={raw[k]}" for k in ("reason", "error", "code") if k in raw]
        return " ".join(parts)


def parse_row(entry_id: str, fields: Mapping[str, Any]) -> TraceEvent | None:
    """One events-stream row → :class:`TraceEvent`; None for rows of an unknown kind.

    Accepts rows as :meth:`RequestStore.events` returns them (JSON bodies decoded) or straight from
    XREAD with the fields as strings.
    """
    kind = fields.get("kind")
    if kind == "status":
        status = _json_object(fields.get("status"))
        state = fields.get("state") or status.get("state") or "unknown"
        return TraceEvent(
            timestamp=_float(status.get("updated_at")) or _entry_time(entry_id),
            event=f"status.{state}",
            kind="status",
            stage=_str(status.get("stage")),
            bytes=_int((status.get("result") or {}).get("bytes")) if status.get("result") else None,
            entry_id=entry_id,
            raw={"state": state, "status": status},
        )
    if kind == "log":
        event = _json_object(fields.get("event"))
        return TraceEvent(
            timestamp=_iso_time(event.get("timestamp")) or _entry_time(entry_id),
            event=str(event.get("event", "?")),
            service=_str(event.get("service")),
            stage=_str(event.get("stage")),
            rank=_int(event.get("rank")),
            transport=_str(event.get("transport")),
            bytes=_first(event, _BYTES_KEYS, _int),
            seconds=_first(event, _SECONDS_KEYS, _float),
            entry_id=entry_id,
            raw=event,
        )
    return None


def parse_events(rows: Iterable[tuple[str, Mapping[str, Any]]]) -> list[TraceEvent]:
    """All rows → events sorted by time (ties keep stream order)."""
    events = [ev for eid, fields in rows if (ev := parse_row(eid, fields)) is not None]
    return sorted(events, key=lambda ev: (ev.timestamp, _entry_seq(ev.entry_id)))


@dataclass(frozen=True, slots=True)
class Hop:
    """The time a request spent in one (state, stage) between two status changes."""

    state: str
    stage: str | None
    start: float
    seconds: float | None
    transports: tuple[str, ...]


def hops(events: list[TraceEvent]) -> list[Hop]:
    """Intervals between consecutive status changes, each with the transports logged inside it.

    A running hop also names how the stage's input arrived, from the final status's timings.
    """
    changes: list[TraceEvent] = []
    for ev in events:
        if ev.kind != "status":
            continue
        if changes and (changes[-1].event, changes[-1].stage) == (ev.event, ev.stage):
            continue
        changes.append(ev)
    final = next((ev.status for ev in reversed(events) if ev.status is not None), None)
    timings = final.timings if final is not None else []
    timing_transport = {t.stage: t.transport.value for t in timings if t.transport is not Transport.NONE}
    out = []
    for i, change in enumerate(changes):
        end = changes[i + 1].timestamp if i + 1 < len(changes) else None
        seen = {
            ev.transport
            for ev in events
            if ev.transport and ev.timestamp >= change.timestamp and (end is None or ev.timestamp < end)
        }
        if change.stage in timing_transport and change.event == "status.running":
            seen.add(timing_transport[change.stage])
        out.append(
            Hop(
                state=change.event.removeprefix("status."),
                stage=change.stage,
                start=change.timestamp,
                seconds=None if end is None else end - change.timestamp,
                transports=tuple(sorted(seen)),
            )
        )
    return out


def format_trace(events: list[TraceEvent]) -> str:
    """A table of the events (offset, time since the previous event, transport, …) and the hops."""
    if not events:
        return "(no events)"
    t0 = events[0].timestamp
    header = (
        f"{'t+s':>9} {'Δs':>8}  {'service':<12} {'stage':<10} {'rank':>4}  {'event':<28} "
        f"{'transport':<10} {'bytes':>11} {'seconds':>9}  detail"
    )
    lines = [f"{len(events)} events over {events[-1].timestamp - t0:.3f} s", header]
    prev = t0
    for ev in events:
        lines.append(
            f"{ev.timestamp - t0:9.3f} {ev.timestamp - prev:8.3f}  {_cell(ev.service):<12} "
            f"{_cell(ev.stage):<10} {_cell(ev.rank):>4}  {ev.event:<28} {_cell(ev.transport, 10):<10} "
            f"{_cell(ev.bytes):>11} {_cell(None if ev.seconds is None else f'{ev.seconds:.3f}'):>9}  "
            f"{ev.detail}".rstrip()
        )
        prev = ev.timestamp
    lines.append("")
    lines.append("hops (between status changes):")
    for hop in hops(events):
        took = "…" if hop.seconds is None else f"{hop.seconds:.3f} s"
        via = f"  via {', '.join(hop.transports)}" if hop.transports else ""
        lines.append(f"  {hop.state:<10} {_cell(hop.stage):<10} {took:>10}{via}")
    return "\n".join(lines)


def _cell(value: object, width: int = 0) -> str:
    text = "-" if value is None else str(value)
    return text if not width or len(text) <= width else text[: width - 1] + "…"


def _json_object(value: Any) -> dict[str, Any]:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return dict(value) if isinstance(value, Mapping) else {}


def _first(event: Mapping[str, Any], names: tuple[str, ...], conv: Any) -> Any:
    for name in names:
        if name in event and (value := conv(event[name])) is not None:
            return value
    return None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _float(value: Any) -> float | None:
    try:
        return None if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


def _iso_time(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def _entry_time(entry_id: str) -> float:
    """A stream entry id's milliseconds, as unix seconds: when the event reached Redis."""
    try:
        return int(entry_id.split("-", 1)[0]) / 1000
    except ValueError:
        return 0.0


def _entry_seq(entry_id: str) -> tuple[int, int]:
    try:
        ms, seq = entry_id.split("-", 1)
        return int(ms), int(seq)
    except ValueError:
        return 0, 0


__all__ = ["Hop", "TraceEvent", "format_trace", "hops", "parse_events", "parse_row"]
