"""The NIXL connector between two processes (real agents, CPU DRAM over UCX, real Redis).

A producer leader runs in its own process (``tests.peer_producer``); the test process is the
consumer leader.  Payloads are compared bit for bit with what the producer built.
"""

from __future__ import annotations

import base64
import functools
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as sync_redis
import torch
from pydantic import TypeAdapter

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.data import metrics
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.errors import ManifestError, PayloadUnavailableError
from stageferry.schemas import DeviceKind, InlinePayload, NixlPayload, PayloadRef, Transport
from stageferry.testing import assert_same
from tests import zygote
from tests.peer_producer import build
from tests.procs import start_peer, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]
REF = TypeAdapter(PayloadRef)
# One registration per pool: the CPU pool, plus the CUDA pool every connector makes where a GPU is present.
POOLS = 1 + int(torch.cuda.is_available())


@dataclass
class Producer:
    proc: zygote.Proc
    redis: sync_redis.Redis
    prefix: str
    log: Path

    def take(self, timeout: float = 60) -> dict[str, Any]:
        item = self.redis.blpop([f"{self.prefix}:test:refs"], timeout=timeout)
        assert item is not None, f"producer sent nothing: {self.log.read_text()[-3000:]}"
        return json.loads(item[1])

    def stats(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.redis.hgetall(f"{self.prefix}:test:producer").items()}

    def wait_stats(self, **expected: int | str) -> dict[str, str]:
        def ok() -> dict[str, str] | None:
            s = self.stats()
            return s if s and all(s.get(k) == str(v) for k, v in expected.items()) else None

        return wait_for(ok, 20, f"producer stats {expected}; last {self.stats()}")

    async def settled(self, **expected: int | str) -> dict[str, str]:
        """:meth:`wait_stats` with the event loop left running, as a stage's is while its model computes: a
        get's release is sent on the loop's next turn (``nixl.releases``)."""
        return await anyio.to_thread.run_sync(functools.partial(self.wait_stats, **expected))

    def stop(self) -> None:
        self.redis.set(f"{self.prefix}:test:stop", 1)
        self.proc.wait(timeout=30)


@pytest.fixture
def start_producer(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[Any]:
    started: list[Producer] = []

    def start(*args: str) -> Producer:
        log = tmp_path / f"producer-{len(started)}.log"
        proc = start_peer("tests.peer_producer", redis_url, prefix, *args, log=log)
        producer = Producer(proc, sync_redis.Redis.from_url(redis_url, socket_timeout=None), prefix, log)
        started.append(producer)
        return producer

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(10)


@asynccontextmanager
async def consumer(
    redis_url: str,
    prefix: str,
    cuda_device: torch.device | None = None,
    timeouts: Timeouts | None = None,
    stage: str = "diffusion",
    upstream: str | None = None,
    **config: Any,
) -> AsyncIterator[NixlConnector]:
    """A running connector of a ``stage`` leader (the consumer side by default), closed on exit; with
    ``upstream``, it connects to that stage's agents ahead of their payloads, as a stage's does."""
    redis = connect(redis_url)
    conn = NixlConnector(
        redis=redis,
        keys=Keys(prefix),
        stage=stage,
        replica="test",
        config=DataPlaneConfig(**config),
        timeouts=timeouts or Timeouts(resend=3.0),
        cuda_device=cuda_device,
        upstream=upstream,
    )
    await anyio.to_thread.run_sync(conn.open)
    async with anyio.create_task_group() as tg:
        await tg.start(conn.run)
        try:
            yield conn
        finally:
            tg.cancel_scope.cancel()
    await conn.aclose()
    await redis.aclose()


def ref_of(item: dict[str, Any]) -> tuple[Any, bytes | None]:
    blob = base64.b64decode(item["blob"]) if item.get("blob") is not None else None
    return REF.validate_json(item["ref"]), blob


@pytest.mark.parametrize("mode", ["queried", "direct"])
async def test_task_payloads_round_trip_exactly(start_producer: Any, redis_url: str, prefix: str, mode: str) -> None:
    specs = ["T2VA", "FL2VA", "Ref2VA", "bytes:1000", "bytes:0"]
    producer = start_producer("--payloads", ",".join(specs), "--mode", mode)
    nixl_gets_before = metrics.GETS.labels("nixl")._value.get()
    async with consumer(redis_url, prefix) as conn:
        for spec in specs:
            item = producer.take()
            ref, blob = ref_of(item)
            small = spec.startswith("bytes:")
            assert isinstance(ref, InlinePayload if small else NixlPayload), spec
            if mode == "direct" and not small:
                assert isinstance(ref, NixlPayload) and ref.agent_metadata_b64
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert incoming.transport is (Transport.INLINE if small else Transport.NIXL)
                assert_same(incoming.payload, build(spec, item["seed"]))
                if not small:  # host memory on both sides, and the UCX transport that carried it
                    assert isinstance(ref, NixlPayload)
                    assert incoming.route is not None and incoming.route.startswith("DRAM→DRAM "), incoming.route
                    routes = conn.peers._peers[ref.agent].routes  # kept per layout once UCX named the transport
                    assert list(routes.values()) == ([] if incoming.route.endswith(" ?") else [incoming.route])
        assert conn.pools is not None and conn.pools.slots_in_use == 0
        assert conn.agent is not None and conn.agent.open_handles() == 0
        assert metrics.GETS.labels("nixl")._value.get() - nixl_gets_before == 3  # counted, per transport
        await producer.settled(leases=0, slots_in_use=0, open_handles=0, registrations=POOLS)
        producer.stop()


async def test_nixl_unavailable_at_the_producer_goes_inline_up_to_the_cap(
    start_producer: Any, redis_url: str, prefix: str
) -> None:
    producer = start_producer("--payloads", "FL2VA,Ref2VA", "--backends", "NO_SUCH_BACKEND")
    async with consumer(redis_url, prefix) as conn:
        item = producer.take()
        ref, blob = ref_of(item)
        assert isinstance(ref, InlinePayload) and ref.fallback_reason == "nixl_unavailable"
        async with conn.get(ref, blob, key=item["key"]) as incoming:
            assert incoming.transport is Transport.INLINE
            assert_same(incoming.payload, build("FL2VA", item["seed"]))
        # 65 MB is above the 16 MiB inline-fallback cap: the put fails, the stage recomputes (worker test).
        assert producer.take()["error"] == "payload_unavailable"
        await producer.settled(unavailable="nixl_unavailable")
    producer.stop()


async def test_nixl_unavailable_at_the_consumer_gets_an_inline_resend(
    start_producer: Any, redis_url: str, prefix: str
) -> None:
    producer = start_producer("--payloads", "FL2VA,Ref2VA")
    async with consumer(redis_url, prefix, nixl_backends=("NO_SUCH_BACKEND",)) as conn:
        assert conn.agent is None
        item = producer.take()
        ref, blob = ref_of(item)
        async with conn.get(ref, blob, key=item["key"]) as incoming:
            assert incoming.transport is Transport.INLINE and incoming.fallback_reason == "nixl_unavailable"
            assert_same(incoming.payload, build("FL2VA", item["seed"]))
        item = producer.take()
        ref, blob = ref_of(item)
        with pytest.raises(PayloadUnavailableError):  # above the cap: only a recompute can help
            async with conn.get(ref, blob, key=item["key"]):
                pass
        await producer.settled(leases=0, slots_in_use=0)
    producer.stop()


async def test_a_thousand_transfers_leave_no_resources_behind(start_producer: Any, redis_url: str, prefix: str) -> None:
    count = 1000
    producer = start_producer("--payloads", "bytes:100000", "--repeat", str(count), "--pool-mib", "4")
    async with consumer(redis_url, prefix, cpu_pool_bytes=4 << 20) as conn:
        assert conn.agent is not None
        registrations = conn.agent.registrations
        for _ in range(count):
            item = producer.take()
            ref, blob = ref_of(item)
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert incoming.transport is Transport.NIXL
                assert incoming.payload["blob"].numel() == 100_000
        assert conn.agent.registrations == registrations == POOLS, "no registration per request"
        assert conn.counters.reads == count
        # At rest: no slot held but the next payload's, made ready while idle (counted apart), and every get
        # that came after an idle moment found its payload ready.
        resources = conn.resources()
        assert resources["pool_slots_in_use"] == 0 and resources["open_handles"] == 0
        assert resources["ready_slots"] == 1 and conn.pools is not None and conn.pools.slots_in_use == 1
        assert conn.consumer.ready.hits >= count // 3, conn.consumer.ready.hits  # (this loop never idles)
        stats = await producer.settled(leases=0, slots_in_use=0, open_handles=0, registrations=POOLS)
        assert stats["puts"] == str(count)
        assert len(conn.agent.remotes()) == 1
        producer.stop()
        # The producer's record is gone: the consumer forgets its agent (remote agents back to baseline).
        with anyio.fail_after(30):
            while conn.agent.remotes():
                await anyio.sleep(0.2)


@pytest.mark.parametrize("die_after", ["claim", "post"])
async def test_consumer_killed_mid_read_frees_the_slot_once_its_claim_expires(
    start_producer: Any, redis_url: str, prefix: str, tmp_path: Path, die_after: str
) -> None:
    # The reader first, waiting for the ref: the 3 s lease starts at the producer's put.
    log = tmp_path / "reader.log"
    reader = start_peer("tests.peer_reader_dies", redis_url, prefix, "--die-after", die_after, log=log)
    producer = start_producer("--payloads", "Ref2VA", "--lease", "3")
    assert reader.wait(timeout=60) == -9, log.read_text()[-3000:]
    r = sync_redis.Redis.from_url(redis_url)
    claims = list(r.scan_iter(match=f"{prefix}:nixl:claim:*"))
    # After 'post' the READ may have completed already: the producer then marked the claim 'released'.
    owner = r.get(claims[0]) or b""
    assert len(claims) == 1 and (owner.startswith(b"diffusion-doomed-") or (die_after, owner) == ("post", b"released"))
    if die_after == "claim":
        # The lease (3 s: a loaded box takes a second or two to start the reader) runs out, but while the
        # dead consumer's claim (8 s, its own setting) lives, the slot is never freed; once it expires, it is.
        while True:  # stats first, then the claim: a claim that expired in between cannot fail this
            leases = producer.stats()["leases"]
            owner = r.get(claims[0])  # after expiry the producer writes "expired" here: not a claim
            if owner is None or not owner.startswith(b"diffusion-doomed-"):
                break
            assert leases == "1", "freed under a live claim"
            time.sleep(0.1)
    await producer.settled(leases=0, slots_in_use=0)
    producer.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")
async def test_cuda_leaves_land_on_the_consumer_gpu(start_producer: Any, redis_url: str, prefix: str) -> None:
    """VRAM → VRAM between two processes (GPU 0 → GPU 1 when there are two), CPU leaves beside them."""
    dst = torch.device("cuda", torch.cuda.device_count() - 1)
    producer = start_producer("--payloads", "mixed,mixed", "--device", "cuda:0")
    async with consumer(redis_url, prefix, cuda_device=dst) as conn:
        for _ in range(2):
            item = producer.take()
            ref, blob = ref_of(item)
            assert isinstance(ref, NixlPayload)
            assert {r.mem_kind.value for r in ref.regions} == {"DRAM", "VRAM"}
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                got = incoming.payload
                assert incoming.transport is Transport.NIXL
                assert got["gpu"].device == dst and got["ids"].device == dst and got["empty_gpu"].device == dst
                assert got["cpu"]["hidden_states"].device.type == "cpu"
                assert_same(got, build("mixed", item["seed"], "cuda:0"))
                # each region's memory on both sides, and what moved it: cuda_ipc on one host, the same-GPU
                # copy when both processes are on one GPU (the VRAM; the host memory is READ beside it)
                moved = "same-gpu copy" if dst.index == 0 else "cuda_ipc"
                assert incoming.route is not None and f"VRAM:0→VRAM:{dst.index} {moved}" in incoming.route
                assert "DRAM→DRAM " in incoming.route, incoming.route
        await producer.settled(leases=0, slots_in_use=0)
    producer.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")
async def test_a_block_cancelled_with_cuda_slots_still_returns_them(
    start_producer: Any, redis_url: str, prefix: str
) -> None:
    """The exit's CUDA synchronize runs shielded: a cancelled block waits for it, then gives the slots back
    (a cancelled wait there used to skip the release and leak them)."""
    dst = torch.device("cuda", torch.cuda.device_count() - 1)
    producer = start_producer("--payloads", "mixed", "--device", "cuda:0")
    async with consumer(redis_url, prefix, cuda_device=dst) as conn:
        assert conn.pools is not None
        item = producer.take()
        ref, blob = ref_of(item)
        with anyio.CancelScope() as scope:
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert DeviceKind.CUDA in (incoming.regions or {})
                scope.cancel()
                await anyio.sleep(1)
        assert scope.cancelled_caught
        assert conn.pools.slots_in_use == 0, "the CUDA and CPU slots went back"
        await producer.settled(leases=0, slots_in_use=0)
    producer.stop()


async def test_an_unclaimed_lease_expires_and_the_payload_is_then_gone(
    start_producer: Any, redis_url: str, prefix: str
) -> None:
    producer = start_producer("--payloads", "FL2VA", "--lease", "1")
    item = producer.take()
    await producer.settled(leases=0, slots_in_use=0)  # nobody claimed it within its lease: freed
    ref, blob = ref_of(item)
    async with consumer(redis_url, prefix) as conn:
        with pytest.raises(PayloadUnavailableError):  # the producer marked the claim key "expired"
            async with conn.get(ref, blob, key=item["key"]):
                pass
        assert conn.pools is not None and conn.pools.slots_in_use == 0
    producer.stop()


async def test_a_descriptor_pointing_at_another_lease_is_refused_before_any_read(
    start_producer: Any, redis_url: str, prefix: str
) -> None:
    """Two live leases; the first's envelope rewritten to the second's slot (inside the producer's pool,
    so region checks pass) is refused by the lease seal, and the second payload still arrives intact."""
    producer = start_producer("--payloads", "FL2VA,FL2VA")
    async with consumer(redis_url, prefix) as conn:
        first, second = producer.take(), producer.take()
        ref1, _ = ref_of(first)
        ref2, _ = ref_of(second)
        assert isinstance(ref1, NixlPayload) and isinstance(ref2, NixlPayload)
        shifted = ref1.model_copy(update={"regions": ref2.regions})
        reads_before = conn.counters.reads
        with pytest.raises(ManifestError, match="leased"):
            async with conn.get(shifted, None, key=first["key"]):
                pass
        unsealed = ref2.model_copy(update={"seal": ""})
        with pytest.raises(ManifestError, match="leased"):
            async with conn.get(unsealed, None, key=second["key"]):
                pass
        assert conn.counters.reads == reads_before, "nothing was READ"
        async with conn.get(ref2, None, key=second["key"]) as incoming:
            assert_same(incoming.payload, build("FL2VA", second["seed"]))
        producer.stop()
