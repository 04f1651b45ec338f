"""A request's trace: the rows of ``<p>:req-events:<id>`` turned into time-ordered events and a table.

Two kinds of rows land in that stream: ``status`` rows (written with every status change, fields
``state`` and ``status``; ``folded``, on one that replaced a status written by the same script:
:func:`folded_row`) and ``log`` rows (structured log events forwarded by each service's
:class:`~stageferry.logs.EventSink`, field ``event``).  Log events are read by these keys, so that
services only need to log them: ``timestamp`` (ISO), ``service``, ``stage``, ``rank``, ``event``,
``transport``, ``bytes`` (or ``payload_bytes``/``nbytes``) and ``seconds`` (or ``elapsed_s``,
``duration_s``, ``transfer_seconds``).

A trace can also be saved to a file beside the outputs (:func:`save_trace`): ``stageferry up`` does so
before its private Redis goes away, and ``stageferry trace`` reads it back (:func:`load_saved_trace`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from stageferry.schemas import RequestStatus, Transport
from stageferry.schemas.job import REQUEST_ID_PATTERN

#: Version of the saved-trace file (``<output_dir>/<request id>.trace.json``).
SAVED_TRACE_VERSION = 1

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
        if raw.get("source") or raw.get("destination"):  # a payload's two ends (their advertised addresses)
            parts.append(f"{raw.get('source') or '?'} -> {raw.get('destination') or '?'}")
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


def folded_row(entry_id: str, fields: Mapping[str, Any]) -> TraceEvent | None:
    """The status a ``status`` row replaced within the same script (its ``folded`` field: a first stage's
    ``queued``, written with its ``running`` at one instant, gets no event of its own), as the event it
    would have had; None for a row without one."""
    if fields.get("kind") != "status" or fields.get("folded") is None:
        return None
    status = _json_object(fields["folded"])
    return parse_row(entry_id, {"kind": "status", "state": status.get("state"), "status": status})


def parse_events(rows: Iterable[tuple[str, Mapping[str, Any]]]) -> list[TraceEvent]:
    """All rows → events sorted by time (ties keep stream order); a status row that carries the status it
    replaced (:func:`folded_row`) counts as both, the replaced one first."""
    events = [ev for eid, fields in rows for ev in (folded_row(eid, fields), parse_row(eid, fields)) if ev is not None]
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
        if (
            changes
            and ev.event == "status.queued"
            and (changes[-1].event, changes[-1].stage)
            == (
                "status.running",
                ev.stage,
            )
        ):
            continue  # the hand-off's "queued" landed after the next stage already took the entry: no queue time
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


def short_transport(transport: str | None) -> str | None:
    """A transport as a few words: UCX's long description (``<agent> intra-node cfg#1 … cma/memory``)
    becomes its locality and its last field (``intra-node cma/memory``); short names stay as they are."""
    if transport is None:
        return None
    words = transport.split()
    if len(words) <= 2:
        return transport
    locality = next((w for w in words if w.endswith("-node")), "")
    return f"{locality} {words[-1]}".strip()


_COLUMNS = ("t+s", "Δs", "service", "stage", "rank", "event", "transport", "bytes", "seconds")
_RIGHT = {"t+s", "Δs", "rank", "bytes", "seconds"}


def format_trace(events: list[TraceEvent]) -> str:
    """A table of the events (offset, time since the previous event, transport, …) and the hops.

    Columns are as wide as their widest cell, so service names and transports are never cut."""
    if not events:
        return "(no events)"
    t0 = events[0].timestamp
    rows: list[tuple[list[str], str]] = []
    prev = t0
    for ev in events:
        cells = [
            f"{ev.timestamp - t0:.3f}", f"{ev.timestamp - prev:.3f}", _cell(ev.service), _cell(ev.stage),
            _cell(ev.rank), ev.event, _cell(short_transport(ev.transport)), _cell(ev.bytes),
            _cell(None if ev.seconds is None else f"{ev.seconds:.3f}"),
        ]  # fmt: skip
        rows.append((cells, ev.detail))
        prev = ev.timestamp
    widths = [max(len(name), *(len(cells[i]) for cells, _ in rows)) for i, name in enumerate(_COLUMNS)]

    def line(cells: list[str], detail: str) -> str:
        padded = [c.rjust(w) if n in _RIGHT else c.ljust(w) for c, w, n in zip(cells, widths, _COLUMNS, strict=True)]
        return ("  ".join(padded) + "  " + detail).rstrip()

    lines = [f"{len(events)} events over {events[-1].timestamp - t0:.3f} s", line(list(_COLUMNS), "detail")]
    lines += [line(cells, detail) for cells, detail in rows]
    lines.append("")
    lines.append("hops (between status changes):")
    stage_w = max(len(_cell(hop.stage)) for hop in hops(events))
    for hop in hops(events):
        took = "…" if hop.seconds is None else f"{hop.seconds:.3f} s"
        via = f"  via {', '.join(sorted({short_transport(t) or t for t in hop.transports}))}" if hop.transports else ""
        lines.append(f"  {hop.state:<10} {_cell(hop.stage):<{stage_w}} {took:>10}{via}")
    return "\n".join(lines)


def saved_trace_path(output_dir: str | Path, request_id: str) -> Path | None:
    """Where ``request_id``'s trace is saved under ``output_dir``; None for an id that is no file name."""
    if not re.match(REQUEST_ID_PATTERN, request_id):
        return None
    return Path(output_dir) / f"{request_id}.trace.json"


def save_trace(path: Path, request_id: str, rows: Iterable[tuple[str, Mapping[str, Any]]], *, source: str) -> None:
    """Write a request's events rows (as :meth:`RequestStore.events` returns them) to ``path``."""
    body = {
        "version": SAVED_TRACE_VERSION,
        "request_id": request_id,
        "source": source,
        "rows": [[entry_id, dict(fields)] for entry_id, fields in rows],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, default=str))
    tmp.replace(path)


def load_saved_trace(path: Path) -> list[TraceEvent] | None:
    """The events of a saved trace; None when there is no such file or it is not one of ours."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(body, dict)
        or body.get("version") != SAVED_TRACE_VERSION
        or not isinstance(body.get("rows"), list)
    ):
        return None
    rows = [
        (str(row[0]), row[1])
        for row in body["rows"]
        if isinstance(row, list) and len(row) == 2 and isinstance(row[1], dict)
    ]
    return parse_events(rows)


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


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


__all__ = [
    "SAVED_TRACE_VERSION",
    "Hop",
    "TraceEvent",
    "folded_row",
    "format_trace",
    "hops",
    "load_saved_trace",
    "parse_events",
    "parse_row",
    "save_trace",
    "saved_trace_path",
    "short_transport",
]
