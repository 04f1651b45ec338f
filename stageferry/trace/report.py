"""A request's trace as the console's timeline: ``GET /v1/videos/{id}/trace``.

The rows and hops are :mod:`stageferry.trace.events`'s (the same ones ``stageferry trace`` prints); this module
only arranges them for a timeline: offsets from the first event, one span per stage (queue wait before
it, model time and how its input arrived, from the final status's timings), and the events worth a
second look pulled out — inline fallbacks and every kind of retry (reclaimed entries, recomputes,
resends, lost claims).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from stageferry.config import PipelineConfig
from stageferry.schemas import RequestState, RequestStatus, Transport
from stageferry.schemas.console_api import StageSpan, TraceHop, TraceReport, TraceRow
from stageferry.trace.events import TraceEvent, hops

#: Event names containing one of these count as a retry of some kind.
RETRY_MARKERS = ("reclaimed", "recompute", "retry", "resend", "redeliver", "claim_lost", "handoff_lost")
#: Keys of a logged event that name memory kinds (``cpu``, ``cuda``).
MEMORY_KEYS = ("memory", "memory_kind", "memory_kinds", "kinds", "device_kind")
#: At most this many events go into one report (a trace is capped by ``retention.events_maxlen`` anyway).
MAX_ROWS = 2000


def trace_report(
    request_id: str, status: RequestStatus, events: Sequence[TraceEvent], pipeline: PipelineConfig
) -> TraceReport:
    """The timeline of one request from its events (time-ordered) and its current status."""
    events = list(events)[-MAX_ROWS:]
    t0 = events[0].timestamp if events else None
    rows = [_row(ev, t0 if t0 is not None else ev.timestamp) for ev in events]
    hop_rows = [
        TraceHop(
            state=h.state,
            stage=h.stage,
            offset_s=_finite(h.start - t0) or 0.0 if t0 is not None else 0.0,
            seconds=_finite(h.seconds),
            transports=list(h.transports),
        )
        for h in hops(events)
    ]
    memory = sorted({kind for row in rows if row.memory for kind in row.memory.split(",")})
    return TraceReport(
        request_id=request_id,
        state=status.state.value,
        started_at=t0,
        total_s=_finite(events[-1].timestamp - t0) if events and t0 is not None else None,
        stages=_spans(status, hop_rows, rows, pipeline),
        hops=hop_rows,
        events=rows,
        fallbacks=[r for r in rows if "fallback" in r.event],
        retries=[r for r in rows if any(marker in r.event for marker in RETRY_MARKERS)],
        memory_kinds=memory,
    )


def _spans(
    status: RequestStatus, hop_rows: list[TraceHop], rows: list[TraceRow], pipeline: PipelineConfig
) -> list[StageSpan]:
    """One span per configured stage: a queued hop is the wait of the stage that runs next."""
    waits: dict[str, float] = {}
    pending_wait = 0.0
    for hop in hop_rows:
        if hop.state == RequestState.QUEUED:
            pending_wait += hop.seconds or 0.0
        elif hop.state == RequestState.RUNNING and hop.stage is not None:
            waits[hop.stage] = waits.get(hop.stage, 0.0) + pending_wait
            pending_wait = 0.0
    running = {h.stage: h.seconds for h in hop_rows if h.state == RequestState.RUNNING and h.stage is not None}
    timings = {t.stage: t for t in status.timings}
    spans = []
    for stage in pipeline.stages:
        timing = timings.get(stage.name)
        ranks = sorted({r.rank for r in rows if r.stage == stage.name and r.rank is not None})
        spans.append(
            StageSpan(
                stage=stage.name,
                queue_wait_s=waits.get(stage.name),
                model_s=_finite(timing.seconds) if timing is not None else running.get(stage.name),
                transport=timing.transport.value if timing and timing.transport is not Transport.NONE else None,
                payload_bytes=timing.payload_bytes if timing and timing.payload_bytes else None,
                transfer_s=_finite(timing.transfer_seconds) if timing and timing.transfer_seconds else None,
                fan_out=stage.layout.world_size,
                ranks_seen=ranks,
            )
        )
    return spans


def _row(ev: TraceEvent, t0: float) -> TraceRow:
    return TraceRow(
        offset_s=_finite(ev.timestamp - t0) or 0.0,
        kind=ev.kind,
        event=ev.event[:120],
        service=ev.service,
        stage=ev.stage,
        rank=ev.rank,
        transport=ev.transport,
        memory=_memory(ev.raw) if ev.kind == "log" else None,
        bytes=ev.bytes,
        seconds=_finite(ev.seconds),
        detail=ev.detail[:300],
    )


def _memory(raw: Mapping[str, Any]) -> str | None:
    for key in MEMORY_KEYS:
        value = raw.get(key)
        if isinstance(value, str) and value:
            return value[:40]
        if isinstance(value, list | tuple) and value:
            return ",".join(str(v)[:16] for v in value[:4])
    return None


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)
