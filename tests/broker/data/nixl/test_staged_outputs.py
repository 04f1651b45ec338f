"""Staged outputs over real NIXL agents (CPU DRAM, both leaders in this process) and a real Redis: a model
writes into the slot it was handed, the put copies nothing, the consumer READs exactly those bytes; and
every way a staging can end gives its slot back to the pool."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.broker.data.staging import blank
from stageferry.config import Timeouts
from stageferry.schemas import NixlPayload, Transport
from stageferry.testing import assert_same
from tests.broker.data.nixl.test_connector import consumer as running_connector

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

KEY = "r-1_0_0"


def template() -> dict[str, Any]:
    """A 257 KiB payload (above the inline size): a big and a small tensor, plain values."""
    return {
        "latents": blank((256, 256), torch.float32, "cpu"),
        "tokens": torch.zeros(100, dtype=torch.int64),  # a real tensor describes itself
        "meta": {"n": 3, "name": "x"},
    }


def written(out: dict[str, Any]) -> dict[str, Any]:
    """What a model does with the staged tensors: writes its results into them (``out=``)."""
    torch.arange(256 * 256, dtype=torch.float32, out=out["latents"].view(-1))
    torch.arange(100, out=out["tokens"])
    return out


def expected() -> dict[str, Any]:
    return {
        "latents": torch.arange(256 * 256, dtype=torch.float32).view(256, 256),
        "tokens": torch.arange(100),
        "meta": {"n": 3, "name": "x"},
    }


@asynccontextmanager
async def leader(redis_url: str, prefix: str, stage: str, **config: Any) -> AsyncIterator[NixlConnector]:
    async with running_connector(redis_url, prefix, stage=stage, **config) as conn:
        assert conn.unavailable_reason is None
        yield conn


async def until(predicate: Any, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.02)


def in_use(conn: NixlConnector) -> int:
    assert conn.pools is not None
    return conn.pools.slots_in_use


def slot_range(conn: NixlConnector) -> tuple[int, int]:
    assert conn.pools is not None
    arena = conn.pools.arenas()[0]
    return arena.address, arena.address + arena.length


async def read_back(consumer: NixlConnector, ref: Any) -> Any:
    async with consumer.get(ref, None, key=KEY) as incoming:
        assert incoming.transport is Transport.NIXL
        return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in incoming.payload.items()}


async def test_a_staged_put_copies_nothing_and_the_consumer_reads_what_the_model_wrote(
    redis_url: str, prefix: str
) -> None:
    async with leader(redis_url, prefix, "encoder") as producer, leader(redis_url, prefix, "diffusion") as consumer:
        out = await producer.stage(KEY, template())
        low, high = slot_range(producer)
        assert all(low <= t.data_ptr() < high for t in (out["latents"], out["tokens"])), "views of the pool"
        assert in_use(producer) == 1 and KEY in producer.stagings
        outgoing = await producer.put(KEY, written(out))
        assert isinstance(outgoing.ref, NixlPayload)
        assert producer.counters.staged_puts == 1 and producer.counters.staged_copies == 0
        assert in_use(producer) == 1 and KEY not in producer.stagings, "the lease took the staged slot"
        assert_same(await read_back(consumer, outgoing.ref), expected())
        await until(lambda: in_use(producer) == 0)  # the READ's notification freed the slot


async def test_tensors_made_elsewhere_are_copied_into_their_place(redis_url: str, prefix: str) -> None:
    async with leader(redis_url, prefix, "encoder") as producer, leader(redis_url, prefix, "diffusion") as consumer:
        out = written(await producer.stage(KEY, template()))
        out["tokens"] = torch.arange(100)  # the model returned its own tensor for this one
        outgoing = await producer.put(KEY, out)
        assert producer.counters.staged_puts == 1 and producer.counters.staged_copies == 1
        assert_same(await read_back(consumer, outgoing.ref), expected())


async def test_a_payload_of_another_layout_takes_the_ordinary_path(redis_url: str, prefix: str) -> None:
    async with leader(redis_url, prefix, "encoder") as producer, leader(redis_url, prefix, "diffusion") as consumer:
        out = written(await producer.stage(KEY, template()))
        other = {**out, "tokens": torch.arange(101)}  # another shape: another manifest
        outgoing = await producer.put(KEY, other)
        assert producer.counters.staged_puts == 0 and producer.counters.puts == 1
        assert in_use(producer) == 1, "the staging was freed, the put's own slot is leased"
        got = await read_back(consumer, outgoing.ref)
        assert_same(got, {**expected(), "tokens": torch.arange(101)})


async def test_a_request_ended_without_a_put_gives_the_slot_back(redis_url: str, prefix: str) -> None:
    """What the stage worker does once the model raised, or the request was cancelled: unstage."""
    async with leader(redis_url, prefix, "encoder") as producer:
        await producer.stage(KEY, template())
        assert in_use(producer) == 1
        producer.unstage(KEY)
        assert in_use(producer) == 0 and len(producer.stagings) == 0
        producer.unstage(KEY)  # idempotent


async def test_an_inline_put_frees_the_staging_after_reading_it(redis_url: str, prefix: str) -> None:
    async with leader(redis_url, prefix, "encoder") as producer, leader(redis_url, prefix, "diffusion") as consumer:
        out = written(await producer.stage(KEY, template()))
        outgoing = await producer.put(KEY, out, force_inline=True)
        assert outgoing.transport is Transport.INLINE and in_use(producer) == 0
        async with consumer.get(outgoing.ref, outgoing.blob, key=KEY) as incoming:
            assert_same(incoming.payload, expected())


async def test_an_abandoned_staging_expires(redis_url: str, prefix: str) -> None:
    async with leader(redis_url, prefix, "encoder") as producer:
        await producer.stage(KEY, template(), deadline=time.time() + 0.2)
        assert in_use(producer) == 1
        await anyio.sleep(0.1)
        assert in_use(producer) == 1, "not before its deadline"
        await until(lambda: in_use(producer) == 0)
        assert len(producer.stagings) == 0


async def test_a_full_pool_answers_plain_tensors(redis_url: str, prefix: str) -> None:
    timeouts = Timeouts(resend=3.0, pool_wait=0.2)
    async with leader(redis_url, prefix, "encoder", cpu_pool_bytes=1 << 20, timeouts=timeouts) as producer:
        first = await producer.stage(KEY, {"a": blank((200_000,), torch.float32, "cpu")})  # 800 KB of 1 MiB
        assert KEY in producer.stagings
        out = await producer.stage("r-2_0_0", template())
        low, high = slot_range(producer)
        assert not low <= out["latents"].data_ptr() < high and "r-2_0_0" not in producer.stagings
        assert out["latents"].shape == (256, 256) and out["meta"] == {"n": 3, "name": "x"}
        assert first["a"].shape == (200_000,) and in_use(producer) == 1


async def test_small_payloads_and_asking_twice(redis_url: str, prefix: str) -> None:
    async with leader(redis_url, prefix, "encoder") as producer:
        small = await producer.stage(KEY, {"a": blank((10,), torch.float32, "cpu")})
        assert small["a"].shape == (10,) and len(producer.stagings) == 0, "inline-sized: ordinary tensors"
        first = await producer.stage(KEY, template())
        again = await producer.stage(KEY, template())  # asked again: ordinary tensors, the first stays staged
        low, high = slot_range(producer)
        assert low <= first["latents"].data_ptr() < high and not low <= again["latents"].data_ptr() < high
        assert in_use(producer) == 1 and len(producer.stagings) == 1
        outgoing = await producer.put(KEY, written(again))  # the same layout: copied into the staged slot
        assert producer.counters.staged_puts == 1 and producer.counters.staged_copies == 2
        assert isinstance(outgoing.ref, NixlPayload) and in_use(producer) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")
async def test_a_vram_staging_is_read_by_the_consumer_gpu(redis_url: str, prefix: str) -> None:
    """The model writes on its stream into the VRAM slot; the put synchronises before the lease is out."""
    gpu = torch.device("cuda", 0)
    last = torch.device("cuda", torch.cuda.device_count() - 1)
    async with (
        leader(redis_url, prefix, "encoder", cuda_device=gpu) as producer,
        leader(redis_url, prefix, "diffusion", cuda_device=last) as consumer,
    ):
        out = await producer.stage(KEY, {"latents": blank((1024, 1024), torch.float32, gpu), "n": 1})
        assert out["latents"].device.type == "cuda"
        torch.arange(1024 * 1024, dtype=torch.float32, device=gpu, out=out["latents"].view(-1))
        outgoing = await producer.put(KEY, out)
        assert producer.counters.staged_puts == 1 and producer.counters.staged_copies == 0
        async with consumer.get(outgoing.ref, None, key=KEY) as incoming:
            got = incoming.payload["latents"]
            assert got.device.type == "cuda"
            assert torch.equal(got.cpu(), torch.arange(1024 * 1024, dtype=torch.float32).view(1024, 1024))
