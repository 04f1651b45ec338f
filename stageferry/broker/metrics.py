"""Prometheus metrics of the data and control planes, defined once.

Every put/get records transport, bytes and time; every fallback its reason.  A service exposes them
with ``STAGEFERRY_METRICS_PORT`` (see :func:`stageferry.stages.service.serve`).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
