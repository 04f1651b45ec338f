"""Prometheus metrics of the data and control planes, defined once.

Every put/get records transport, bytes and time; every fallback its reason.  A service exposes them
with ``STAGEFERRY_METRICS_PORT`` (see :func:`stageferry.stages.process.service.serve_leader`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

_SECONDS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

PUTS = Counter("stageferry_payload_puts_total", "Payloads put by producer leaders", ["transport"])
GETS = Counter("stageferry_payload_gets_total", "Payloads fetched by consumer leaders", ["transport"])
BYTES = Counter("stageferry_payload_bytes_total", "Payload bytes moved", ["direction", "transport"])
FALLBACKS = Counter("stageferry_inline_fallbacks_total", "Payloads that fell back to inline", ["reason"])
RECOMPUTES = Counter("stageferry_recomputes_total", "Requests sent back upstream to be recomputed", ["reason"])
HANDSHAKE_FAILURES = Counter("stageferry_nixl_handshake_failures_total", "NIXL handshakes that failed", ["reason"])
TRANSFER_FAILURES = Counter("stageferry_nixl_transfer_failures_total", "NIXL READs that failed", ["reason"])
TRANSFER_SECONDS = Histogram(
    "stageferry_transfer_seconds", "Time to move one payload", ["transport", "direction"], buckets=_SECONDS
)
POOL_BYTES_IN_USE = Gauge("stageferry_pool_bytes_in_use", "Registered pool bytes held by payloads", ["kind"])
ENTRIES = Counter("stageferry_entries_total", "Stage stream entries by outcome", ["stage", "outcome"])
STAGE_SECONDS = Histogram("stageferry_stage_seconds", "Model time per request", ["stage"], buckets=_SECONDS)


class _ResourceProbe:
    """A collector that reads live data-plane resources at scrape time (leases, pool slots, registrations,
    remote agents), so a soak can check that every live process is back to its baseline."""

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] | None = None

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        source = self.source
        if source is None:
            return
        family = GaugeMetricFamily("stageferry_dataplane_resources", "Live data-plane resources", labels=["what"])
        for what, value in source().items():
            family.add_metric([what], value)
        yield family


_PROBE = _ResourceProbe()
REGISTRY.register(_PROBE)  # type: ignore[arg-type]


def watch_resources(source: Callable[[], Mapping[str, float]]) -> None:
    """Expose ``source()`` as ``stageferry_dataplane_resources{what=...}`` (one source per process)."""
    _PROBE.source = source
