"""Settling a service's heap once start-up is done, so that the cyclic collector leaves it alone.

A full (generation 2) collection walks every object the process holds.  After start-up that is mostly
what the imports made — torch and the models in a stage (a few hundred thousand objects), FastAPI's
and pydantic's schemas in the gateway (about 90,000) — none of which will ever be garbage.  Walking it
took ≈ 86 ms in the middle of a stage's hop (the p99 spike of short runs), and up to 0.76 s in the
gateway during a 1,000-request burst on a loaded 2-core box, where every request, ``/health`` too,
waited for it.  :func:`settle_heap` collects once and freezes what is left (:func:`gc.freeze`): frozen
objects are never scanned again; what requests allocate is still collected as before.

The gateway also collects its youngest generation less often (``young_threshold``,
:data:`GATEWAY_YOUNG_THRESHOLD` allocations instead of Python's 700): in a burst it holds a thousand
requests' objects at once, and every tenth collection of the middle generation goes on to a full one
over all of them.  Measured (``benchmarks/gateway_concurrency.py --requests 1000``, this 2-core box under
a load of 11, the gateway's own loop and collector instrumented): collector time in the burst 3.38 s →
0.99 s, the longest full collection 0.64 s → 0.15 s, loop stalls over 0.1 s 26 → 11, the longest
0.74 s → 0.54 s; ``/health`` from a separate process answered in at most 0.49 s → 0.26 s.
"""

from __future__ import annotations

import gc

import structlog

log = structlog.get_logger(__name__)

#: Allocations between collections of the youngest generation in the gateway (Python's default: 700).
GATEWAY_YOUNG_THRESHOLD = 20_000


def settle_heap(event: str = "group.heap_settled", *, young_threshold: int | None = None) -> int:
    """Freeze everything start-up made, once, before the first request; logs ``event`` with the count
    and returns how many objects were frozen.  ``young_threshold``: collect the youngest generation
    after that many allocations from now on (the older generations' thresholds stay)."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, middle, old = gc.get_threshold()
        gc.set_threshold(young_threshold, middle, old)
    frozen = gc.get_freeze_count()
    log.info(event, frozen_objects=frozen, young_threshold=gc.get_threshold()[0])
    return frozen


__all__ = ["GATEWAY_YOUNG_THRESHOLD", "settle_heap"]
