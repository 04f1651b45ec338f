"""The soak's failover faults against a real Sentinel group (no stages): each moves the master and is
timed from the fault to the first successful write on the new master; the network cut leaves a stale
writer on the old master's side, whose writes the old master refuses (``NOREPLICAS``) within
``min-replicas-max-lag``, none of what it took is acknowledged by ``WAIT``, and it rejoins as a replica.
Plus the blip arithmetic the soak prints."""

from __future__ import annotations

import anyio
import pytest
import redis

from stageferry.chaos import blip
from stageferry.chaos.failover import Failover, inject
from stageferry.chaos.sentinels import SentinelGroup, iptables_unavailable
from tests.sentinels import sentinel_group
from tests.waits import until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]
__all__ = ["sentinel_group"]


@pytest.mark.parametrize("kind", ["primary_kill", "sentinel_failover"])
async def test_a_failover_fault_moves_the_master_and_is_timed(sentinel_group: SentinelGroup, kind: str) -> None:
    group = sentinel_group
    before = group.primary().port
    done = await inject(group, kind, prefix="t-chaos", settle_s=60, rng_pause=0.1)
    assert done.old_port == before and done.new_port != before
    assert 0 < done.first_write_s < 60
    await group.wait_settled(timeout=60)
    old = next(n for n in group.nodes if n.port == before)

    # The killed master restarts claiming to be master until the sentinels convert it (a loaded box saw it
    # still "master" just after the group settled without it): wait for it to rejoin as a replica.  Or as the
    # master: a loaded box also saw two sentinels fail over in two epochs, the second electing the restarted
    # node (a replica by then) again; the group had moved its master and moved it back, one master either way.
    def rejoined() -> bool:
        try:
            if group.primary().port == before:
                return group.role(old)[0] == "master"
            return group.role(old)[0] == "slave"
        except (OSError, redis.RedisError, RuntimeError):  # still restarting, or the sentinels still electing
            return False

    await until(lambda: anyio.to_thread.run_sync(rejoined), "the old master back in the group", 60)


@pytest.mark.skipif(iptables_unavailable() is not None, reason=str(iptables_unavailable()))
async def test_a_cut_off_primary_refuses_stale_writes_and_loses_no_acknowledged_one(
    sentinel_group: SentinelGroup,
) -> None:
    group = sentinel_group
    done = await inject(group, "primary_cut", prefix="t-chaos", settle_s=60, rng_pause=0.1)
    stale = done.stale
    assert stale is not None and done.new_port != done.old_port
    assert stale.refused_after_s is not None  # min-replicas-to-write: the old master stopped taking writes
    assert stale.refused_after_s < group.max_lag_s + 30
    assert stale.acknowledged == [] and stale.lost_acknowledged == 0  # nothing it took was acknowledged
    assert group.role(next(n for n in group.nodes if n.port == done.old_port))[0] == "slave"
    with group.node_client(group.primary()) as client:  # what it took meanwhile was thrown away
        assert not client.exists("t-chaos:chaos-stale:0")


def test_the_blip_splits_latencies_by_failover_window() -> None:
    failovers = [Failover("primary_kill", started=100.0, first_write_s=2.0, old_port=1, new_port=2)]
    wins = blip.windows(failovers, wall_minus_mono=1000.0)  # wall = monotonic + 1000
    assert wins == [(1100.0, 1102.0)]
    submitted = [
        blip.Submitted("a", 1099.0, 1099.1),
        blip.Submitted("b", 1101.0, 1103.5),
        blip.Submitted("c", 1200, 1200.2),
    ]
    ack, e2e = blip.blips(submitted, {"a": 1_099_500, "b": 1_104_000, "c": None}, wins)
    assert sorted(ack.during) == [pytest.approx(2.5)] and len(ack.outside) == 2
    assert sorted(e2e.during) == [pytest.approx(3.0)] and e2e.outside == (pytest.approx(0.5),)
    assert blip.pct([1, 2, 3, 4, 100], 99) == 100 and "during (1)" in ack.row()
