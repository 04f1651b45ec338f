"""The consumer's hop: the claim runs while the READs do, and the release is notified once, after both.

Producer and consumer are two real connectors (two NIXL agents, CPU DRAM over UCX, real Redis).  In the
in-process tests the producer's notification loop is not started, so the test itself drains the
producer agent's notifications and sees exactly which releases arrived; the READ-failure test runs the
producer in its own process and kills it.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import redis as sync_redis
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.data.nixl import consumer as consumer_module
from stageferry.broker.data.nixl.agent import UNREACHABLE_HINT, XferState
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.broker.data.nixl.reads import lane_spans
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.errors import HandshakeError, ManifestError, PayloadUnavailableError, TransferError
from stageferry.schemas import NixlPayload, Transport
from stageferry.schemas.nixl import released_token
from stageferry.testing import assert_same, sized_payload
from tests.broker.data.nixl.test_connector import ref_of
from tests.procs import start_peer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def make(redis_url: str, prefix: str, stage: str, **config: Any) -> NixlConnector:
    conn = NixlConnector(
        redis=connect(redis_url),
        keys=Keys(prefix),
        stage=stage,
        replica="test",
        config=DataPlaneConfig(**{"inline_max_bytes": 0, "cpu_pool_bytes": 16 << 20, **config}),
        timeouts=Timeouts(resend=3.0, transfer=10.0),
    )
    conn.open()
    return conn


@pytest.fixture
async def pair(redis_url: str, prefix: str) -> AsyncIterator[tuple[NixlConnector, NixlConnector]]:
    """(producer, consumer); the producer's record is published, its background loops are not running."""
    producer = make(redis_url, prefix, "encoder")
    consumer = make(redis_url, prefix, "diffusion")
    await producer.peers.publish_record()
    yield producer, consumer
    for conn in (consumer, producer):
        await conn.aclose()
        await conn.endpoint.redis.aclose()


async def releases_until(producer: NixlConnector, token: str) -> list[str]:
    """Drain the producer's notifications until ``token``'s release arrived; every release seen."""
    assert producer.agent is not None
    seen: list[str] = []
    with anyio.fail_after(20):
        while token not in seen:
            for messages in producer.agent.drain_notifs().values():
                seen += [t for t in map(released_token, messages) if t is not None]
            await anyio.sleep(0.005)
    return seen


async def put(producer: NixlConnector, key: str, seed: int) -> tuple[NixlPayload, object]:
    payload = sized_payload(1 << 20, seed=seed)
    out = await producer.put(key, payload)
    assert isinstance(out.ref, NixlPayload)
    return out.ref, payload


async def test_the_release_is_notified_once_after_the_claim_won_and_the_read_completed(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = pair
    ref, payload = await put(producer, "k-1", seed=1)
    async with consumer.get(ref, None, key="k-1") as incoming:
        assert incoming.transport is Transport.NIXL
        assert_same(incoming.payload, payload)
        # The claim is ours by now (the producer has not seen a release yet: nothing overwrote the key).
        owner = await consumer.endpoint.redis.get(consumer.endpoint.keys.claim(ref.token))
        assert owner == consumer.endpoint.name.encode()
    second, _ = await put(producer, "k-2", seed=2)
    async with consumer.get(second, None, key="k-2"):
        pass
    seen = await releases_until(producer, second.token)
    assert seen.count(ref.token) == 1 and seen.count(second.token) == 1, seen
    assert consumer.pools is not None and consumer.pools.slots_in_use == 0
    assert consumer.agent is not None and consumer.agent.open_handles() == 0


async def test_a_claim_lost_while_the_read_runs_hands_nothing_on_and_notifies_nothing(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = pair
    ref, _ = await put(producer, "k-1", seed=1)
    # Another consumer (a redelivery's) claimed it first: our READ is posted, our claim is refused.
    await consumer.endpoint.redis.set(consumer.endpoint.keys.claim(ref.token), b"diffusion-rival")
    reads = consumer.counters.reads
    with pytest.raises(PayloadUnavailableError, match="claimed"):
        async with consumer.get(ref, None, key="k-1"):
            pytest.fail("an unclaimed payload was handed on")
    assert consumer.counters.reads == reads, "not counted as a read"
    assert consumer.pools is not None and consumer.pools.slots_in_use == 0, "our slot is back once the READ ended"
    assert consumer.agent is not None and consumer.agent.open_handles() == 0
    assert producer.agent is not None and producer.agent.name in consumer.agent.remotes(), "the peer stays"
    # A later payload's release arrives; the lost one's never did.
    second, _ = await put(producer, "k-2", seed=2)
    async with consumer.get(second, None, key="k-2"):
        pass
    seen = await releases_until(producer, second.token)
    assert ref.token not in seen, seen
    assert ref.token in producer.leases, "the rival's lease is still held for it"


async def test_a_lease_the_stream_read_claimed_is_read_without_a_claim_of_its_own(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = pair
    ref, payload = await put(producer, "k-1", seed=1)
    # What the stage's stream read leaves behind (LeaseClaim): the key held by this consumer.  A claim
    # of the connector's own (SET NX) would now be refused, so the get passing shows it sent none.
    await consumer.endpoint.redis.set(consumer.endpoint.keys.claim(ref.token), b"claimed-by-the-read")
    notified = spy_on_notify(consumer)
    async with consumer.get(ref, None, key="k-1", claimed=True) as incoming:
        assert incoming.transport is Transport.NIXL
        assert_same(incoming.payload, payload)
    # Its one READ carried the release: it arrives once, with no notification sent on its own.
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
    assert notified == []


async def test_the_transport_is_logged_once_per_peer_after_the_get_block_off_the_hop(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = pair
    with capture_logs() as logs:
        for n in range(2):
            ref, _ = await put(producer, f"k-{n}", seed=n)
            async with consumer.get(ref, None, key=f"k-{n}"):
                # the hop is timed and handed on; its first-per-peer diagnostics line has not run yet, nor
                # has its own line (rendered on the loop's next turn)
                assert n or not [e for e in logs if e["event"] == "nixl.transport" and "peer" in e]
                assert not [e for e in logs if e["event"] == "payload.get" and e["key"] == f"k-{n}"]
        with anyio.fail_after(10):
            while sum(e["event"] == "payload.get" for e in logs) < 2:
                await anyio.lowlevel.checkpoint()
    gets = [e["key"] for e in logs if e["event"] == "payload.get"]
    assert gets == ["k-0", "k-1"], gets
    assert [e["event"] for e in logs if "peer" in e and e["event"] == "nixl.transport"] == ["nixl.transport"]
    logged = next(e for e in logs if e["event"] == "nixl.transport" and "peer" in e)
    assert producer.agent is not None and logged["peer"] == producer.agent.name


def spy_on_notify(conn: NixlConnector) -> list[bytes]:
    """The notifications ``conn``'s agent sends on their own (not carried by a READ), as they go."""
    agent = conn.agent
    assert agent is not None
    sent: list[bytes] = []
    notify = agent.notify

    def spy(remote_name: str, message: bytes) -> None:
        sent.append(message)
        notify(remote_name, message)

    agent.notify = spy  # type: ignore[method-assign]
    return sent


async def test_a_lease_the_stream_read_found_taken_is_not_read_at_all(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = pair
    ref, _ = await put(producer, "k-1", seed=1)
    reads = consumer.counters.reads
    with pytest.raises(PayloadUnavailableError, match="claimed"):
        async with consumer.get(ref, None, key="k-1", claimed=False):
            pytest.fail("a payload claimed by another consumer was handed on")
    assert consumer.counters.reads == reads
    assert consumer.pools is not None and consumer.pools.slots_in_use == 0
    assert consumer.agent is not None and consumer.agent.open_handles() == 0
    assert producer.agent is not None and producer.agent.name not in consumer.agent.remotes(), "not even loaded"
    assert await producer.endpoint.redis.xlen(producer.endpoint.keys.resend(producer.endpoint.name)) == 0
    assert ref.token in producer.leases, "held for the consumer that claimed it"


async def test_lanes_split_a_large_dram_region_and_arrive_bit_exact(redis_url: str, prefix: str) -> None:
    producer = make(redis_url, prefix, "encoder")
    consumer = make(redis_url, prefix, "diffusion", read_lanes=4, read_lane_min_bytes=64 << 10, ucx_threads=2)
    try:
        await producer.peers.publish_record()
        ref, payload = await put(producer, "k-1", seed=3)
        async with consumer.get(ref, None, key="k-1") as incoming:
            assert_same(incoming.payload, payload)
        assert (await releases_until(producer, ref.token)).count(ref.token) == 1
        # Claimed by the stream read: the lanes are one transfer, whose release arrives once, at its end.
        second, payload = await put(producer, "k-2", seed=4)
        await consumer.endpoint.redis.set(consumer.endpoint.keys.claim(second.token), b"claimed-by-the-read")
        notified = spy_on_notify(consumer)
        async with consumer.get(second, None, key="k-2", claimed=True) as incoming:
            assert_same(incoming.payload, payload)
        assert (await releases_until(producer, second.token)).count(second.token) == 1
        assert notified == []
    finally:
        for conn in (consumer, producer):
            await conn.aclose()
            await conn.endpoint.redis.aclose()


def test_lane_spans_cover_the_region_exactly_once() -> None:
    for nbytes, lanes in [(1 << 20, 4), (10_000_001, 3), (5000, 8), (4096, 2), (1, 1)]:
        spans = lane_spans(nbytes, lanes)
        assert len(spans) <= lanes
        assert spans[0][0] == 0 and sum(n for _, n in spans) == nbytes
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
        assert all(off % 4096 == 0 for off, _ in spans)
    assert len(lane_spans(64 << 20, 4)) == 4


async def test_a_read_that_fails_with_the_claim_won_drops_the_peer_and_asks_for_a_resend(
    redis_url: str, prefix: str, tmp_path: Path
) -> None:
    """The producer dies after publishing: our claim wins (nobody marked the key), the READ fails (UCX
    says so at the post or at a poll); the peer is dropped, the inline resend goes unanswered, and the
    payload counts as gone."""
    log = tmp_path / "producer.log"
    proc = start_peer("tests.peer_producer", redis_url, prefix, log=log)
    r = sync_redis.Redis.from_url(redis_url, socket_timeout=None)
    try:
        item = r.blpop([f"{prefix}:test:refs"], timeout=60)
        assert item is not None, log.read_text()[-3000:]
        ref, _ = ref_of(json.loads(item[1]))
        assert isinstance(ref, NixlPayload)
        consumer = make(redis_url, prefix, "diffusion")
        try:
            assert consumer.agent is not None
            await consumer.peers.ensure(ref)  # loaded while the producer lives
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            started = time.monotonic()
            with pytest.raises(PayloadUnavailableError) as caught:
                async with consumer.get(ref, None, key="k"):
                    pytest.fail("a failed READ was handed on")
            assert caught.value.details.get("reason") == "transfer_failed", caught.value.details
            assert time.monotonic() - started < 30
            assert r.get(f"{prefix}:nixl:claim:{ref.token}") == consumer.endpoint.name.encode(), "our claim won"
            assert ref.agent not in consumer.agent.remotes(), "the peer was dropped"
            assert consumer.pools is not None and consumer.pools.slots_in_use == 0
            assert consumer.agent.open_handles() == 0
        finally:
            await consumer.aclose()
            await consumer.endpoint.redis.aclose()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def test_the_views_are_made_while_the_read_runs_and_a_failure_there_waits_for_it(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unpack (views over our slot) runs with the READ's handle open; if it fails, the slot goes back
    only after the READ is seen DONE, and the producer is still released (once)."""
    producer, consumer = pair
    agent = consumer.agent
    assert agent is not None and consumer.pools is not None
    open_during: list[int] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        open_during.append(agent.open_handles())
        return real_unpack(*args, **kwargs)

    real_unpack = consumer_module.unpack
    monkeypatch.setattr(consumer_module, "unpack", watched)
    ref, payload = await put(producer, "k-1", seed=1)
    async with consumer.get(ref, None, key="k-1") as incoming:
        assert_same(incoming.payload, payload)
    assert open_during == [1], "the views were made while the READ's handle was open"

    # The unpack fails with the READ still running (its polls say PROC three more times): the slot stays
    # ours until the READ is seen DONE.
    after_failure: list[int] = []  # slots in use at each poll after the unpack failed
    real_poll = agent.poll

    def broken(*args: Any, **kwargs: Any) -> Any:
        after_failure.append(-1)
        raise ManifestError("cannot view it")

    def slow_poll(handle: object) -> XferState:
        if after_failure and len(after_failure) <= 3:
            after_failure.append(consumer.pools.slots_in_use)  # type: ignore[union-attr]
            return XferState.PROC
        return real_poll(handle)

    monkeypatch.setattr(consumer_module, "unpack", broken)
    monkeypatch.setattr(agent, "poll", slow_poll)
    second, _ = await put(producer, "k-2", seed=2)
    with pytest.raises(ManifestError, match="cannot view it"):
        async with consumer.get(second, None, key="k-2"):
            pytest.fail("handed on")
    assert after_failure == [-1, 1, 1, 1], "the READ was waited for, the slot held meanwhile"
    assert consumer.pools.slots_in_use == 0 and agent.open_handles() == 0
    assert (await releases_until(producer, second.token)).count(second.token) == 1


class HeldReads:
    """Makes a connector's READs look in flight (PROC) while ``limit`` is None or not yet reached; each
    held poll records how many of its pool's slots are in use at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, conn: NixlConnector) -> None:
        agent, pools = conn.agent, conn.pools
        assert agent is not None and pools is not None
        self.slots_in_use: list[int] = []
        self.limit: int | None = None
        real_poll = agent.poll

        def poll(handle: object) -> XferState:
            if self.limit is None or len(self.slots_in_use) < self.limit:
                self.slots_in_use.append(pools.slots_in_use)
                return XferState.PROC
            return real_poll(handle)

        monkeypatch.setattr(agent, "poll", poll)


async def cancel_once_held(consumer: NixlConnector, ref: NixlPayload, held: HeldReads, polls_after: int | None) -> int:
    """Run a get, cancel it once its READ has been seen in flight, then let the READ end after
    ``polls_after`` more polls (None: never); the number of polls seen before the cancel."""
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def get() -> None:
                async with consumer.get(ref, None, key="k"):
                    pytest.fail("a cancelled get was handed on")

            tg.start_soon(get)
            while not held.slots_in_use:
                await anyio.sleep(0.001)
            before = len(held.slots_in_use)
            tg.cancel_scope.cancel()
            if polls_after is not None:
                held.limit = before + polls_after
    return before


async def test_a_get_cancelled_during_its_read_keeps_the_slot_until_the_read_is_done(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Releasing a handle only asks NIXL to cancel the READ: the slot goes back to the pool once the READ
    is seen DONE, not before (the polls after the cancel still find it ours), and the peer stays."""
    producer, consumer = pair
    assert consumer.agent is not None and consumer.pools is not None and producer.agent is not None
    held = HeldReads(monkeypatch, consumer)
    ref, _ = await put(producer, "k-1", seed=1)
    before = await cancel_once_held(consumer, ref, held, polls_after=5)
    assert len(held.slots_in_use) == before + 5, "the READ was still polled after the cancel"
    assert set(held.slots_in_use) == {1}, "every poll, after the cancel too, found the slot still ours"
    assert consumer.pools.slots_in_use == 0 and consumer.agent.open_handles() == 0
    assert producer.agent.name in consumer.agent.remotes(), "a READ seen DONE keeps the peer"
    # Our claim had won and the bytes were here: the producer's slot is released now, not at lease expiry.
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
    monkeypatch.undo()
    second, payload = await put(producer, "k-2", seed=2)
    async with consumer.get(second, None, key="k-2") as incoming:
        assert_same(incoming.payload, payload)


async def test_a_get_cancelled_with_a_read_that_never_ends_drops_the_peer_at_the_deadline(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make(redis_url, prefix, "encoder")
    consumer = NixlConnector(
        redis=connect(redis_url),
        keys=Keys(prefix),
        stage="diffusion",
        replica="test",
        config=DataPlaneConfig(inline_max_bytes=0, cpu_pool_bytes=16 << 20),
        timeouts=Timeouts(resend=3.0, transfer=0.3),
    )
    consumer.open()
    try:
        assert consumer.agent is not None and consumer.pools is not None and producer.agent is not None
        await producer.peers.publish_record()
        held = HeldReads(monkeypatch, consumer)
        ref, _ = await put(producer, "k-1", seed=1)
        started = time.monotonic()
        with capture_logs() as logs:
            await cancel_once_held(consumer, ref, held, polls_after=None)
        assert 0.2 < time.monotonic() - started < 5, "waited for the READ up to its deadline, no longer"
        assert set(held.slots_in_use) == {1}, "the slot stayed ours while the READ could still write"
        assert producer.agent.name not in consumer.agent.remotes(), "the peer was dropped"
        assert [e["peer"] for e in logs if e["event"] == "nixl.read_abandoned"] == [producer.agent.name]
        assert consumer.pools.slots_in_use == 0 and consumer.agent.open_handles() == 0
    finally:
        for conn in (consumer, producer):
            await conn.aclose()
            await conn.endpoint.redis.aclose()


class CopyBeside:
    """Stands in for the same-GPU copy (:class:`~stageferry.broker.data.nixl.same_gpu.ArenaCopy`: CUDA, so
    not in CI; the real one runs in test_same_gpu.py on the device machine): it covers ``regions``, so the
    READ skips them, and ends when the test opens it, failing with ``fail``.  ``order`` records when it
    ended beside the producer's release."""

    def __init__(self, conn: NixlConnector, regions: frozenset[int], order: list[str], fail: str | None = None) -> None:
        self.regions, self.order, self.fail = regions, order, fail
        self.error: TransferError | None = None
        self.opened, self.waits = anyio.Event(), 0
        self.entered = [anyio.Event(), anyio.Event()]  # set as the first and the second wait begin
        self.reads_at_wait: list[int] = []  # the consumer's open READ handles when each wait began
        self._agent = conn.agent

    def covers(self, index: int) -> bool:
        return index in self.regions

    async def wait(self) -> None:
        if self.error is not None:
            raise self.error
        assert self._agent is not None
        self.waits += 1
        if self.waits <= len(self.entered):
            self.entered[self.waits - 1].set()
        self.reads_at_wait.append(self._agent.open_handles())
        await self.opened.wait()
        if self.fail is not None:
            self.error = TransferError(self.fail)
            raise self.error
        self.order.append("copy ended")


def copy_beside(
    monkeypatch: pytest.MonkeyPatch, consumer: NixlConnector, regions: frozenset[int], fail: str | None = None
) -> tuple[CopyBeside, list[str]]:
    """Make ``consumer`` take ``regions`` of its next payloads by a :class:`CopyBeside`, recording when the
    producer is released."""
    order: list[str] = []
    beside = CopyBeside(consumer, regions, order, fail)
    cons = consumer.consumer
    # the copy is launched whatever it covers (an index no region has when it covers none)
    monkeypatch.setattr(cons.same_gpu, "regions", lambda *args: regions or frozenset({-1}))
    monkeypatch.setattr(cons.same_gpu, "launch", lambda *args: beside)
    real_release, real_wait_all = cons.reader.releases.send, cons.reader._wait_all

    def release(*args: Any) -> None:
        order.append("released")
        real_release(*args)

    async def wait_all(handles: list[object], deadline: float) -> None:
        await real_wait_all(handles, deadline)
        order.append(f"{len(handles)} reads ended")

    monkeypatch.setattr(cons.reader.releases, "send", release)
    monkeypatch.setattr(cons.reader, "_wait_all", wait_all)
    return beside, order


async def test_a_copy_beside_the_read_ends_before_the_producer_is_released(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same-GPU copy of a payload's VRAM runs beside the READ of its host-memory rest: the READ is
    waited for first, then the copy, and only then is the producer released, once."""
    producer, consumer = pair
    beside, order = copy_beside(monkeypatch, consumer, frozenset())  # covers no region here: all READ
    beside.opened.set()
    ref, payload = await put(producer, "k-1", seed=1)
    async with consumer.get(ref, None, key="k-1") as incoming:
        assert_same(incoming.payload, payload)
        assert incoming.route is not None and "same-gpu" not in incoming.route
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
    assert order == ["1 reads ended", "copy ended", "released"]
    assert consumer.counters.same_gpu == 1


async def test_a_copy_that_fails_beside_the_read_is_followed_by_the_read_of_it_all(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A region the copy covers is not READ; when the copy fails, the claim is ours and nothing was
    released: the whole payload is READ then, bit-exact, and the producer released once."""
    producer, consumer = pair
    beside, order = copy_beside(monkeypatch, consumer, frozenset({0}), fail="the copy failed")
    beside.opened.set()
    ref, payload = await put(producer, "k-1", seed=1)
    with capture_logs() as logs:
        async with consumer.get(ref, None, key="k-1") as incoming:
            assert_same(incoming.payload, payload)
    assert beside.reads_at_wait == [0], "no READ was posted for the covered region"
    (fallback,) = [e for e in logs if e["event"] == "nixl.same_gpu_fallback"]
    assert fallback["error"] == "the copy failed" and fallback["fallback"] == "nixl"
    # the READ after it carries the release (the claim is ours): no notify of its own
    assert order == ["0 reads ended", "1 reads ended"] and consumer.counters.same_gpu == 0
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
    assert consumer.pools is not None and consumer.pools.slots_in_use == 0


async def test_a_get_cancelled_during_the_copy_keeps_the_slot_until_the_copy_ended(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, consumer = pair
    beside, order = copy_beside(monkeypatch, consumer, frozenset({0}))
    ref, _ = await put(producer, "k-1", seed=1)
    pools = consumer.pools
    assert pools is not None
    scope = anyio.CancelScope()

    async def get() -> None:
        with scope:
            async with consumer.get(ref, None, key="k-1"):
                pytest.fail("a cancelled get was handed on")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(get)
            await beside.entered[0].wait()
            scope.cancel()
            await beside.entered[1].wait()  # waited for again, shielded
            assert pools.slots_in_use == 1, "our slot is held while the copy may still write into it"
            beside.opened.set()
    assert pools.slots_in_use == 0
    # the cancel's settling waits for the (here no) READs too; the claim was ours, the bytes here: released
    assert order == ["0 reads ended", "copy ended", "0 reads ended", "released"]
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1


async def test_a_read_that_fails_beside_a_failing_copy_is_a_read_failure(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The READ of the host-memory rest fails and the copy beside it fails too: the READ's failure is the
    one handled (the peer is dropped, no READ of it all follows into the same slots), not the copy's."""
    producer, consumer = pair
    beside, _ = copy_beside(monkeypatch, consumer, frozenset(), fail="the copy failed")
    beside.opened.set()
    agent = consumer.agent
    assert agent is not None and producer.agent is not None

    def broken(handle: object) -> XferState:
        raise TransferError("READ reported ERR")

    monkeypatch.setattr(agent, "poll", broken)
    ref, _ = await put(producer, "k-1", seed=1)
    with capture_logs() as logs, pytest.raises(PayloadUnavailableError):  # the inline resend goes unanswered
        async with consumer.get(ref, None, key="k-1"):
            pytest.fail("a failed READ was handed on")
    # first: a handshake that failed (CI once, UCX unable to reach the peer) never READs, and says so here
    assert any(e["event"] == "nixl.read_failed" and e["error"] == "READ reported ERR" for e in logs), logs
    assert beside.error is not None, "the copy was waited for (and failed) before the slots went back"
    assert [e["event"] for e in logs if e["event"].startswith("nixl.")].count("nixl.same_gpu_fallback") == 0
    assert producer.agent.name not in agent.remotes(), "the peer was dropped"
    assert consumer.pools is not None and consumer.pools.slots_in_use == 0


async def test_a_consumer_that_cannot_reach_the_producer_claims_before_it_asks_for_a_resend(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get whose claim the stream read did not take (``claimed`` None: a chunk, a replicated write) and
    whose handshake fails claims the lease before asking for the bytes inline.  It asked without: a lease
    another consumer had claimed (and may be reading) was resent, released and its slot freed under it."""
    producer, consumer = pair
    ref, _ = await put(producer, "k-1", seed=1)
    redis = consumer.endpoint.redis
    claim_key = consumer.endpoint.keys.claim(ref.token)
    await redis.set(claim_key, b"diffusion-winner")  # another consumer won the claim and is reading

    def unreachable(metadata: bytes) -> str:  # UCX finds no route to the producer (a cut link)
        raise TransferError(f"add_remote: {UNREACHABLE_HINT}")

    monkeypatch.setattr(consumer.agent, "add_remote", unreachable)
    async with anyio.create_task_group() as tg:
        tg.start_soon(producer.producer.run_resends)
        with pytest.raises(PayloadUnavailableError):  # not ours: nothing asked for, nothing freed
            async with consumer.get(ref, None, key="k-1"):
                pass
        tg.cancel_scope.cancel()
    assert await redis.get(claim_key) == b"diffusion-winner" and ref.token in producer.leases


async def test_a_record_copying_a_loaded_producers_metadata_leaves_that_producer_loaded(
    pair: tuple[NixlConnector, NixlConnector],
) -> None:
    """A record under another name with a loaded producer's metadata (any stage user can write one) loads
    as that producer: it is refused, and that producer stays loaded (it was unloaded, its reads released,
    and every later get from it fell back inline)."""
    producer, consumer = pair
    first, _ = await put(producer, "k-1", seed=1)
    async with consumer.get(first, None, key="k-1") as incoming:
        assert incoming.transport is Transport.NIXL
    redis = consumer.endpoint.redis
    forged = dict(await redis.hgetall(consumer.endpoint.keys.agent(producer.name)))
    evil = "encoder-evil-deadbeef"
    forged[b"name"], forged[b"incarnation"] = evil.encode(), b"deadbeef00000000"
    await redis.hset(consumer.endpoint.keys.agent(evil), mapping=forged)
    with pytest.raises(HandshakeError, match="names another agent"):
        await consumer.peers.connect(evil)  # what the upstream watch does for each agent it lists
    assert consumer.agent is not None and producer.name in consumer.agent.remotes()
    second, _ = await put(producer, "k-2", seed=2)
    async with consumer.get(second, None, key="k-2") as incoming:
        assert incoming.transport is Transport.NIXL
