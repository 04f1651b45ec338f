"""Memory pools: the arena allocator, back-pressure, cancellation safety and registration counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from stageferry.broker.data.payload_codec import pack_into, plan_payload, unpack, validate_remote_regions
from stageferry.broker.data.pool import MemoryPool, PoolSet, Slot
from stageferry.config import DataPlaneConfig, MiB
from stageferry.errors import ManifestError, NixlUnavailableError, PoolExhaustedError
from stageferry.schemas.payload import DeviceKind, Manifest, MemKind, RegionSpec
from tests.torch_ops import TorchOps

CPU = torch.device("cpu")


async def until(condition: Callable[[], bool], *, timeout: float = 10) -> None:
    """Let the other tasks run until ``condition`` (the pool's own state) holds; fail after ``timeout``."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.lowlevel.checkpoint()


class CountingRegistrar:
    def __init__(self) -> None:
        self.registered = 0
        self.deregistered = 0
        self.live: dict[int, torch.Tensor] = {}

    def register(self, tensor: torch.Tensor) -> object:
        self.registered += 1
        handle = object()
        self.live[id(handle)] = tensor
        return handle

    def deregister(self, handle: object) -> None:
        del self.live[id(handle)]
        self.deregistered += 1


def cpu_pool(capacity: int = 4096, registrar: CountingRegistrar | None = None) -> MemoryPool:
    return MemoryPool(DeviceKind.CPU, capacity, device=CPU, registrar=registrar)


def manifest_of(**regions: int) -> Manifest:
    """A manifest with only regions (no tensors): all the pool looks at."""
    return Manifest(
        tree={"v": None}, tensors=[], regions=[RegionSpec(device=DeviceKind(k), nbytes=n) for k, n in regions.items()]
    )


def test_pool_registers_once_and_describes_its_arena() -> None:
    reg = CountingRegistrar()
    pool = cpu_pool(4096 + 17, reg)
    assert reg.registered == 1 and pool.capacity == 4096
    arena = pool.arena()
    assert arena.mem_kind is MemKind.DRAM and arena.length == 4096 and arena.device_id == 0
    assert arena.address == next(iter(reg.live.values())).data_ptr()
    pool.close()
    pool.close()
    assert reg.deregistered == 1 and not reg.live


def test_pool_rejects_kind_device_mismatch() -> None:
    with pytest.raises(ValueError):
        MemoryPool(DeviceKind.CUDA, 4096, device=CPU, registrar=None)


@pytest.mark.anyio
async def test_slot_view_and_address() -> None:
    pool = cpu_pool()
    slot = await pool.acquire(100, timeout=1)
    assert slot.view.dtype == torch.uint8 and slot.view.numel() == 100
    assert slot.address == slot.view.data_ptr() == pool.arena().address + slot.offset
    assert slot.offset % 256 == 0 and pool.bytes_in_use == 256 and pool.slots_in_use == 1
    assert pool.release(slot) and pool.bytes_in_use == 0


@pytest.mark.anyio
async def test_back_pressure_waits_then_succeeds() -> None:
    pool = cpu_pool(4096)
    first = await pool.acquire(4096, timeout=1)
    got: list[Slot] = []

    async def waiter() -> None:
        got.append(await pool.acquire(1024, timeout=5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until(lambda: pool.waiting == 1)  # parked: nothing to take yet
        assert not got
        started = time.monotonic()
        pool.release(first)
    assert got and got[0].nbytes == 1024 and time.monotonic() - started < 1
    assert pool.waiting == 0 and pool.slots_in_use == 1
    pool.release(got[0])
    assert pool.slots_in_use == 0


@pytest.mark.anyio
async def test_full_pool_times_out() -> None:
    pool = cpu_pool(4096)
    held = await pool.acquire(4000, timeout=1)
    started = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="in time") as info:
        await pool.acquire(512, timeout=0.05)
    assert 0.04 < time.monotonic() - started < 1
    assert info.value.code == "pool_exhausted" and info.value.details["nbytes"] == 512
    assert pool.waiting == 0 and pool.slots_in_use == 1
    pool.release(held)


@pytest.mark.anyio
async def test_oversized_request_fails_at_once() -> None:
    pool = cpu_pool(4096)
    started = time.monotonic()
    with pytest.raises(PoolExhaustedError, match="larger than the whole pool"):
        await pool.acquire(4097, timeout=30)
    assert time.monotonic() - started < 0.5 and pool.waiting == 0


@pytest.mark.anyio
async def test_cancelled_waiter_leaks_nothing() -> None:
    pool = cpu_pool(4096)
    held = await pool.acquire(4096, timeout=1)
    with anyio.move_on_after(0.05) as scope:
        await pool.acquire(256, timeout=10)
    assert scope.cancelled_caught
    assert pool.waiting == 0 and pool.slots_in_use == 1
    pool.release(held)
    assert pool.slots_in_use == 0 and pool.bytes_in_use == 0
    assert (await pool.acquire(4096, timeout=0)).nbytes == 4096


@pytest.mark.anyio
async def test_waiters_are_served_in_order() -> None:
    pool = cpu_pool(4096)
    held = [await pool.acquire(1024, timeout=1) for _ in range(4)]
    order: list[str] = []

    async def take(name: str, nbytes: int) -> None:
        slot = await pool.acquire(nbytes, timeout=5)
        order.append(name)
        pool.release(slot)

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, "big", 3072)
        await until(lambda: pool.waiting == 1)
        tg.start_soon(take, "small", 256)
        await until(lambda: pool.waiting == 2)
        pool.release(held[0])  # room for "small", but "big" is first in line
        await anyio.wait_all_tasks_blocked()  # both ran as far as they can: parked again
        assert order == [] and pool.waiting == 2
        for slot in held[1:]:
            pool.release(slot)
    assert order == ["big", "small"] and pool.slots_in_use == 0


@pytest.mark.anyio
async def test_second_release_is_ignored_and_cannot_free_a_reused_offset() -> None:
    pool = cpu_pool(4096)
    a = await pool.acquire(4096, timeout=1)
    assert pool.release(a) is True
    b = await pool.acquire(4096, timeout=1)
    assert b.offset == a.offset
    assert pool.release(a) is False  # stale: b must stay live
    assert pool.slots_in_use == 1
    assert pool.release(b) is True and pool.release(b) is False
    assert pool.slots_in_use == 0


def test_taking_cutting_and_giving_back_a_slot_asks_nothing_of_torch() -> None:
    """No torch op until the slot's bytes are wanted as a tensor (``view``, made once) or its payload's
    views are made over its ``span`` (one ``as_strided`` a tensor: tests/broker/data/test_payload_codec.py)."""
    pool = cpu_pool(4096)
    with TorchOps() as ops:
        slot = pool.take_now(2048)
        assert slot is not None
        cut = pool.shrink(slot, 1000)
        span = cut.span
        assert cut.device == torch.device("cpu")
        assert pool.release(cut)
    assert ops.names == []
    assert (span.offset, span.nbytes, span.views.tensor.data_ptr()) == (slot.offset, 1000, pool.arena().address)
    slot = pool.take_now(64)
    assert slot is not None
    with TorchOps() as ops:
        assert slot.view is slot.view
    assert ops.names == ["aten.as_strided.default"]


@pytest.mark.anyio
async def test_a_shrunk_slot_gives_its_tail_back_to_a_waiter_and_the_old_object_goes_stale() -> None:
    pool = cpu_pool(4096)
    big = await pool.acquire(4096, timeout=1)
    big.view.fill_(7)
    got: list[Slot] = []

    async def waiter() -> None:
        got.append(await pool.acquire(2048, timeout=5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until(lambda: pool.waiting == 1)
        cut = pool.shrink(big, 1000)
    assert got and got[0].offset == 1024, "the tail woke the waiter"
    assert (cut.offset, cut.nbytes, cut.address) == (big.offset, 1000, big.address)
    assert cut.view.numel() == 1000 and cut.view.data_ptr() == big.view.data_ptr() and int(cut.view[999]) == 7
    assert pool.shrink(cut, 2000) is cut, "never grows"
    assert pool.release(big) is False, "the uncut object is stale"
    assert pool.release(cut) is True and pool.release(got[0]) is True and pool.slots_in_use == 0
    assert pool.shrink(cut, 10) is cut, "a slot no longer live is left as it is"


@pytest.mark.anyio
async def test_close_fails_waiters_and_later_acquires() -> None:
    reg = CountingRegistrar()
    pool = cpu_pool(4096, reg)
    held = await pool.acquire(4096, timeout=1)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await pool.acquire(64, timeout=10)
        except PoolExhaustedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until(lambda: pool.waiting == 1)
        pool.close()
    assert len(errors) == 1 and "closed" in str(errors[0])
    with pytest.raises(PoolExhaustedError, match="closed"):
        await pool.acquire(64, timeout=1)
    assert reg.deregistered == 1
    del held


# -- pool sets --------------------------------------------------------------------------------------------


class StuckPool:
    """A stand-in for a second kind's pool (no GPU here) that never frees anything."""

    kind = DeviceKind.CUDA
    capacity = slots_in_use = bytes_in_use = 0

    def __init__(self, fail_after: float | None) -> None:
        self.fail_after = fail_after

    def take_now(self, nbytes: int) -> None:
        return None  # never a free slot: acquire waits

    async def acquire(self, nbytes: int, *, timeout: float) -> Any:
        if self.fail_after is None:
            await anyio.sleep_forever()
        else:
            await anyio.sleep(self.fail_after)
        raise PoolExhaustedError("stuck")

    def release(self, slot: Any) -> bool:
        raise AssertionError("nothing was handed out")


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_acquire_regions_is_all_or_nothing(how: str) -> None:
    cpu = cpu_pool(4096)
    pools: Any = {DeviceKind.CPU: cpu, DeviceKind.CUDA: StuckPool(0.02 if how == "timeout" else None)}
    pool_set = PoolSet(pools)
    manifest = manifest_of(cpu=1024, cuda=1024)
    if how == "timeout":
        with pytest.raises(PoolExhaustedError):
            await pool_set.acquire_regions(manifest, timeout=5)
    else:
        with anyio.move_on_after(0.05) as scope:
            await pool_set.acquire_regions(manifest, timeout=5)
        assert scope.cancelled_caught
    assert cpu.slots_in_use == 0 and cpu.bytes_in_use == 0 and cpu.waiting == 0


@pytest.mark.anyio
async def test_acquire_regions_shares_one_deadline_and_checks_kinds() -> None:
    pool_set = PoolSet({DeviceKind.CPU: cpu_pool(4096)})
    with pytest.raises(ManifestError, match="no pool"):
        await pool_set.acquire_regions(manifest_of(cuda=64), timeout=1)
    dup = Manifest.model_construct(
        tree={"v": None}, tensors=[], regions=[RegionSpec(device=DeviceKind.CPU, nbytes=64)] * 2
    )
    with pytest.raises(ManifestError, match="same device kind"):
        await pool_set.acquire_regions(dup, timeout=1)
    held = await pool_set.acquire_regions(manifest_of(cpu=4096), timeout=1)
    started = time.monotonic()
    with pytest.raises(PoolExhaustedError):
        await pool_set.acquire_regions(manifest_of(cpu=64), timeout=0.05)
    assert time.monotonic() - started < 1
    pool_set.release_all(held)
    assert pool_set.slots_in_use == 0


@pytest.mark.anyio
async def test_thousand_cycles_leave_nothing_behind() -> None:
    reg = CountingRegistrar()
    pool_set = PoolSet.from_config(DataPlaneConfig(cpu_pool_bytes=MiB, gpu_pool_bytes=0), registrar=reg)
    assert list(pool_set.pools) == [DeviceKind.CPU] and pool_set.capacity == MiB
    ids = torch.arange(3)
    payload = {"text": torch.randn(3, 5120).to(torch.bfloat16), "ids": ids, "step": 1}
    plan = plan_payload(payload)
    for i in range(1000):
        slots = await pool_set.acquire_regions(plan.manifest, timeout=1)
        if i % 100 == 0:  # the full producer -> consumer path now and then
            pack_into(plan, {k: s.view for k, s in slots.items()})
            validate_remote_regions(plan.manifest, [s.remote_region() for s in slots.values()], pool_set.arenas())
            got = unpack(plan.manifest, {k: s.view for k, s in slots.items()}, copy=True)
            assert torch.equal(got["ids"], ids)
        pool_set.release_all(slots)
    assert pool_set.slots_in_use == 0 and pool_set.bytes_in_use == 0
    assert reg.registered == 1 and reg.deregistered == 0
    pool_set.close()
    assert reg.deregistered == 1


@pytest.mark.anyio
async def test_real_nixl_agent_registers_each_pool_once() -> None:
    from stageferry.broker.data.nixl.agent import NixlAgent

    try:
        agent = NixlAgent("pool-test")
    except NixlUnavailableError as exc:
        pytest.skip(f"NIXL unavailable: {exc}")
    try:
        pool_set = PoolSet.from_config(DataPlaneConfig(cpu_pool_bytes=MiB, gpu_pool_bytes=64 * MiB), registrar=agent)
        manifest = manifest_of(**{k.value: 4096 for k in pool_set.pools})
        for _ in range(100):
            pool_set.release_all(await pool_set.acquire_regions(manifest, timeout=1))
        assert agent.registrations == len(pool_set.pools)
        pool_set.close()
    finally:
        agent.close()


@pytest.mark.anyio
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
async def test_gpu_pool_slots() -> None:
    reg = CountingRegistrar()
    pool_set = PoolSet.from_config(DataPlaneConfig(cpu_pool_bytes=MiB, gpu_pool_bytes=8 * MiB), registrar=reg)
    assert set(pool_set.pools) == {DeviceKind.CPU, DeviceKind.CUDA} and reg.registered == 2
    gpu_arena = pool_set.pools[DeviceKind.CUDA].arena()
    assert gpu_arena.mem_kind is MemKind.VRAM
    slots = await pool_set.acquire_regions(manifest_of(cpu=100, cuda=5000), timeout=1)
    assert slots[DeviceKind.CUDA].view.is_cuda and slots[DeviceKind.CUDA].device_id == gpu_arena.device_id
    pool_set.release_all(slots)
    pool_set.close()
    assert reg.deregistered == 2
