"""The fault-injection soak, short: one replica per stage (encoder TP1, diffusion TP2) on a private AOF
Redis, every fault kind once at a random moment (``empty_restart`` too: Redis comes back without its
data), then the full accounting.  The long run (≥ 200
requests, two replicas of TP2 and TP4 groups) is ``stageferry chaos``; this keeps the same checks in CI."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from stageferry.chaos.faults import FAILOVER_KINDS, FaultKind
from stageferry.chaos.soak import SoakConfig, render, run_soak

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_short_soak_loses_nothing_duplicates_nothing_and_returns_to_baseline(tmp_path: Path) -> None:
    cfg = SoakConfig(
        requests=24,
        seed=20261129,
        replicas=1,
        enc_tp=1,
        dif_tp=2,
        window_s=15.0,
        faults={kind: 1 for kind in FaultKind if kind not in FAILOVER_KINDS},  # the failover ones need --sentinel
        work_dir=tmp_path,
        drain_s=120.0,
        fault_wait_s=60.0,
    )
    result = anyio.run(run_soak, cfg)
    table = render(result)
    print(table)
    a = result.audit
    assert len(a.outcomes) == 24
    assert (a.lost, a.duplicated, a.stuck) == (0, 0, 0), table
    assert a.wrong_results == 0 and a.corrupted == 0 and a.unexpected == 0, table
    assert all(o.accounted for o in a.outcomes), table  # terminal, or taken by the empty restart
    assert a.contradicted == 0, table  # no waiter told request_lost saw the request end otherwise
    assert all(o.ended_lost for o in a.outcomes if o.told == "request_lost"), table
    assert all(o.wiped is not None for o in a.outcomes if o.told == "request_lost"), table
    assert result.faults.injected[FaultKind.EMPTY_RESTART.value] == 1
    assert sum(result.faults.injected.values()) == len(cfg.faults), table  # every planned fault landed
    assert result.faults.injected[FaultKind.REDIS_RESTART.value] == 1
    assert {s: (i["length"], i["pending"]) for s, i in a.streams.items()} == {
        "encoder": (0, 0),
        "diffusion": (0, 0),
    }, table
    assert a.resource_leaks() == [] and a.untimed_keys == [], table
    assert sum(result.restarts.values()) >= 3, "the killed groups were restarted by the runner"
    assert a.ok, table
