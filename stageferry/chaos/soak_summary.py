"""A chaos soak's result and its summary table.

:class:`SoakResult` is what :func:`stageferry.chaos.soak.run_soak` returns: the audit
(:mod:`stageferry.chaos.audit`), the fault log, restarts and, behind Sentinel, failovers and latency blips;
:func:`render` prints it as a plain-text table of stable layout (the CLI's ``stageferry chaos`` output).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from stageferry.chaos import audit, blip
from stageferry.chaos.failover import Failover
from stageferry.chaos.faults import FAILOVER_KINDS, FaultKind, FaultLog
from stageferry.chaos.soak_config import STREAM, SoakConfig, mix
from stageferry.schemas import RequestState


@dataclass
class SoakResult:
    config: SoakConfig
    seed: int
    audit: audit.Audit
    faults: FaultLog
    restarts: dict[str, int]
    seconds: float
    work_dir: Path
    blips: list[blip.Blip] = field(default_factory=list)
    failovers: list[Failover] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``FAIL`` when the audit found anything lost, duplicated, stuck, corrupted or leaked;
        ``INCOMPLETE`` when it found nothing but a planned fault was missed (it had nothing to hit, see
        :class:`~stageferry.chaos.faults.FaultLog`: the run did not test it); else ``PASS``."""
        if not self.audit.ok:
            return "FAIL"
        return "INCOMPLETE" if self.faults.misses else "PASS"


def render(result: SoakResult) -> str:
    """The summary table (plain text, stable layout)."""
    a = result.audit
    cfg = result.config
    outs = a.outcomes
    rows: list[tuple[str, str]] = []

    def row(name: str, value: object) -> None:
        rows.append((name, str(value)))

    row("seed", result.seed)
    wait = 1 if cfg.wait_replicas is None else cfg.wait_replicas
    redis = f"Sentinel group (1 primary, 2 replicas, 3 sentinels; AOF, WAIT {wait})" if cfg.sentinel else "AOF Redis"
    row(
        "deployment",
        f"encoder TP{cfg.enc_tp} x{cfg.replicas}, diffusion TP{cfg.dif_tp} x{cfg.replicas}, CPU, {redis}",
    )
    row("requests", len(outs))
    kinds = Counter(o.request_id.rsplit("-", 1)[1] for o in outs)
    row("  by kind", ", ".join(f"{k} {kinds[k]}" for k, _ in mix(cfg.streamed) if kinds[k]))
    if cfg.streamed:
        streamed = [o for o in outs if o.request_id.endswith(f"-{STREAM}")]
        row("  streamed (chunks encoder -> diffusion)",
            f"{len(streamed)}: done {sum(o.state == RequestState.DONE for o in streamed)}, lost to an empty "
            f"restart {sum(o.lost_to_restart for o in streamed)}, lost {sum(o.lost for o in streamed)}, duplicated "
            f"{sum(o.duplicated for o in streamed)}, stuck {sum(o.stuck for o in streamed)}")  # fmt: skip
    row("faults injected", sum(result.faults.injected.values()))
    for kind in FaultKind:
        if kind in FAILOVER_KINDS and not cfg.sentinel:
            continue
        missed = result.faults.missed[kind.value]
        row(f"  {kind.value}", f"{result.faults.injected[kind.value]}" + (f"  (missed {missed})" if missed else ""))
    row("replica restarts", sum(result.restarts.values()))
    row("done", a.count(lambda o: o.state == RequestState.DONE))
    failed = Counter(o.code or "?" for o in outs if o.state == RequestState.FAILED)
    row("failed", sum(failed.values()))
    for code, n in sorted(failed.items()):
        scripted = sum(
            1 for o in outs if o.state == RequestState.FAILED and o.code == code and o.expected == RequestState.FAILED
        )
        row(f"  {code}", f"{n}" + (f"  ({scripted} scripted 'fail' jobs)" if scripted else ""))
    row("rejected", a.count(lambda o: o.state == RequestState.REJECTED))
    row("recomputed (requests)", a.count(lambda o: o.attempt > 0))
    row("recomputes (events)", a.log_events["recompute"])
    row("inline fallbacks", a.log_events["inline_fallback"])
    for reason, n in sorted(a.fallback_reasons.items()):
        row(f"  {reason}", n)
    row("done via inline fallback", a.count(lambda o: o.state == RequestState.DONE and o.fallback))
    row("fallbacks above the inline cap", a.log_events["fallback_too_large"])
    row("reclaimed entries", a.log_events["reclaimed"])
    row("final-stage runs beyond one", sum(max(0, n - 1) for n in a.final_runs.values()))
    row("late results discarded", a.log_events["done_duplicate"] + a.log_events["handoff_lost"])
    wiped_in_flight = a.count(
        lambda o: o.wiped is not None and o.wiped not in (RequestState.DONE, RequestState.FAILED, RequestState.REJECTED)
    )
    row("wiped by empty restarts", f"{a.count(lambda o: o.wiped is not None)} ({wiped_in_flight} in flight)")
    row("  lost to an empty restart", f"{a.lost_to_restart}  (ended request_lost, or no record: documented)")
    row("  of them failed request_lost", a.count(lambda o: o.lost_to_restart and o.state == RequestState.FAILED))
    lost_told = Counter(o.told or "nothing" for o in outs if o.lost_to_restart)
    row("  their waiters were told", ", ".join(f"{k} {n}" for k, n in sorted(lost_told.items())) or "-")
    row("  wiped after they ended", a.count(lambda o: o.wiped_after_end))
    row("waiters told request_lost", a.count(lambda o: o.told == "request_lost"))
    row("waiters told otherwise than the end", a.contradicted)
    row("lost", a.lost)
    row("duplicated", a.duplicated)
    row("stuck", a.stuck)
    row("wrong results / corrupted", f"{a.wrong_results} / {a.corrupted}")
    row("unexpected outcomes", a.unexpected)
    for stage, info in a.streams.items():
        row(f"stream {stage}", f"length {info['length']}, pending {info['pending']}, dlq {info['dlq']}")
    for stage, reasons in a.dead_letters.items():
        for reason, n in reasons.items():
            row(f"  dlq {stage}", f"{n} x {reason}")
    row("resend backlog (dead producers)", a.resend_backlog)
    row("keys without TTL (leaks)", len(a.untimed_keys))
    for key in a.untimed_keys[:10]:
        row("  key", key)
    leaks = a.resource_leaks()
    row("live leaders at baseline", f"{len(a.resources) - len({x.split(':')[0] for x in leaks})}/{len(a.resources)}")
    for leak in leaks:
        row("  leak", leak)
    for replica, now in sorted(a.resources.items()):
        if now is not None:
            row(f"  {replica}", ", ".join(f"{k}={int(now.get(k, 0))}" for k in ("leases", "pool_slots_in_use",
                "open_handles", "registrations", "registered_bytes", "remote_agents")))  # fmt: skip
    if cfg.sentinel:
        times = [f.first_write_s for f in result.failovers]
        row("failovers", len(times))
        if times:
            row("  failover time", f"median {blip.pct(times, 50):.2f}s, max {max(times):.2f}s (fault -> first write)")
        for f in result.failovers:
            row(f"  {f.kind}", f"{f.first_write_s:.2f}s, master {f.old_port} -> {f.new_port}")
            if f.stale is not None:
                st = f.stale
                refused = "never" if st.refused_after_s is None else f"after {st.refused_after_s:.1f}s"
                row("    stale writer on the old master", f"{st.accepted} writes taken, {len(st.acknowledged)} "
                    f"acknowledged by WAIT ({st.lost_acknowledged} of those lost), NOREPLICAS {refused}")  # fmt: skip
        for b in result.blips:
            row(f"  latency {b.what}", b.row())
    row("wall seconds", f"{result.seconds:.0f}")
    verdict = result.verdict
    if verdict == "INCOMPLETE":
        planned = sum(result.faults.injected.values()) + len(result.faults.misses)
        verdict += f": nothing lost, but {len(result.faults.misses)} of {planned} faults missed (not tested)"
    row("verdict", verdict)
    for miss in result.faults.misses:
        row("  missed", miss)
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    bar = "-" * max(len(line) for line in lines)
    return "\n".join(["fault timeline:", *result.faults.lines, "", bar, *lines, bar])
