"""The soak audit's metrics scrape: a real exposition (prometheus_client's own writer and HTTP server)
read back with prometheus_client's parser; and how a request's outcome is counted."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import GaugeMetricFamily

from stageferry.chaos.audit import RequestOutcome, resources_in, scrape_resources
from stageferry.embedded_redis import free_port

RESOURCES = {"leases": 0.0, "pool_bytes_in_use": 3.5e9, "registrations": 2.0, "open_handles": 1.0}


class _Probe:
    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("stageferry_dataplane_resources", "Live data-plane resources", labels=["what"])
        for what, value in RESOURCES.items():
            family.add_metric([what], value)
        yield family


def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(_Probe())  # type: ignore[arg-type]
    other = Counter("stageferry_entries", "noise", ["stage", "outcome"], registry=reg)
    other.labels("diffusion", 'what="leases"').inc(7)  # a look-alike label value in another family
    return reg


def test_resources_are_read_from_a_served_exposition() -> None:
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry())
    try:
        assert scrape_resources(port) == RESOURCES
    finally:
        server.shutdown()
        thread.join(timeout=5)


def test_nothing_listening_is_none_and_other_families_are_ignored() -> None:
    assert scrape_resources(free_port(), timeout=1) is None
    assert resources_in('# TYPE x gauge\nx{what="leases"} 4\n') == {}


def outcome(
    state: str | None,
    *,
    code: str | None = None,
    held: bool = False,
    wiped: str | None = None,
    told: str | None = None,
) -> RequestOutcome:
    return RequestOutcome(
        request_id="r", expected="done", state=state, code=code, attempt=0, terminal_events=int(state is not None),
        result_ok=True, held=held, fallback=False, wiped=wiped, told=told,
    )  # fmt: skip


def test_how_an_empty_restart_counts() -> None:
    """Issue 34: a request an empty restart wiped in flight counts as lost to the restart (documented) when it
    ended visibly lost — no record, or failed request_lost — and as lost or stuck (a zombie) otherwise; one
    that had ended counts apart; a waiter told request_lost of a request that then ended otherwise fails."""
    for visibly_lost in (outcome(None, wiped="running"), outcome("failed", code="request_lost", wiped="queued")):
        assert visibly_lost.lost_to_restart and visibly_lost.accounted
        assert not (visibly_lost.lost or visibly_lost.stuck or visibly_lost.contradicted)
    zombie = outcome("running", wiped="running")
    assert zombie.lost and not zombie.lost_to_restart
    assert outcome("running", wiped="running", held=True).stuck
    assert outcome(None, wiped="done").wiped_after_end and not outcome(None, wiped="done").lost
    assert outcome(None).lost, "no record and no empty restart: a real loss"
    assert outcome("done", wiped="running", told="request_lost").contradicted, "lost, then done"
    assert not outcome("failed", code="request_lost", told="request_lost").contradicted
    assert outcome("failed", code="stage_failed", told="done").contradicted
