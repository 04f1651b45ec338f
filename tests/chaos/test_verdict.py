"""The soak's verdict: a fault that had nothing to hit is *missed*, and a run with a missed fault is not a
``PASS`` (it did not test that fault), however clean its audit.  The misses are real: an injector run
against a cluster with no replica up and its Redis down."""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from stageferry.chaos.audit import Audit, RequestOutcome
from stageferry.chaos.cluster import Cluster
from stageferry.chaos.faults import Fault, FaultKind, FaultLog, FaultPlan, Injector
from stageferry.chaos.soak import SoakConfig, SoakResult, render


def result(tmp_path: Path, faults: FaultLog, outcomes: list[RequestOutcome] | None = None) -> SoakResult:
    audit = Audit(outcomes=outcomes or [], streams={}, dead_letters={}, resend_backlog=0, untimed_keys=[],
                  resources={}, baseline={})  # fmt: skip
    return SoakResult(SoakConfig(requests=1, seed=1), 1, audit, faults, {}, 1.0, tmp_path)


def test_faults_with_nothing_to_hit_make_the_run_incomplete_not_pass(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, prefix="t-verdict", pipeline_file=tmp_path / "p.toml", replicas=[], stage_seconds=0.0)
    cluster.failpoint_dir.mkdir()
    kinds = (FaultKind.LEADER_KILL, FaultKind.CONSUMER_MID_READ, FaultKind.REDIS_RESTART)
    plan = FaultPlan(seed=1, faults=tuple(Fault(0.0, kind) for kind in kinds))
    injector = Injector(cluster, plan, stall_s=0.1, failpoint_wait_s=0.3)
    anyio.run(injector.run, time.monotonic())
    log = injector.log
    assert sum(log.injected.values()) == 0 and sum(log.missed.values()) == 3
    assert sorted(m.split(" ")[0] for m in log.misses) == sorted(k.value for k in kinds)

    incomplete = result(tmp_path, log)
    assert incomplete.audit.ok and incomplete.verdict == "INCOMPLETE"
    table = render(incomplete)
    [verdict] = [line for line in table.splitlines() if line.startswith("verdict")]
    assert "PASS" not in verdict and "3 of 3 faults missed (not tested)" in verdict, table
    assert "no live target" in table and "nobody reached consumer_read_posted" in table
    assert "Redis is down already" in table

    assert result(tmp_path, FaultLog()).verdict == "PASS"
    lost = RequestOutcome("r-1", "done", None, None, 0, 0, result_ok=False, held=False, fallback=False)
    assert result(tmp_path, log, [lost]).verdict == "FAIL"  # the audit's trouble comes first
