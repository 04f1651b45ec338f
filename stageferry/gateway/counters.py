"""The Prometheus counters the console shows: puts, gets, bytes, fallbacks, failures, outcomes.

The data-plane counters live in the stage processes, not in the gateway, so the gateway reads them from
their ``/metrics`` endpoints (``STAGEFERRY_METRICS_PORT`` on each stage; the URLs are the gateway's
``metrics_urls``), plus its own registry.  Each source is scraped with a short timeout and its failure is
reported in the answer, never raised: a stage that is down must not break the page.  Only the families in
:data:`SHOWN` are kept, summed over sources by label set.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import httpx
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stageferry.schemas.console_api import CountersReport, MetricsSource

#: Metric families shown (counter families without their ``_total`` suffix, as the parser names them).
SHOWN = (
    "stageferry_payload_puts",
    "stageferry_payload_gets",
    "stageferry_payload_bytes",
    "stageferry_inline_fallbacks",
    "stageferry_recomputes",
    "stageferry_nixl_handshake_failures",
    "stageferry_nixl_transfer_failures",
    "stageferry_entries",
    "stageferry_pool_bytes_in_use",
    "stageferry_gateway_jobs",
)
#: Longest one scrape may take.
SCRAPE_TIMEOUT_S = 2.0
#: A metrics page larger than this is not parsed (a misconfigured URL pointing at something else).
MAX_SCRAPE_BYTES = 4 * 1024 * 1024


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


def add_exposition(counters: dict[str, dict[str, float]], text: str) -> None:
    """Add the shown samples of one Prometheus text exposition into ``counters`` (family → labels → value)."""
    for family in text_string_to_metric_families(text):
        if family.name not in SHOWN:
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            bucket = counters.setdefault(family.name, {})
            key = _labels(sample.labels)
            bucket[key] = bucket.get(key, 0.0) + sample.value


async def _scrape(http: httpx.AsyncClient, url: str) -> str:
    async with http.stream("GET", url) as reply:
        reply.raise_for_status()
        body = bytearray()
        async for chunk in reply.aiter_bytes():
            body += chunk
            if len(body) > MAX_SCRAPE_BYTES:
                raise ValueError(f"more than {MAX_SCRAPE_BYTES} bytes")
    return body.decode(errors="replace")


async def collect(urls: Sequence[str]) -> CountersReport:
    """This process's counters plus those of every URL that answers in time, summed."""
    counters: dict[str, dict[str, float]] = {}
    sources = [MetricsSource(source="gateway", ok=True)]
    add_exposition(counters, generate_latest(REGISTRY).decode())
    texts: dict[str, str | Exception] = {}

    async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S, follow_redirects=False, trust_env=False) as http:

        async def one(url: str) -> None:
            try:
                with anyio.fail_after(SCRAPE_TIMEOUT_S * 2):
                    texts[url] = await _scrape(http, url)
            except (httpx.HTTPError, ValueError, TimeoutError) as exc:
                texts[url] = exc

        async with anyio.create_task_group() as tg:
            for url in urls:
                tg.start_soon(one, url)

    for url in urls:
        result = texts.get(url)
        if isinstance(result, str):
            try:
                add_exposition(counters, result)
            except ValueError as exc:
                result = exc
        if isinstance(result, str):
            sources.append(MetricsSource(source=url, ok=True))
        else:
            sources.append(MetricsSource(source=url, ok=False, error=f"{type(result).__name__}: {result}"[:200]))
    return CountersReport(sources=sources, counters=counters)
