"""The latency blip of failovers: request latencies during a failover against those outside any.

A request is *during* a failover when its lifetime (submitted → terminal, or the submission alone for
the acknowledgement latency) overlaps a failover's window (the fault → the first successful write on the
new master).  Percentiles are nearest-rank over each group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from stageferry.chaos.failover import Failover


@dataclass(frozen=True, slots=True)
class Submitted:
    """One submission as the soak's client saw it (wall-clock seconds, ``time.time()``)."""

    request_id: str
    started: float
    acknowledged: float


@dataclass(frozen=True, slots=True)
class Blip:
    what: str
    during: tuple[float, ...]
    outside: tuple[float, ...]

    def row(self) -> str:
        return (
            f"p50/p99 {_ms(pct(self.during, 50))}/{_ms(pct(self.during, 99))} during ({len(self.during)}) vs "
            f"{_ms(pct(self.outside, 50))}/{_ms(pct(self.outside, 99))} outside ({len(self.outside)})"
        )


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f} ms"


def windows(failovers: Iterable[Failover], *, wall_minus_mono: float) -> list[tuple[float, float]]:
    """Each failover's window in wall-clock seconds."""
    return [(start + wall_minus_mono, end + wall_minus_mono) for start, end in (f.window for f in failovers)]


def split(spans: Iterable[tuple[float, float]], wins: Sequence[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Durations of ``spans`` (start, end), those overlapping a window first."""
    during: list[float] = []
    outside: list[float] = []
    for start, end in spans:
        (during if any(start <= w_end and end >= w_start for w_start, w_end in wins) else outside).append(end - start)
    return during, outside


def blips(
    submitted: Sequence[Submitted], ended_ms: dict[str, int | None], wins: Sequence[tuple[float, float]]
) -> list[Blip]:
    """The acknowledgement latency (submit returned) and the end-to-end latency (submitted → terminal)."""
    acks = split(((s.started, s.acknowledged) for s in submitted), wins)
    ends = split(((s.started, ms / 1000) for s in submitted if (ms := ended_ms.get(s.request_id)) is not None), wins)
    return [
        Blip("submit acknowledged", tuple(acks[0]), tuple(acks[1])),
        Blip("submitted -> terminal", tuple(ends[0]), tuple(ends[1])),
    ]


__all__ = ["Blip", "Submitted", "blips", "pct", "split", "windows"]
