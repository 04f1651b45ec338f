"""A request's trace drawn as a timeline: one self-contained HTML page with an inline SVG.

Twenty rows of a table are read slower than one picture, so ``stageferry trace ID --html FILE`` draws:

* the request lane: each interval between status changes (queued / running, per stage), coloured by state;
* one lane per stage: the time it ran, its denoising steps as ticks, and its own figure from the final
  status (``timings``: seconds, input transport, payload bytes, transfer seconds);
* the hops: an arrow from the producer's put to the consumer's stage, labelled with transport, bytes and
  transfer time (``inline`` fallbacks in another colour, with their reason when one was logged);
* fan-out: each leader's broadcast to its ranks (ranks, bytes, seconds) as a short bar;
* below, every event as a table (the same rows as the text trace).

Nothing is fetched: no scripts, fonts or styles from elsewhere, so the file opens offline and can be
attached to a bug report.
"""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from stageferry.schemas import RequestState, RequestStatus, Transport
from stageferry.trace.events import TraceEvent, hops, short_transport

_LABEL_W = 150
_PLOT_W = 900
_LANE_H = 34
_STATE_COLOURS: dict[str, str] = {
    RequestState.QUEUED: "#c9ccd1",
    RequestState.RUNNING: "#4a7fd4",
    RequestState.DONE: "#3a9a5b",
    RequestState.FAILED: "#c8463d",
    RequestState.REJECTED: "#c8463d",
    RequestState.CANCELLED: "#9a8f3a",
}
_TRANSPORT_COLOURS = {"nixl": "#6a3fb5", "inline": "#d9822b", "in_process": "#2b8fa0"}


@dataclass(frozen=True, slots=True)
class _Bar:
    lane: str
    start: float
    end: float
    colour: str
    label: str
    title: str


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _fmt_s(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _final_status(events: Sequence[TraceEvent]) -> RequestStatus | None:
    return next((ev.status for ev in reversed(events) if ev.status is not None), None)


def _bars(events: Sequence[TraceEvent]) -> tuple[list[str], list[_Bar], list[tuple[float, str, str]]]:
    """Lanes in order, the bars on them, and point marks (time, lane, title) for denoising steps."""
    end_of_trace = events[-1].timestamp
    status = _final_status(events)
    timings = {t.stage: t for t in status.timings} if status is not None else {}
    lanes = ["request"]
    bars: list[_Bar] = []
    marks: list[tuple[float, str, str]] = []
    stage_start: dict[str, float] = {}
    for hop in hops(list(events)):
        end = hop.start + hop.seconds if hop.seconds is not None else end_of_trace
        label = f"{hop.state} {hop.stage or ''}".strip()
        colour = _STATE_COLOURS.get(hop.state, "#888")
        bars.append(
            _Bar("request", hop.start, max(end, hop.start), colour, label, f"{label}: {_fmt_s(end - hop.start)}")
        )
        if hop.state == RequestState.RUNNING and hop.stage:
            lane = f"stage {hop.stage}"
            if lane not in lanes:
                lanes.append(lane)
            stage_start.setdefault(hop.stage, hop.start)
            timing = timings.get(hop.stage)
            figure = f" · {timing.seconds:.2f} s in stage" if timing is not None else ""
            bars.append(_Bar(lane, hop.start, max(end, hop.start), "#9bb7e6", f"{hop.stage}{figure}",
                             f"{hop.stage} running {_fmt_s(end - hop.start)}{figure}"))  # fmt: skip
    puts = {ev.stage: ev for ev in events if ev.event == "payload.put"}
    for ev in events:
        if ev.kind == "status" and ev.status is not None and ev.status.progress is not None:
            p = ev.status.progress
            marks.append((ev.timestamp, f"stage {ev.status.stage or p.stage}", f"step {p.step}/{p.total}"))
        if ev.event == "group.fanout" and ev.seconds is not None and ev.stage:
            lane = f"fan-out {ev.stage}"
            if lane not in lanes:
                lanes.append(lane)
            ranks = ev.raw.get("ranks", "?")
            text = f"{ranks} ranks · {ev.bytes or 0:,} B · {_fmt_s(ev.seconds)}"
            bars.append(_Bar(lane, ev.timestamp - ev.seconds, ev.timestamp, "#2b8fa0", text, f"fan-out to {text}"))
    names = [t.stage for t in (status.timings if status is not None else [])]
    for previous, stage in itertools.pairwise(names):
        timing = timings[stage]
        if timing.transport is Transport.NONE:
            continue
        put = puts.get(previous)
        start = put.timestamp if put is not None else stage_start.get(stage, end_of_trace)
        end = stage_start.get(stage, start) + timing.transfer_seconds
        lane = f"hop {previous} → {stage}"
        lanes.append(lane)
        logged = [e.transport for e in events if e.event == "nixl.transport" and e.stage == stage and e.transport]
        via = sorted({short_transport(t) or t for t in logged})
        reason = next((str(e.raw["reason"]) for e in events if e.stage in (previous, stage) and "reason" in e.raw), "")
        text = f"{timing.transport.value} · {timing.payload_bytes:,} B · {_fmt_s(timing.transfer_seconds)}"
        title = text + (f" · {', '.join(via)}" if via else "") + (f" · fallback: {reason}" if reason else "")
        colour = _TRANSPORT_COLOURS.get(timing.transport.value, "#555")
        bars.append(_Bar(lane, start, max(end, start), colour, title, title))
    return lanes, bars, marks


def render_html(events: Sequence[TraceEvent], *, request_id: str, table: str) -> str:
    """The page for ``events`` (time-ordered, non-empty); ``table`` is the text trace shown below it."""
    t0, t1 = events[0].timestamp, events[-1].timestamp
    span = max(t1 - t0, 1e-3)
    lanes, bars, marks = _bars(events)

    def x(t: float) -> float:
        return _LABEL_W + (t - t0) / span * _PLOT_W

    height = 40 + _LANE_H * len(lanes) + 30
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LABEL_W + _PLOT_W + 20}" height="{height}" '
           'font-family="sans-serif" font-size="11">']  # fmt: skip
    for i in range(11):  # the time axis
        t = t0 + span * i / 10
        svg.append(f'<line x1="{x(t):.1f}" y1="24" x2="{x(t):.1f}" y2="{height - 20}" stroke="#eee"/>')
        svg.append(f'<text x="{x(t):.1f}" y="16" text-anchor="middle" fill="#555">{_fmt_s(t - t0)}</text>')
    for row, lane in enumerate(lanes):
        y = 30 + row * _LANE_H
        svg.append(f'<text x="6" y="{y + 19}" fill="#222">{_esc(lane)}</text>')
        for bar in (b for b in bars if b.lane == lane):
            left, width = x(bar.start), max(x(bar.end) - x(bar.start), 2.0)
            # A label goes inside its bar when it fits, else after a short bar with room to its right;
            # otherwise only the hover title carries it (no labels drawn over each other).
            label_w = 6.2 * len(bar.label)
            text_x = left + 3 if label_w <= width - 4 else left + width + 3
            fits = label_w <= width - 4 or (bar.lane != "request" and text_x + label_w <= _LABEL_W + _PLOT_W + 20)
            label = f'<text x="{text_x:.1f}" y="{y + 19}" fill="#000">{_esc(bar.label)}</text>' if fits else ""
            svg.append(
                f'<g><title>{_esc(bar.title)}</title><rect x="{left:.1f}" y="{y + 4}" width="{width:.1f}" '
                f'height="{_LANE_H - 10}" rx="3" fill="{bar.colour}" opacity="0.85"/>{label}</g>'
            )
        for t, mark_lane, title in marks:
            if mark_lane == lane:
                svg.append(f'<g><title>{_esc(title)}</title><line x1="{x(t):.1f}" y1="{y + 2}" x2="{x(t):.1f}" '
                           f'y2="{y + _LANE_H - 4}" stroke="#1d3f7a" stroke-width="2"/></g>')  # fmt: skip
    svg.append("</svg>")
    status = _final_status(events)
    outcome = status.state.value if status is not None else "unknown"
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>trace {_esc(request_id)}</title>"
        "<style>body{font-family:sans-serif;margin:16px;color:#222}pre{font-size:11px;overflow-x:auto;"
        "background:#f7f7f7;padding:8px}</style></head><body>\n"
        f"<h2>{_esc(request_id)}: {_esc(outcome)} in {_fmt_s(t1 - t0)}</h2>\n"
        f"<p>{len(events)} events; hover a bar for details.</p>\n"
        + "\n".join(svg)
        + f"\n<h3>events</h3>\n<pre>{_esc(table)}</pre>\n</body></html>\n"
    )


__all__ = ["render_html"]
