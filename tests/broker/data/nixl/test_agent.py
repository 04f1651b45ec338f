"""Real NIXL agents, CPU DRAM over UCX, producer and consumer in separate processes.

The producer runs in a spawned child; the test process is the consumer. Only plain ints and bytes
cross the pipe (metadata, (addr, len, dev) regions, notifications), as on the real wire.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import structlog
import torch

from stageferry.broker.data.nixl import agent as agent_module
from stageferry.broker.data.nixl import native, ucx_log
from stageferry.broker.data.nixl.agent import MemKind, NixlAgent, Region, XferState
from stageferry.errors import NixlUnavailableError, PeerDisconnectedError, TransferError

pytest.importorskip("nixl")

NBYTES = 1 << 20
BLOCKS = 4
DEADLINE_S = 5.0

pytestmark = pytest.mark.timeout(90)


def pattern(n: int, salt: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + salt) % 251).to(torch.uint8)


def producer_main(conn: Connection, name: str, salt: int, device: str = "cpu") -> None:
    """Child process: register one tensor (on ``device``), serve notifications until told to stop."""
    agent = NixlAgent(name)
    src = pattern(NBYTES, salt).to(device)
    agent.register(src)
    conn.send((agent.metadata(), NixlAgent.region_of(src)))
    while True:
        cmd, arg = conn.recv()
        if cmd == "notifs":  # wait up to arg seconds for at least `want` notifications
            want, timeout = arg
            got: dict[str, list[bytes]] = {}
            end = time.monotonic() + timeout
            while sum(len(v) for v in got.values()) < want and time.monotonic() < end:
                for k, v in agent.drain_notifs().items():
                    got.setdefault(k, []).extend(v)
                time.sleep(0.001)
            conn.send(got)
        elif cmd == "fill":  # new bytes in the same registered region
            src.copy_(pattern(NBYTES, arg).to(device))
            if src.is_cuda:
                torch.cuda.synchronize()
            conn.send(True)
        elif cmd == "close":
            agent.close()
            conn.send((agent.registrations, agent.open_handles()))
            return


class Producer:
    def __init__(self, name: str, salt: int, device: str = "cpu") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(child, name, salt, device), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(60):
            raise RuntimeError("producer did not start")
        self.metadata, self.region = self.conn.recv()

    def notifs(self, want: int) -> dict[str, list[bytes]]:
        self.conn.send(("notifs", (want, DEADLINE_S)))
        got: dict[str, list[bytes]] = self.conn.recv()
        return got

    def fill(self, salt: int) -> None:
        self.conn.send(("fill", salt))
        assert self.conn.recv()

    def close(self) -> tuple[int, int]:
        self.conn.send(("close", None))
        result: tuple[int, int] = self.conn.recv()
        self.proc.join(10)
        return result

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


def wait_done(agent: NixlAgent, handle: object) -> float:
    """Busy-poll to DONE with a deadline; returns seconds taken."""
    t0 = time.monotonic()
    while agent.poll(handle) is XferState.PROC:
        if time.monotonic() - t0 > DEADLINE_S:
            raise AssertionError("READ did not complete in time")
    return time.monotonic() - t0


def read_recycled(
    agent: NixlAgent, local: Region, remote: Region, name: str, kind: MemKind = MemKind.DRAM, notif: bytes = b""
) -> object:
    """READ ``remote`` into ``local`` (both ``kind``), wait for it, then recycle its handle."""
    handle = agent.start_read([local], kind, [remote], kind, name, notif)
    wait_done(agent, handle)
    agent.recycle(handle)
    return handle


def read_whole(agent: NixlAgent, dst: torch.Tensor, prod: Producer, notif: bytes = b"") -> str:
    """Add ``prod`` as a remote and READ its region into ``dst`` (waited for, released); the remote's name."""
    name = agent.add_remote(prod.metadata)
    handle = agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, name, notif)
    wait_done(agent, handle)
    agent.release(handle)
    return name


@contextlib.contextmanager
def own_agent(name: str, device: str = "cpu") -> Iterator[tuple[NixlAgent, torch.Tensor]]:
    """An agent of the test's own (not the module's ``consumer``) with a registered ``NBYTES`` tensor."""
    agent = NixlAgent(f"{name}-{os.getpid()}")
    try:
        dst = torch.zeros(NBYTES, dtype=torch.uint8, device=device)
        agent.register(dst)
        yield agent, dst
    finally:
        agent.close()


@pytest.fixture(scope="module")
def consumer() -> Iterator[tuple[NixlAgent, torch.Tensor]]:
    agent = NixlAgent(f"test-consumer-{os.getpid()}")
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    agent.register(dst)
    yield agent, dst
    agent.close()


def test_read_roundtrip_notif_and_handles(consumer: tuple[NixlAgent, torch.Tensor]) -> None:
    agent, dst = consumer
    base = agent.open_handles()
    prod = Producer("test-producer-a", salt=3)
    try:
        name = agent.add_remote(prod.metadata)
        assert name == "test-producer-a"
        assert name in agent.remotes()

        dst.zero_()
        h = agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, name, b"req-1")
        assert agent.open_handles() == base + 1
        wait_done(agent, h)
        agent.release(h)
        agent.release(h)  # idempotent
        assert agent.open_handles() == base
        assert torch.equal(dst, pattern(NBYTES, 3))
        assert prod.notifs(1) == {agent.name: [b"req-1"]}

        # Bad requests fail fast and typed, leaving no handle behind.
        addr = prod.region[0]
        with pytest.raises(ValueError):
            agent.start_read([(dst.data_ptr(), 10, 0)], MemKind.DRAM, [prod.region], MemKind.DRAM, name, b"")
        with pytest.raises(TransferError):
            agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, "nobody", b"")
        with pytest.raises(TransferError):  # remote region outside anything registered
            agent.start_read(
                [(dst.data_ptr(), 4096, 0)], MemKind.DRAM, [(addr + 2 * NBYTES, 4096, 0)], MemKind.DRAM, name, b""
            )
        with pytest.raises(TransferError):
            agent.add_remote(b"not metadata")
        assert agent.open_handles() == base
        assert agent.registrations == 1  # registered once at start-up, never per request

        assert prod.close() == (1, 0)
        agent.remove_remote(name)
        agent.remove_remote(name)  # idempotent
        assert name not in agent.remotes()
    finally:
        prod.kill()


def test_a_reads_transport_is_read_from_ucxs_log_whose_file_is_gone() -> None:
    """UCX's log, when it is our own file in $TMP, is read through a descriptor opened when the first agent
    was made, its name unlinked then: no file is left behind, and a READ's transport is still learned (by
    an agent of its own: UCX prints a worker's tables once, under that worker's name)."""
    with own_agent("test-transport") as (agent, dst):
        path = native.ucx_log_path
        if path is None or path != ucx_log._own_log_path():
            pytest.skip("UCX's log is not ours here (UCX_PROTO_INFO off, or the operator's UCX_LOG_FILE)")
        assert not path.exists(), "unlinked once open"
        prod = Producer("test-producer-t", salt=13)
        try:
            name = read_whole(agent, dst, prod)
            info = agent.transport_info(name, MemKind.DRAM, MemKind.DRAM)
            assert info is not None and agent.name in info and "memory" in info, info  # "...zero-copy cma/memory"
            assert torch.equal(dst, pattern(NBYTES, 13))
        finally:
            prod.kill()
        # A producer restarted: UCX prints no table for its endpoint (the same configuration as the gone
        # one's), so it is told what the gone one used, marked "shared" (it was "?" in `up`'s table).
        agent.remove_remote(name)
        again = Producer("test-producer-t2", salt=17)
        try:
            later = read_whole(agent, dst, again)
            assert agent.transport_info(later, MemKind.DRAM, MemKind.DRAM) in {info, f"{info} (shared)"}
            assert torch.equal(dst, pattern(NBYTES, 17))
        finally:
            again.kill()


def test_a_read_of_the_same_regions_is_posted_again_on_its_recycled_handle(
    consumer: tuple[NixlAgent, torch.Tensor],
) -> None:
    """A READ that ended is recycled; the next READ of exactly its regions is posted on it again, READs the
    bytes there now and sends its own notification; the handle is freed with its peer."""
    agent, dst = consumer
    base, idle, reposts = agent.open_handles(), agent.idle_handles(), agent.reposts
    prod = Producer("test-producer-r", salt=5)
    try:
        name = agent.add_remote(prod.metadata)
        where = ([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, name)
        dst.zero_()
        first = agent.start_read(*where, b"req-1")
        wait_done(agent, first)
        agent.recycle(first)
        assert agent.open_handles() == base and agent.idle_handles() == idle + 1
        assert torch.equal(dst, pattern(NBYTES, 5))
        prod.fill(6)
        dst.zero_()
        second = agent.start_read(*where, b"req-2")
        assert second is first and agent.reposts == reposts + 1 and agent.idle_handles() == idle
        wait_done(agent, second)
        assert torch.equal(dst, pattern(NBYTES, 6)), "the bytes there now"
        agent.recycle(second)
        assert prod.notifs(2) == {agent.name: [b"req-1", b"req-2"]}, "each post's own notification"
        third = agent.start_read(*where, b"")  # posted with a notification: reused only with one
        assert third is not first
        wait_done(agent, third)
        agent.release(third)
        agent.remove_remote(name)
        assert agent.idle_handles() == idle and agent.open_handles() == base, "freed with its peer"
    finally:
        prod.kill()


def test_recycled_handles_are_bounded_oldest_freed_first(
    consumer: tuple[NixlAgent, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, dst = consumer
    monkeypatch.setattr(agent_module, "IDLE_HANDLES", 2)
    idle, reposts = agent.idle_handles(), agent.reposts
    prod = Producer("test-producer-b", salt=7)
    try:
        name = agent.add_remote(prod.metadata)

        def read(block: int) -> object:
            off = block * 4096
            return read_recycled(agent, (dst.data_ptr() + off, 4096, 0), (prod.region[0] + off, 4096, 0), name)

        first = read(0)
        read(1)
        read(2)
        assert agent.idle_handles() == 2 and agent.reposts == reposts
        assert read(0) is not first, "the oldest was freed"
        assert read(2) is not None and agent.reposts == reposts + 1, "a kept one is posted again"
        assert torch.equal(dst[: 3 * 4096], pattern(NBYTES, 7)[: 3 * 4096])
        agent.remove_remote(name)
        assert agent.idle_handles() == idle
    finally:
        prod.kill()


def test_a_handle_of_a_route_not_recycled_is_released(
    consumer: tuple[NixlAgent, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the routes in RECYCLED_ROUTES keep their handles (VRAM's reposts were no faster on a GPU)."""
    agent, dst = consumer
    monkeypatch.setattr(agent_module, "RECYCLED_ROUTES", frozenset({"VRAM<-VRAM"}))
    idle, reposts = agent.idle_handles(), agent.reposts
    prod = Producer("test-producer-v", salt=9)
    try:
        name = agent.add_remote(prod.metadata)
        for _ in range(2):
            read_recycled(agent, NixlAgent.region_of(dst), prod.region, name)
            assert agent.idle_handles() == idle and agent.open_handles() == 0
        assert agent.reposts == reposts and torch.equal(dst, pattern(NBYTES, 9))
        agent.remove_remote(name)
    finally:
        prod.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")
def test_a_vram_read_is_posted_again_on_its_recycled_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """VRAM <- VRAM (two processes on GPU 0: UCX cuda_ipc) reposted on its kept handle: the bytes there now
    each time, each post's own notification.  What ``RECYCLED_ROUTES`` needs before it names this route."""
    monkeypatch.setattr(agent_module, "RECYCLED_ROUTES", frozenset({"DRAM<-DRAM", "VRAM<-VRAM"}))
    with own_agent("test-consumer-vram", device="cuda") as (agent, dst):
        prod = Producer("test-producer-vram", salt=11, device="cuda")
        try:
            name = agent.add_remote(prod.metadata)
            where = (agent, NixlAgent.region_of(dst), prod.region, name, MemKind.VRAM)
            first = read_recycled(*where, notif=b"v-0")
            assert torch.equal(dst.cpu(), pattern(NBYTES, 11)) and agent.idle_handles() == 1
            for salt in range(12, 20):
                prod.fill(salt)
                dst.zero_()
                torch.cuda.synchronize()
                assert read_recycled(*where, notif=f"v-{salt}".encode()) is first
                assert torch.equal(dst.cpu(), pattern(NBYTES, salt)), f"the bytes there now (fill {salt})"
            assert agent.reposts == 8
            assert prod.notifs(9) == {agent.name: [b"v-0"] + [f"v-{s}".encode() for s in range(12, 20)]}
            agent.remove_remote(name)
            assert agent.idle_handles() == 0 and agent.open_handles() == 0
        finally:
            prod.kill()


def test_read_from_dead_peer_raises_then_restarted_peer_works(
    consumer: tuple[NixlAgent, torch.Tensor],
) -> None:
    agent, dst = consumer
    base = agent.open_handles()
    prod = Producer("test-producer-b", salt=5)
    try:
        name = read_whole(agent, dst, prod, b"ok")
        prod.kill()

        t0 = time.monotonic()
        with pytest.raises((PeerDisconnectedError, TransferError)):
            h = agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, name, b"dead")
            wait_done(agent, h)
        assert time.monotonic() - t0 < DEADLINE_S
        if agent.open_handles() != base:
            agent.release(h)
        assert agent.open_handles() == base
    finally:
        prod.kill()

    # Same name, new process: the dead entry is replaced, not left to poison the cache.
    prod2 = Producer("test-producer-b", salt=9)
    try:
        assert agent.add_remote(prod2.metadata) == name
        h = agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod2.region], MemKind.DRAM, name, b"again")
        wait_done(agent, h)
        agent.release(h)
        assert torch.equal(dst, pattern(NBYTES, 9))
        assert prod2.notifs(1) == {agent.name: [b"again"]}
        prod2.close()
        agent.remove_remote(name)
        assert agent.open_handles() == base
    finally:
        prod2.kill()


def test_missing_nixl_raises_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_nixl_api", None)
    for mod in ("nixl", "nixl._api", "nixl._bindings"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(NixlUnavailableError):
        NixlAgent("never")


def _failing_first(monkeypatch: pytest.MonkeyPatch, failures: int) -> list[str]:
    """Make the next ``failures`` native agents fail as UCX's did when a device vanished (the real
    ``nixl_agent`` after them); the names tried, in order."""
    api, _ = native._import_nixl()
    real, tried = api.nixl_agent, []

    def nixl_agent(name: str, config: object) -> object:
        tried.append(name)
        if len(tried) <= failures:
            raise RuntimeError("NIXL_ERR_BACKEND")  # what nixl raises when createBackend failed
        return real(name, config)

    monkeypatch.setattr(api, "nixl_agent", nixl_agent)
    return tried


def test_an_agent_whose_backend_failed_once_is_made_again_and_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = _failing_first(monkeypatch, 1)
    name = f"test-retried-{os.getpid()}"
    with structlog.testing.capture_logs() as logs:
        agent = NixlAgent(name)
    monkeypatch.undo()
    assert tried == [name, name]
    assert [(e["event"], e["tried"], e["error"]) for e in logs if e["log_level"] == "warning"] == [
        ("nixl.agent_retry", 1, "RuntimeError: NIXL_ERR_BACKEND")
    ]
    dst = torch.zeros(NBYTES, dtype=torch.uint8)
    agent.register(dst)
    prod = Producer("test-producer-r", salt=5)
    try:
        read_whole(agent, dst, prod)
        assert torch.equal(dst, pattern(NBYTES, 5))
    finally:
        prod.kill()
        agent.close()


def test_an_agent_whose_backend_keeps_failing_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    tried = _failing_first(monkeypatch, native.CREATE_TRIES)
    with pytest.raises(NixlUnavailableError, match="NIXL_ERR_BACKEND"):
        NixlAgent("never-made")
    assert len(tried) == native.CREATE_TRIES


def test_a_peer_ucx_cannot_reach_is_refused_with_the_cure_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL loads the metadata but UCX makes no endpoint (NIXL_ERR_BACKEND, "Destination is unreachable":
    what a peer listing an interface that went away gets, seen in CI beside the netns test; not
    reproducible on demand, so nixl's own exception is raised in the one native call): the error names the
    cure, the peer is not kept, and the same metadata loads once UCX reaches it."""
    _, bind = native._import_nixl()
    prod = Producer("test-producer-unreachable", salt=9)
    try:
        with own_agent("test-unreachable") as (agent, dst):
            real = agent._agent.add_remote_agent

            def unreachable(metadata: bytes) -> bytes:
                raise bind.nixlBackendError("NIXL_ERR_BACKEND")

            monkeypatch.setattr(agent._agent, "add_remote_agent", unreachable)
            with pytest.raises(TransferError, match="STAGEFERRY_ADVERTISE_ADDRESS") as caught:
                agent.add_remote(prod.metadata)
            assert caught.value.message.startswith("add_remote: UCX reached none of the peer's addresses")
            assert type(caught.value.__cause__).__name__ == "nixlBackendError" and agent.remotes() == frozenset()
            monkeypatch.setattr(agent._agent, "add_remote_agent", real)
            read_whole(agent, dst, prod)
            assert torch.equal(dst, pattern(NBYTES, 9))
    finally:
        prod.kill()


def test_transfer_states_are_read_once_into_the_enum() -> None:
    from stageferry.broker.data.nixl.agent import _state
    from stageferry.errors import TransferError

    assert _state("PROC") is XferState.PROC and _state(b"DONE") is XferState.DONE and _state("ERR") is XferState.ERR
    with pytest.raises(TransferError, match="unknown transfer state"):
        _state("BOGUS")


def test_a_read_whose_peer_was_dropped_under_it_fails_and_is_not_polled(
    consumer: tuple[NixlAgent, torch.Tensor],
) -> None:
    """A peer is dropped (``remove_remote``) while another get still waits on one of its READs: that
    handle is released with it, and NIXL frees it; polling it again fails typed instead of asking NIXL about
    freed memory (which answered a stale DONE)."""
    agent, dst = consumer
    prod = Producer("test-producer-d", salt=5)
    try:
        name = agent.add_remote(prod.metadata)
        h = agent.start_read([NixlAgent.region_of(dst)], MemKind.DRAM, [prod.region], MemKind.DRAM, name, b"")
        agent.remove_remote(name)
        with pytest.raises(PeerDisconnectedError, match="peer was dropped"):
            agent.poll(h)
        agent.release(h)  # the waiter's own release after it: nothing more
        assert name not in agent.remotes()
    finally:
        prod.close()
