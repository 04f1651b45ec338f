"""Receive buffers posted ahead (``nixl.ready``): the next payload's slots and views, made while idle.

Two real connectors (two NIXL agents, CPU DRAM over UCX, real Redis), as in ``test_consumer``; the
consumer's ready loop runs in the test's task group, the producer's background loops do not.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch
from structlog.testing import capture_logs

from stageferry.broker.data.nixl import consumer as consumer_module
from stageferry.broker.data.nixl import ready as ready_module
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.schemas import DeviceKind, NixlPayload, RegionSpec
from stageferry.testing import assert_same, sized_payload
from tests.broker.data.nixl.test_consumer import make
from tests.torch_ops import TorchOps

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
async def running(redis_url: str, prefix: str) -> AsyncIterator[tuple[NixlConnector, NixlConnector]]:
    """(producer, consumer) with the consumer's ready loop running; a 4 MiB consumer pool."""
    producer = make(redis_url, prefix, "encoder")
    consumer = make(redis_url, prefix, "diffusion", cpu_pool_bytes=4 << 20)
    await producer.peers.publish_record()
    async with anyio.create_task_group() as tg:
        tg.start_soon(consumer.consumer.ready.run)
        yield producer, consumer
        tg.cancel_scope.cancel()
    for conn in (consumer, producer):
        await conn.aclose()
        await conn.endpoint.redis.aclose()


async def put(producer: NixlConnector, key: str, nbytes: int, seed: int) -> tuple[NixlPayload, Any]:
    payload = sized_payload(nbytes, seed=seed)
    out = await producer.put(key, payload)
    assert isinstance(out.ref, NixlPayload)
    return out.ref, payload


async def idle() -> None:
    """Let the event loop run its background tasks (as a worker's wait for the next entry does)."""
    for _ in range(5):
        await anyio.lowlevel.checkpoint()


async def one_get_then_idle(producer: NixlConnector, consumer: NixlConnector) -> NixlPayload:
    """A get of a 200 kB payload (key ``k-1``), then idle: one payload of its shape is made ready."""
    ref, _ = await put(producer, "k-1", 200_000, seed=1)
    async with consumer.get(ref, None, key="k-1"):
        pass
    await idle()
    assert consumer.consumer.ready.slots == 1
    return ref


def count_acquires(monkeypatch: pytest.MonkeyPatch, conn: NixlConnector) -> list[int]:
    assert conn.pools is not None
    calls: list[int] = []
    real = conn.pools.acquire_regions

    async def acquire(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return await real(*args, **kwargs)

    monkeypatch.setattr(conn.pools, "acquire_regions", acquire)
    return calls


async def test_the_next_payload_of_a_shape_lands_in_slots_made_ready_while_idle(
    running: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, consumer = running
    ready, pools = consumer.consumer.ready, consumer.pools
    assert pools is not None
    acquires = count_acquires(monkeypatch, consumer)
    unpacks: list[int] = []
    real_unpack = consumer_module.unpack

    def unpack(*args: Any, **kwargs: Any) -> Any:
        unpacks.append(1)
        return real_unpack(*args, **kwargs)

    monkeypatch.setattr(consumer_module, "unpack", unpack)  # the get's own unpack, not the ready loop's
    first, payload = await put(producer, "k-1", 1 << 20, seed=1)
    async with consumer.get(first, None, key="k-1") as incoming:
        assert_same(incoming.payload, payload)
    assert acquires == [1] and ready.slots == 0, "the first get takes its own slot"
    await idle()
    assert ready.made == 1 and ready.slots == 1 and pools.slots_in_use == 1
    resources = consumer.resources()
    assert resources["pool_slots_in_use"] == 0 and resources["pool_bytes_in_use"] == 0, "counted apart"
    assert resources["ready_slots"] == 1
    for i in range(2, 5):  # each ends with the next one made ready
        ref, payload = await put(producer, f"k-{i}", 1 << 20, seed=i)
        async with consumer.get(ref, None, key=f"k-{i}") as incoming:
            assert_same(incoming.payload, payload)
            assert ready.slots == 0, "handed over, not kept"
        await idle()
    assert acquires == [1] and unpacks == [1] and ready.hits == 3, "no slot taken, no unpack, when found ready"
    await consumer.aclose()
    assert pools.slots_in_use == 0, "shutdown gives the ready slots back"


async def test_a_get_of_another_shape_gets_the_ready_slots_back_first(
    running: tuple[NixlConnector, NixlConnector],
) -> None:
    """The pool holds one 3 MiB payload at a time: a ready 3 MiB payload must not make a 2 MiB get wait."""
    producer, consumer = running
    ready, pools = consumer.consumer.ready, consumer.pools
    assert pools is not None
    ref, payload = await put(producer, "k-1", 3 << 20, seed=1)
    async with consumer.get(ref, None, key="k-1"):
        pass
    await idle()
    assert ready.slots == 1
    with anyio.fail_after(5):  # a wait on the pool would last timeouts.pool_wait (10 s), then fall back
        other, payload = await put(producer, "k-2", 2 << 20, seed=2)
        async with consumer.get(other, None, key="k-2") as incoming:
            assert_same(incoming.payload, payload)
            assert incoming.transport.value == "nixl" and ready.hits == 0
    await idle()
    assert ready.slots == 1 and ready.made == 2, "now ready for the 2 MiB shape"


async def test_nothing_is_made_ready_while_the_pool_has_waiters_or_when_turned_off(
    redis_url: str, prefix: str, running: tuple[NixlConnector, NixlConnector]
) -> None:
    producer, consumer = running
    pools = consumer.pools
    assert pools is not None
    big = (await put(producer, "k-0", 3 << 20, seed=0))[0].manifest
    small = (await put(producer, "k-1", 1 << 20, seed=1))[0].manifest
    held = await pools.acquire_regions(big, timeout=1)
    got: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def waiter() -> None:
            got.append(await pools.acquire_regions(big, timeout=30))

        tg.start_soon(waiter)  # queues behind the held slot
        await idle()
        consumer.consumer.ready.want(small)  # 1 MiB would fit, but somebody waits
        await idle()
        assert consumer.consumer.ready.slots == 0 and consumer.consumer.ready.made == 0, (
            "nothing taken ahead of a waiter"
        )
        pools.release_all(held)
    assert got and pools.slots_in_use == 1
    pools.release_all(got[0])
    off = make(redis_url, prefix, "diffusion-off", ready_slots=False)
    try:
        ref, _ = await put(producer, "k-2", 1 << 20, seed=2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(off.consumer.ready.run)
            async with off.get(ref, None, key="k-2"):
                pass
            await idle()
            assert off.consumer.ready.made == 0 and off.pools is not None and off.pools.slots_in_use == 0
            tg.cancel_scope.cancel()
    finally:
        await off.aclose()
        await off.endpoint.redis.aclose()


async def test_a_put_or_a_staging_on_the_same_pools_gets_the_ready_slots_back_instead_of_waiting(
    running: tuple[NixlConnector, NixlConnector],
) -> None:
    """A middle stage's input and output edges share one pool set: its puts must not wait on the ready slots."""
    producer, consumer = running
    ready = consumer.consumer.ready
    for i, (what, stage_it) in enumerate([("staging", True), ("put", False)]):
        ref, _ = await put(producer, f"k-{i}", 3 << 20, seed=i)
        async with consumer.get(ref, None, key=f"k-{i}"):
            pass
        await idle()
        assert ready.slots == 1, what
        with anyio.fail_after(5):  # a wait would last timeouts.pool_wait (10 s), then go inline
            if stage_it:
                await consumer.stage("k-staged", sized_payload(2 << 20, seed=9))
                assert len(consumer.stagings) == 1, "staged in the pool, not materialized"
                consumer.unstage("k-staged")
            else:
                out = await consumer.put("k-out", sized_payload(2 << 20, seed=9))
                assert isinstance(out.ref, NixlPayload), "over NIXL, not inline after a wait"
                consumer.abandon(out)
        assert ready.slots == 0, what


async def test_a_payload_of_the_same_size_but_another_layout_is_not_read_into_ready_views(
    running: tuple[NixlConnector, NixlConnector],
) -> None:
    producer, consumer = running
    ready = consumer.consumer.ready
    ref, _ = await put(producer, "k-1", 1 << 20, seed=1)
    async with consumer.get(ref, None, key="k-1"):
        pass
    await idle()
    assert ready.slots == 1
    floats = {"blob": torch.randn(1 << 18, generator=torch.Generator().manual_seed(5)), "nbytes": 1 << 20}
    out = await producer.put("k-2", floats)
    assert isinstance(out.ref, NixlPayload) and out.ref.manifest.total_bytes == ref.manifest.total_bytes
    async with consumer.get(out.ref, None, key="k-2") as incoming:
        assert incoming.payload["blob"].dtype == torch.float32
        assert_same(incoming.payload, floats)
    assert ready.hits == 0, "same bytes, another dtype: the ready views were not used"


async def test_the_get_path_is_rehearsed_once_at_start_and_holds_nothing(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its first want, the ready loop runs a get's local steps once (slots, structure key, unpack)
    on a small payload of the usual leaf kinds, gives the slots back and counts nothing as made ready."""
    consumer = make(redis_url, prefix, "diffusion", cpu_pool_bytes=4 << 20)
    ready = consumer.consumer.ready
    unpacked: list[Any] = []
    real_unpack = ready_module.unpack

    def watched(manifest: Any, buffers: Any, *, copy: bool) -> Any:
        unpacked.append(manifest)
        return real_unpack(manifest, buffers, copy=copy)

    monkeypatch.setattr(ready_module, "unpack", watched)
    try:
        with capture_logs() as logs:
            assert ready.rehearse()
        assert not [e for e in logs if e["event"] == "nixl.rehearsal_failed"], "the get's checks passed too"
        unpacked.clear()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ready.run)
            while not unpacked:
                await anyio.lowlevel.checkpoint()
            assert consumer.pools is not None and consumer.pools.slots_in_use == 0 and ready.slots == 0
            assert ready.made == 0 and ready.hits == 0
            (manifest,) = unpacked
            assert {t.dtype for t in manifest.tensors} >= {"bfloat16", "float32", "int64", "bool", "uint8"}
            tg.cancel_scope.cancel()
        consumer.endpoint.config = consumer.endpoint.config.model_copy(update={"ready_slots": False})
        assert not ready.rehearse()  # turned off: nothing runs
        assert len(unpacked) == 1
    finally:
        await consumer.aclose()
        await consumer.endpoint.redis.aclose()


def test_a_ready_slot_is_a_size_class_up_within_an_eighth_of_its_pool() -> None:
    size_class = ready_module.size_class
    assert size_class(100, 256 << 20) == ready_module.MIN_SIZE_CLASS, "a few integers: the smallest class"
    assert size_class((1 << 20) + 1, 256 << 20) == 2 << 20, "the next power of two"
    assert size_class(1 << 20, 256 << 20) == 1 << 20
    assert size_class(3 << 20, 16 << 20) == 3 << 20, "never past an eighth of the pool..."
    assert size_class(1 << 20, 4 << 20) == 1 << 20, "...and never less than the region"


async def test_a_get_of_another_structure_that_fits_reads_into_the_ready_slots(
    running: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of another length changes the payload's structure: its views are made, the ready slot is used."""
    producer, consumer = running
    ready, pools = consumer.consumer.ready, consumer.pools
    assert pools is not None
    ref = await one_get_then_idle(producer, consumer)
    (slot,) = ready._ready.slots.values()  # type: ignore[union-attr]
    assert slot.nbytes == 256 << 10, "a size class up: 200 kB in a 4 MiB pool"
    acquires = count_acquires(monkeypatch, consumer)
    for i, nbytes in enumerate((150_000, 250_000), start=2):  # other structures, both fit
        other, payload = await put(producer, f"k-{i}", nbytes, seed=i)
        assert other.manifest != ref.manifest
        async with consumer.get(other, None, key=f"k-{i}") as incoming:
            assert_same(incoming.payload, payload)
            assert incoming.regions is not None
            assert {k: v.data_ptr() for k, v in incoming.regions.items()} == {slot.kind: slot.address}, "in it"
            assert {k: v.numel() for k, v in incoming.regions.items()} == {
                r.device: r.nbytes for r in other.manifest.regions
            }, "handed on as exactly its regions (a TP group fans them out)"
        await idle()
    assert acquires == [] and ready.reused == 2 and ready.hits == 0, "no slot of its own taken"
    # the get holds its slot cut to its region: the size class's rest is the pool's while the block runs
    await idle()
    small, _ = await put(producer, "k-5", 100_000, seed=5)
    async with consumer.get(small, None, key="k-5"):
        assert pools.bytes_in_use < 110_000
        rest = small.manifest.model_copy(
            update={"tensors": [], "regions": [RegionSpec(device=DeviceKind.CPU, nbytes=(4 << 20) - (128 << 10))]}
        )
        held = pools.take_regions_now(rest)  # what the block's own put would take: no wait, no pressure
        assert held is not None, "the size class's rest is free while the block runs"
        pools.release_all(held)
    await idle()
    big, payload = await put(producer, "k-9", 1 << 20, seed=9)  # does not fit: slots back, its own taken
    async with consumer.get(big, None, key="k-9") as incoming:
        assert_same(incoming.payload, payload)
    assert acquires == [1] and ready.reused == 3


async def test_taking_ready_slots_asks_nothing_of_torch(running: tuple[NixlConnector, NixlConnector]) -> None:
    """A get's slots step runs no torch op, whether its payload was made ready (views and all) or it reuses
    the ready slots (cut to its regions): after idling, the first call of a torch op is the costly one."""
    producer, consumer = running
    ready, pools = consumer.consumer.ready, consumer.pools
    assert pools is not None
    ref = await one_get_then_idle(producer, consumer)
    other, payload = await put(producer, "k-2", 150_000, seed=2)
    for manifest, views in ((ref.manifest, True), (other.manifest, False)):
        assert ready.slots == 1
        with TorchOps() as ops:
            taken = ready.take(manifest)
        assert taken is not None and taken.has_views is views and ops.names == []
        assert {k: s.nbytes for k, s in taken.slots.items()} == {r.device: r.nbytes for r in manifest.regions}
        pools.release_all(taken.slots)
        ready.want(ref.manifest)
        await idle()
    async with consumer.get(other, None, key="k-2") as incoming:
        assert_same(incoming.payload, payload)


async def test_a_consumer_with_an_upstream_holds_its_first_gets_slots_from_the_start(
    redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = make(redis_url, prefix, "encoder")
    consumer = make(redis_url, prefix, "diffusion", cpu_pool_bytes=4 << 20)
    await producer.peers.publish_record()
    ready, pools = consumer.consumer.ready, consumer.pools
    assert pools is not None
    acquires = count_acquires(monkeypatch, consumer)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(ready.run, ahead=True))
            await idle()
            assert ready.slots == 1 and ready.made == 0, "slots alone: no structure is known yet"
            assert pools.bytes_in_use == (4 << 20) // ready_module.AHEAD_SHARE
            resources = consumer.resources()
            assert resources["pool_slots_in_use"] == 0 and resources["ready_slots"] == 1, "counted apart"
            ref, payload = await put(producer, "k-1", 100_000, seed=1)
            async with consumer.get(ref, None, key="k-1") as incoming:
                assert_same(incoming.payload, payload)
                assert pools.bytes_in_use < 110_000, "held cut to its region while the block runs"
            assert acquires == [] and ready.reused == 1, "the first get took no slot of its own"
            # under pressure they go back like any ready slots: a put that needs the whole pool does not wait
            await idle()
            assert ready.slots == 1
            with anyio.fail_after(5):
                out = await consumer.put("k-out", sized_payload(4_100_000, seed=9))
            assert isinstance(out.ref, NixlPayload) and ready.slots == 0
            consumer.abandon(out)
            tg.cancel_scope.cancel()
    finally:
        for conn in (consumer, producer):
            await conn.aclose()
            await conn.endpoint.redis.aclose()
    assert pools.slots_in_use == 0
