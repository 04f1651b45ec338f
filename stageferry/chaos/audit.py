"""After a soak: account for every request and check that the deployment is back to its baseline.

Per request (``expected`` is what its submission asked for: done, failed or rejected):

* its terminal state and, for failures, the error code; ``done`` must come with the right result;
* **duplicated** — more than one terminal status event in its events stream (the status script writes
  a terminal state once, so a second one would mean two deliveries of the result);
* **stuck** — not terminal after the drain, yet still held somewhere (a stage stream or pending list);
* **lost** — not terminal, and held nowhere (or its record is gone altogether) — except as follows;
* **lost to an empty restart** — Redis had the request, not yet terminal, when an ``empty_restart``
  wiped it, and it ended visibly lost: ``failed`` ``request_lost`` (a stage that held its entry ended it),
  or no record at all (its entry was waiting in a stream: nobody holds it; its waiter was told
  ``request_lost``).  The documented outcome of an empty restart (docs/reliability.md), not a loss of the
  soak's: counted on its own line.  A wiped request still ``queued``/``running`` afterwards is stuck or
  lost (a zombie), one that ends ``done`` or otherwise after all is fine only if no waiter was told
  ``request_lost``;
* **wiped after it ended** — terminal before the empty restart took its record: its waiter had its answer;
* **contradicted** — its waiter (one ``Client.wait`` per request, from its submission) was told one thing
  and the request ended another: ``request_lost`` and then anything but lost, or one terminal state and
  then another.

Deployment-wide: stage stream lengths and pending entries (must be 0: acknowledged entries are
deleted), dead-letter contents, resend streams, and each live leader's data-plane resources (leases,
pool slots and bytes, open transfer handles, registered memory) against its own start-up baseline.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as sync_redis
from prometheus_client.parser import text_string_to_metric_families

from stageferry.broker.control.keys import Keys
from stageferry.errors import RequestLostError
from stageferry.schemas import TERMINAL_STATES, RequestState, RequestStatus

#: The terminal states a job of the soak can be scripted to end in (none is cancelled).
SETTLED_STATES = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.REJECTED})

_RESOURCES = "stageferry_dataplane_resources"
#: Resources that must be back exactly where they started once a leader is idle.
AT_REST = ("leases", "pool_slots_in_use", "pool_bytes_in_use", "open_handles", "registrations", "registered_bytes")


def scrape_resources(port: int, timeout: float = 5.0) -> dict[str, float] | None:
    """A live leader's ``stageferry_dataplane_resources``; None if its metrics endpoint does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    return resources_in(text)


def resources_in(text: str) -> dict[str, float]:
    """``what`` → value of every ``stageferry_dataplane_resources`` sample in a Prometheus text exposition."""
    return {
        sample.labels["what"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == _RESOURCES
        for sample in family.samples
        if sample.name == _RESOURCES and "what" in sample.labels
    }


@dataclass
class RequestOutcome:
    request_id: str
    expected: str
    state: str | None
    code: str | None
    attempt: int
    terminal_events: int
    result_ok: bool
    held: bool
    fallback: bool
    #: When its (first) terminal status reached Redis: the event's entry id, ms since the epoch.
    ended_ms: int | None = None
    #: Its state when an empty restart wiped Redis (``submitted``: only the client's marker), or None.
    wiped: str | None = None
    #: What its waiter was told: a terminal state, or an error code (``request_lost``, ``deadline_exceeded``).
    told: str | None = None

    @property
    def duplicated(self) -> bool:
        return self.terminal_events > 1

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def ended_lost_by_code(self) -> bool:
        """Ended ``failed`` ``request_lost``."""
        return self.state == RequestState.FAILED and self.code == RequestLostError.code

    @property
    def ended_lost(self) -> bool:
        """No record, or ``failed`` ``request_lost``: lost, and visibly so."""
        return self.state is None or self.ended_lost_by_code

    @property
    def lost_to_restart(self) -> bool:
        """Wiped in flight by an empty restart and ended visibly lost (the documented outcome)."""
        return self.wiped is not None and self.wiped not in TERMINAL_STATES and self.ended_lost

    @property
    def wiped_after_end(self) -> bool:
        return self.wiped in TERMINAL_STATES and self.state is None

    @property
    def accounted(self) -> bool:
        """Terminal, or accounted for by an empty restart."""
        return self.terminal or self.lost_to_restart or self.wiped_after_end

    @property
    def lost(self) -> bool:
        return not self.accounted and not self.held

    @property
    def stuck(self) -> bool:
        return not self.accounted and self.held

    @property
    def contradicted(self) -> bool:
        """Its waiter was told something the request's end does not agree with."""
        if self.told == RequestLostError.code:
            return not self.ended_lost
        if self.told in TERMINAL_STATES and self.state is not None:
            return self.told != self.state and not self.ended_lost_by_code
        return False


@dataclass
class Audit:
    outcomes: list[RequestOutcome]
    streams: dict[str, dict[str, int]]
    dead_letters: dict[str, Counter[str]]
    resend_backlog: int
    untimed_keys: list[str]
    resources: dict[str, dict[str, float] | None]
    baseline: dict[str, dict[str, float]]
    final_runs: Counter[str] = field(default_factory=Counter)
    log_events: Counter[str] = field(default_factory=Counter)
    fallback_reasons: Counter[str] = field(default_factory=Counter)

    def count(self, pred: Any) -> int:
        return sum(1 for o in self.outcomes if pred(o))

    @property
    def lost(self) -> int:
        return self.count(lambda o: o.lost)

    @property
    def duplicated(self) -> int:
        return self.count(lambda o: o.duplicated)

    @property
    def stuck(self) -> int:
        return self.count(lambda o: o.stuck)

    @property
    def lost_to_restart(self) -> int:
        return self.count(lambda o: o.lost_to_restart)

    @property
    def contradicted(self) -> int:
        return self.count(lambda o: o.contradicted)

    @property
    def wrong_results(self) -> int:
        return self.count(lambda o: o.state == RequestState.DONE and not o.result_ok)

    @property
    def corrupted(self) -> int:
        return self.log_events["payload_corrupted"]

    @property
    def unexpected(self) -> int:
        """Scripted outcomes that did not happen (a ``fail`` job done, an invalid job not rejected...)."""
        return self.count(
            lambda o: o.terminal and o.expected != RequestState.DONE and o.state != o.expected and not o.wiped
        )

    def resource_leaks(self) -> list[str]:
        leaks = []
        for replica, now in self.resources.items():
            if now is None:
                leaks.append(f"{replica}: metrics endpoint not answering")
                continue
            base = self.baseline.get(replica, {})
            for what in AT_REST:
                if now.get(what, 0.0) != base.get(what, 0.0):
                    leaks.append(f"{replica}: {what} {now.get(what)} (baseline {base.get(what)})")
        return leaks

    def stream_leftovers(self) -> list[str]:
        return [
            f"{stage}: {what}={n}"
            for stage, info in self.streams.items()
            for what, n in info.items()
            if n and what != "dlq"
        ]

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.stuck
            or self.contradicted
            or self.wrong_results
            or self.corrupted
            or self.unexpected
            or self.resource_leaks()
            or self.stream_leftovers()
            or self.untimed_keys
        )


def outcomes(
    client: sync_redis.Redis,
    keys: Keys,
    expected: dict[str, str],
    stages: Iterable[str],
    *,
    wiped: Mapping[str, str] | None = None,
    told: Mapping[str, str] | None = None,
) -> list[RequestOutcome]:
    """Every submitted request's outcome, read from Redis; ``wiped``: what empty restarts took (id → its
    state then), ``told``: what each request's waiter was told."""
    wiped, told = wiped or {}, told or {}
    held = _held_requests(client, keys, stages)
    out = []
    for rid, want in expected.items():
        raw = client.hget(keys.request(rid), "status")
        status = None if raw is None else RequestStatus.model_validate_json(raw)
        terminal_events = 0
        ended_ms = None
        for eid, fields in client.xrange(keys.events(rid)):
            if fields.get(b"kind") == b"status" and fields.get(b"state", b"").decode(errors="replace") in (
                RequestState.DONE,
                RequestState.FAILED,
                RequestState.REJECTED,
            ):
                terminal_events += 1
                ended_ms = ended_ms or int(eid.split(b"-")[0])
        result_ok = False
        fallback = False
        if status is not None and status.state is RequestState.DONE:
            stored = client.get(keys.result(rid)) or b""
            result_ok = stored.split(b" ")[:2] == [b"ok", rid.encode()]
            hops = [t for t in status.timings if t.payload_bytes > 65_536]
            fallback = any(t.transport.value == "inline" for t in hops)
        out.append(
            RequestOutcome(
                request_id=rid,
                expected=want,
                state=None if status is None else status.state.value,
                code=None if status is None or status.error is None else status.error.code,
                attempt=0 if status is None else status.attempt,
                terminal_events=terminal_events,
                result_ok=result_ok,
                held=rid in held,
                fallback=fallback,
                ended_ms=ended_ms,
                wiped=wiped.get(rid),
                told=told.get(rid),
            )
        )
    return out


def _held_requests(client: sync_redis.Redis, keys: Keys, stages: Iterable[str]) -> set[str]:
    """Request ids that some stage stream still holds (pending or not yet read)."""
    held = set()
    for stage in stages:
        for _eid, fields in client.xrange(keys.stage_stream(stage)):
            rid = fields.get(b"request_id")
            if rid:
                held.add(rid.decode(errors="replace"))
    return held


def stream_state(client: sync_redis.Redis, keys: Keys, stages: Iterable[str]) -> dict[str, dict[str, int]]:
    out = {}
    for stage in stages:
        stream = keys.stage_stream(stage)
        try:
            pending = int(client.xpending(stream, stage)["pending"])
        except sync_redis.ResponseError:
            pending = 0
        out[stage] = {"length": client.xlen(stream), "pending": pending, "dlq": client.xlen(keys.dead_letter(stage))}
    return out


def dead_letters(client: sync_redis.Redis, keys: Keys, stages: Iterable[str]) -> dict[str, Counter[str]]:
    return {
        stage: Counter(
            f"{f.get(b'error_code', b'?').decode()}: {f.get(b'reason', b'').decode(errors='replace')[:60]}"
            for _eid, f in client.xrange(keys.dead_letter(stage))
        )
        for stage in stages
    }


def resend_backlog(client: sync_redis.Redis, keys: Keys) -> int:
    """Resend requests nobody answered (addressed to producers that died): informational."""
    pattern = keys.resend("*")
    return sum(client.xlen(k) for k in client.scan_iter(match=pattern, count=1000))


def untimed_keys(client: sync_redis.Redis, keys: Keys, stages: Iterable[str]) -> list[str]:
    """Keys under the prefix that would stay forever: only the stage streams and dead-letter streams may."""
    allowed = {k for s in stages for k in (keys.stage_stream(s), keys.dead_letter(s))}
    out = []
    for raw in client.scan_iter(match=f"{keys.prefix}:*", count=1000):
        key = raw.decode(errors="replace")
        if key not in allowed and client.ttl(raw) == -1:
            out.append(key)
    return sorted(out)


def log_tallies(log_dir: Path) -> tuple[Counter[str], Counter[str]]:
    """From every service's JSON log: recompute / fallback / reclaim / corruption events, and the
    inline fallback reasons.  Logs survive SIGKILL (one write per line), unlike in-process metrics."""
    events: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            name = event.get("event")
            if name == "request.recompute":
                events["recompute"] += 1
            elif name == "payload.inline_fallback":
                events["inline_fallback"] += 1
                reasons[f"{event.get('side', 'producer')}:{event.get('reason')}"] += 1
            elif name == "payload.inline_fallback_too_large":
                events["fallback_too_large"] += 1
            elif name == "stream.reclaimed":
                events["reclaimed"] += 1
            elif name == "worker.handoff_lost":
                events["handoff_lost"] += 1
            elif name == "request.done_duplicate":
                events["done_duplicate"] += 1
            elif name == "group.broken":
                events["group_broken"] += 1
            if "payload corrupted" in line and name == "request.failed":
                events["payload_corrupted"] += 1
    return events, reasons


def final_runs(record: Path) -> Counter[str]:
    if not record.exists():
        return Counter()
    return Counter(line.split()[0] for line in record.read_text().splitlines() if line.strip())
