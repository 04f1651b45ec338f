"""The Sentinel group of the chaos tools against real servers: a group that does not settle says why, in
each node's and each sentinel's own words (what a CI failure leaves the next reader)."""

from __future__ import annotations

import re

import pytest

from stageferry.chaos.sentinels import SentinelGroup
from tests.sentinels import sentinel_group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
__all__ = ["sentinel_group"]


async def test_a_group_that_does_not_settle_shows_every_nodes_replication_and_the_sentinels_view(
    sentinel_group: SentinelGroup,
) -> None:
    group = sentinel_group
    primary = group.primary()
    with pytest.raises(TimeoutError) as caught:
        await group.wait_settled(timeout=0.5, replicas=len(group.nodes))  # one more replica than there are
    message = str(caught.value)
    assert f"master {primary.port} is master with 2/3 replicas" in message, message
    assert f"{primary.port}: master of 2" in message, message
    for node in group.nodes:
        if node is not primary:
            assert f"{node.port}: replica of {primary.port}, link up" in message, message
    for sentinel in group.sentinels:
        assert re.search(rf"sentinel {sentinel.port}: tilt 0, replicas \d+ slave \(slave\), \d+ slave", message)
    assert re.search(r"sentinel log: .*\+(slave|sentinel) ", message), message
