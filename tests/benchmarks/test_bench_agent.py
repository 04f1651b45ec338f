"""The benchmarks' NIXL agent (``benchmarks/nixl_bench_agent.py``): prepared lists, reposts, WRITE and
warm-up between two real agents in two processes, and NIXL's clean-up order on close."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.nixl_bench_agent import BenchAgent, MemKind
from tests.broker.data.nixl.test_agent import BLOCKS, NBYTES, Producer, pattern, wait_done

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(90)


def test_prepared_lists_repost_and_warm_up() -> None:
    agent = BenchAgent(f"test-bench-consumer-{os.getpid()}")
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    agent.register(dst)
    prod = Producer("test-bench-producer", salt=3)
    try:
        name = agent.add_remote(prod.metadata)
        agent.warm_up(name)
        # Block-indexed READ of remote block 3 into local block 0, then a repost of the same handle.
        blk = NBYTES // BLOCKS
        addr, _, dev = prod.region
        local = agent.prepare_local([(dst.data_ptr() + i * blk, blk, 0) for i in range(BLOCKS)], MemKind.DRAM)
        remote = agent.prepare_remote(name, [(addr + i * blk, blk, dev) for i in range(BLOCKS)], MemKind.DRAM)
        h = agent.start_read_indexed(local, [0], remote, [3], b"req-2")
        wait_done(agent, h)
        assert torch.equal(dst[:blk], pattern(NBYTES, 3)[3 * blk :])
        agent.repost(h, b"req-3")
        wait_done(agent, h)
        assert sorted(prod.notifs(2)[agent.name]) == [b"req-2", b"req-3"]
        agent.release(h)
        agent.release_prepared(local)
        agent.release_prepared(remote)
        assert agent.open_handles() == 0

        # A prepared list and a handle still open when the peer is removed go first, in NIXL's order.
        local = agent.prepare_local([(dst.data_ptr(), blk, 0)], MemKind.DRAM)
        remote = agent.prepare_remote(name, [(addr, blk, dev)], MemKind.DRAM)
        h = agent.start_read_indexed(local, [0], remote, [0], b"")
        wait_done(agent, h)
        agent.remove_remote(name)
        assert remote.released and agent.open_handles() == 0 and name not in agent.remotes()
        agent.close()
        assert local.released
        assert prod.close() == (1, 0)
    finally:
        prod.kill()
