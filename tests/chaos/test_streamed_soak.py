"""The soak with streamed requests: a share of the jobs' encoder streams its output to the diffusion stage
in chunks (each over NIXL, its own lease), the diffusion stage checks every chunk came once, in order, with
its own bytes; leader kills and a stall land while streams are in flight.  The same accounting as the
whole-payload soak (tests/reliability/test_soak.py): nothing lost, duplicated or stuck, streamed or not."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from stageferry.chaos.faults import FaultKind
from stageferry.chaos.soak import MIX, STREAM, SoakConfig, mix, render, run_soak
from stageferry.schemas import RequestState

pytestmark = pytest.mark.timeout(300)


def test_the_mix_gives_streamed_jobs_their_share_and_is_unchanged_without_them() -> None:
    assert mix(0.0) is MIX  # a seed draws the same jobs as before streamed ones existed
    weights = dict(mix(0.25))
    assert weights[STREAM] / sum(weights.values()) == pytest.approx(0.25)
    assert weights["t2va"] / weights["fl2va"] == pytest.approx(55 / 25)
    with pytest.raises(ValueError, match="share"):
        SoakConfig(streamed=1.0)


@pytest.mark.slow
def test_streamed_requests_survive_the_soak(tmp_path: Path) -> None:
    cfg = SoakConfig(
        requests=12,
        seed=20261202,
        replicas=1,
        enc_tp=1,
        dif_tp=2,
        window_s=10.0,
        streamed=0.6,
        faults={FaultKind.LEADER_KILL: 2, FaultKind.STALL: 1},
        work_dir=tmp_path,
        drain_s=150.0,
        fault_wait_s=60.0,
    )
    result = anyio.run(run_soak, cfg)
    table = render(result)
    print(table)
    a = result.audit
    streamed = [o for o in a.outcomes if o.request_id.endswith(f"-{STREAM}")]
    assert len(a.outcomes) == 12 and len(streamed) >= 4, table
    assert all(o.state == RequestState.DONE for o in streamed), table  # a whole payload would be "corrupted"
    assert (a.lost, a.duplicated, a.stuck) == (0, 0, 0), table
    assert a.wrong_results == 0 and a.corrupted == 0 and a.unexpected == 0, table
    assert a.resource_leaks() == [] and a.untimed_keys == [], table  # chunk leases freed, chunk keys expire
    assert sum(result.faults.injected.values()) >= 2, table
    assert a.ok, table
