"""The same-GPU fast path (issue 39): chosen only for a producer on our own GPU UUID, for the regions of a
payload in VRAM inside its mapped arena (a host-memory rest, as a pipeline's ``layout``, is READ beside
it); anything else — another GPU, a handle that does not parse, is of another version, names another
arena or cannot be opened, a copy that fails — is logged and READ over NIXL.

On this CPU box the selection and every fallback run with real agents (a producer process, DRAM over
UCX) and real Redis: the producer's record is given a GPU UUID and an exported arena as a GPU producer
would publish them, and the consumer is told it is on that GPU.  The copy itself needs CUDA (two
processes on one GPU: ``benchmarks/issue39_device.sh`` runs those tests on the H200).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import redis as sync_redis
import redis.asyncio as aioredis
import structlog
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.data.nixl import peers as peers_module
from stageferry.broker.data.nixl.cuda_runtime import CudaRuntime, EventPool
from stageferry.broker.data.nixl.peers import Peers
from stageferry.broker.data.nixl.same_gpu import IpcArena, SameGpu
from stageferry.broker.data.payload_codec import plan_payload
from stageferry.broker.data.pool import MemoryPool
from stageferry.config import DataPlaneConfig
from stageferry.errors import HandshakeError, TransferError
from stageferry.schemas import DeviceKind, NixlPayload, RemoteRegion, Transport
from stageferry.schemas.cuda_ipc import CUDA_IPC_VERSION, CudaIpcArena
from stageferry.testing import assert_same
from tests.broker.data.nixl.test_connector import consumer, ref_of, start_producer  # noqa: F401 - a fixture
from tests.peer_producer import build
from tests.sentinels import eventually

pytest.importorskip("nixl")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

UUID = "GPU-3f0c2a51-7d7e-4b6c-9b0e-0a4c5e6f7a8b"
VRAM_ARENA = RemoteRegion(mem_kind="VRAM", address=1 << 40, length=1 << 24, device_id=0)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")


def exported(**changes: Any) -> CudaIpcArena:
    """An arena as a producer on GPU ``UUID`` would export it (the handle bytes are opaque here)."""
    fields: dict[str, Any] = {
        "gpu_uuid": UUID,
        "address": VRAM_ARENA.address,
        "length": VRAM_ARENA.length,
        "tensor_offset": 0,
        "handle": "ab" * 64,
        "storage_size": VRAM_ARENA.length,
        "storage_offset": 0,
        "ref_counter_handle": b"/torch_4242_2933135394_1".hex(),  # as torch names it
        "ref_counter_offset": 0,
        "event_handle": "cd" * 64,
        "event_sync_required": True,
    }
    return CudaIpcArena(**{**fields, **changes})


def publish_as_gpu_producer(redis_url: str, prefix: str, uuid: str, cuda_ipc: bytes) -> str:
    """Give the producer's record what a producer on GPU ``uuid`` publishes; its agent name."""
    client = sync_redis.Redis.from_url(redis_url)
    try:
        keys = Keys(prefix)
        name = client.hget(keys.agents("encoder"), "encoder-peer")
        assert isinstance(name, bytes)
        key = keys.agent(name.decode())
        arenas = json.loads(client.hget(key, "arenas") or b"[]")
        arenas.append(VRAM_ARENA.model_dump(mode="json"))
        client.hset(key, mapping={"gpu_uuid": uuid, "cuda_ipc": cuda_ipc, "arenas": json.dumps(arenas)})
        return name.decode()
    finally:
        client.close()


def index_entry(redis_url: str, prefix: str) -> bytes | None:
    client = sync_redis.Redis.from_url(redis_url)
    try:
        value = client.hget(Keys(prefix).agents("encoder"), "encoder-peer")
        return value if isinstance(value, bytes) else None
    finally:
        client.close()


@pytest.mark.parametrize(
    ("case", "uuid", "cuda_ipc", "error"),
    [
        ("another GPU", "GPU-00000000-0000-0000-0000-000000000000", exported().to_json().encode(), None),
        ("not JSON", UUID, b"{not json", "cuda_ipc field is not JSON"),
        ("another version", UUID, exported(version=CUDA_IPC_VERSION + 1).to_json().encode(), "of version 2"),
        ("another arena", UUID, exported(address=VRAM_ARENA.address + 4096).to_json().encode(), "VRAM arena"),
        ("cannot be opened", UUID, exported().to_json().encode(), "cannot open the producer's CUDA IPC arena"),
        # an arena's warm-up copy never ended before (its slot is kept): no other arena is mapped, nor slot kept
        ("after a copy that did not end", UUID, exported().to_json().encode(), "a copy did not end"),
    ],
)
async def test_a_producer_not_usable_as_same_gpu_is_read_over_nixl(
    start_producer: Any,  # noqa: F811 - the fixture imported above
    redis_url: str,
    prefix: str,
    case: str,
    uuid: str,
    cuda_ipc: bytes,
    error: str | None,
) -> None:
    if case in ("cannot be opened", "after a copy that did not end") and torch.cuda.is_available():
        pytest.skip("a GPU here could open a handle; the opaque bytes are for a box without CUDA")
    producer = start_producer("--payloads", "T2VA", "--hold", "go")
    await eventually(lambda: _async(index_entry(redis_url, prefix)), timeout=60, what="the producer's record")
    name = publish_as_gpu_producer(redis_url, prefix, uuid, cuda_ipc)
    async with consumer(redis_url, prefix, same_gpu_copy=True) as conn:
        conn.endpoint.gpu_uuid = UUID  # this process is "on" GPU UUID
        if case == "after a copy that did not end":
            conn.peers._stranded.append(IpcArena(exported(), torch.empty(0, dtype=torch.uint8)))
        producer.redis.set(f"{prefix}:test:go", 1)
        item = producer.take()
        ref, blob = ref_of(item)
        with structlog.testing.capture_logs() as logs:
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert incoming.transport is Transport.NIXL and incoming.route is not None
                assert "same-gpu" not in incoming.route, incoming.route
                assert_same(incoming.payload, build(item["spec"], item["seed"]))
        assert conn.counters.same_gpu == 0 and conn.consumer.same_gpu.copies == 0
        assert conn.consumer.same_gpu.primed == 0  # nothing queued for a peer READ
        assert conn.peers._peers[name].ipc is None and conn.counters.fallbacks == {}
        unavailable = [e for e in logs if e["event"] == "nixl.same_gpu_unavailable"]
        if error is None:  # another GPU: not even tried
            assert unavailable == []
        else:
            assert [(e["peer"], e["fallback"]) for e in unavailable] == [(name, "nixl")], logs
            assert error in unavailable[0]["error"], unavailable[0]["error"]
        await producer.settled(leases=0, slots_in_use=0)  # released as after any READ
    producer.stop()


def vram_ref(nbytes: int, address: int) -> NixlPayload:
    """A reference to one VRAM region of ``nbytes`` at ``address`` (checks of the selection only)."""
    manifest = plan_payload({"x": torch.zeros(nbytes, dtype=torch.uint8)}).manifest
    regions = [r.model_copy(update={"device": DeviceKind.CUDA}) for r in manifest.regions]
    manifest = manifest.model_copy(update={"regions": regions})
    region = RemoteRegion(mem_kind="VRAM", address=address, length=nbytes, device_id=0)
    return NixlPayload.model_construct(  # type: ignore[call-arg]  # the fields these checks never read: left out
        manifest=manifest, regions=[region], agent="encoder-peer-0123abcd"
    )


async def test_the_copy_is_chosen_only_for_vram_regions_inside_the_mapped_arena(redis_url: str, prefix: str) -> None:
    async with consumer(redis_url, prefix, same_gpu_copy=True) as conn:
        same = SameGpu(conn.endpoint)
        arena = IpcArena(exported(), torch.empty(0, dtype=torch.uint8))
        cuda_slot: Any = object()
        slots: Any = {DeviceKind.CUDA: cuda_slot}
        inside = vram_ref(4096, VRAM_ARENA.address + 8192)
        assert same.regions(inside, arena, slots)
        assert not same.regions(inside, None, slots)  # the producer's arena is not mapped (another GPU)
        assert not same.regions(inside, arena, {DeviceKind.CPU: cuda_slot})  # no CUDA slot of ours
        past_end = vram_ref(4096, VRAM_ARENA.address + VRAM_ARENA.length - 2048)
        assert not same.regions(past_end, arena, slots)
        below = vram_ref(4096, VRAM_ARENA.address - 4096)
        assert not same.regions(below, arena, slots)
        dram = inside.model_copy(update={"regions": [inside.regions[0].model_copy(update={"mem_kind": "DRAM"})]})
        assert not same.regions(dram, arena, slots)
        host = dram.manifest.regions[0].model_copy(update={"device": DeviceKind.CPU})
        mixed = NixlPayload.model_construct(  # type: ignore[call-arg]  # a pipeline's payload: its layout in host memory, the rest VRAM
            manifest=inside.manifest.model_copy(update={"regions": [host, inside.manifest.regions[0]]}),
            regions=[dram.regions[0], inside.regions[0]],
            agent=inside.agent,
        )
        assert same.regions(mixed, arena, slots) == frozenset({1})  # the VRAM region; the layout is READ
        conn.endpoint.config = DataPlaneConfig(same_gpu_copy=False)
        assert not same.regions(inside, arena, slots)  # switched off


def test_the_handle_message_is_versioned_and_bounded() -> None:
    arena = exported()
    assert CudaIpcArena.from_json(arena.to_json()) == arena
    cases: list[tuple[bytes | str, str]] = [
        (b"[]", "of version None"),
        (json.dumps({**arena.model_dump(), "version": 0}), "of version 0"),
        (json.dumps({**arena.model_dump(), "handle": "xyz"}), "malformed"),
        (json.dumps({**arena.model_dump(), "extra": 1}), "malformed"),
        # torch would map whatever shared-memory object is named, and write at the offset when unmapping it
        (json.dumps({**arena.model_dump(), "ref_counter_handle": b"/sf-pool-ab12".hex()}), "malformed"),
        (json.dumps({**arena.model_dump(), "ref_counter_handle": b"/torch_1_2_3/../x".hex()}), "malformed"),
        (json.dumps({**arena.model_dump(), "ref_counter_offset": 10000}), "malformed"),
        (b" " * 5000, "too large"),
        # within the size: past 3.11's recursion limit (not JSON), within 3.12's (a list, no version): no crash
        (b"[" * 2000 + b"]" * 2000, "not JSON|of version None"),
    ]
    for raw, message in cases:
        with pytest.raises(HandshakeError, match=message):
            CudaIpcArena.from_json(raw)


# -- on a GPU: two processes on one GPU ----------------------------------------------------------------


@CUDA
@pytest.mark.parametrize("spec", ["gpu:T2VA", "gpu:FL2VA", "gpu:Ref2VA", "mixed"])
async def test_a_producer_on_our_gpu_is_copied_device_to_device(
    start_producer: Any,  # noqa: F811 - the fixture imported above
    redis_url: str,
    prefix: str,
    spec: str,
) -> None:
    """The copy, queued with the CUDA runtime's calls (torch's own libcudart), delivers the producer's
    bytes exactly, by default (``same_gpu_copy`` is on unless switched off); a payload with host-memory
    leaves too (``mixed``, as the pipeline's encoder writes them) has those READ beside the copy."""
    dev = torch.device("cuda", 0)
    producer = start_producer("--payloads", f"{spec},{spec}", "--device", "cuda:0", "--hold", "go")
    async with consumer(redis_url, prefix, cuda_device=dev, upstream="encoder") as conn:
        assert CudaRuntime.loaded() is not None  # found where CUDA is
        peer = await eventually(
            lambda: _async(next(iter(conn.peers.peers_of("encoder")), None)), timeout=60, what="connected"
        )
        assert peer.ipc is not None and peer.gpu_uuid == conn.endpoint.gpu_uuid  # mapped ahead of payloads
        producer.redis.set(f"{prefix}:test:go", 1)
        for _ in range(2):
            item = producer.take()
            ref, blob = ref_of(item)
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert incoming.transport is Transport.NIXL
                if spec == "mixed":
                    parts = sorted((incoming.route or "").split(", "))
                    assert len(parts) == 2 and parts[0].startswith("DRAM→DRAM "), incoming.route
                    assert parts[1] == "VRAM:0→VRAM:0 same-gpu copy", incoming.route
                else:
                    assert incoming.route == "VRAM:0→VRAM:0 same-gpu copy", incoming.route
                assert_same(incoming.payload, build(item["spec"], item["seed"], "cuda:0"))
        assert conn.counters.same_gpu == 2 and conn.counters.fallbacks == {}
        assert conn.consumer.same_gpu.primed == 2  # each get queued its scratch copy first (SameGpu.prime)
        await producer.settled(leases=0, slots_in_use=0)  # the release notification freed both slots
    producer.stop()


@CUDA
async def test_a_copy_that_fails_falls_back_to_the_read(
    start_producer: Any,  # noqa: F811 - the fixture imported above
    redis_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = torch.device("cuda", 0)
    producer = start_producer("--payloads", "gpu:FL2VA", "--device", "cuda:0", "--hold", "go")
    async with consumer(redis_url, prefix, cuda_device=dev, upstream="encoder", same_gpu_copy=True) as conn:
        peer = await eventually(
            lambda: _async(next(iter(conn.peers.peers_of("encoder")), None)), timeout=60, what="connected"
        )
        assert peer.ipc is not None
        runtime = CudaRuntime.loaded()
        assert runtime is not None
        monkeypatch.setattr(runtime, "_memcpy", lambda *args: 1)  # the runtime refuses: cudaErrorInvalidValue
        producer.redis.set(f"{prefix}:test:go", 1)
        item = producer.take()
        ref, blob = ref_of(item)
        with structlog.testing.capture_logs() as logs:
            async with conn.get(ref, blob, key=item["key"]) as incoming:
                assert incoming.route is not None and "same-gpu" not in incoming.route, incoming.route
                assert_same(incoming.payload, build(item["spec"], item["seed"], "cuda:0"))
        (fallback,) = [e for e in logs if e["event"] == "nixl.same_gpu_fallback"]
        assert fallback["fallback"] == "nixl" and "same-GPU copy failed" in fallback["error"]
        assert conn.counters.same_gpu == 0 and conn.counters.fallbacks == {}
        await producer.settled(leases=0, slots_in_use=0)
    producer.stop()


async def _async(value: Any) -> Any:
    return value


class FailingCopy:
    """Stands in for a queued copy (CUDA) whose completion the runtime reports as an error."""

    def query(self) -> bool:
        raise RuntimeError("cudaEventQuery failed: an illegal memory access was encountered")

    def synchronize(self) -> None:
        raise RuntimeError("cudaEventSynchronize failed: an illegal memory access was encountered")


async def test_a_runtime_error_while_waiting_for_the_copy_is_a_transfer_error(redis_url: str, prefix: str) -> None:
    """Translated once, where the copy is waited for: the consumer then READs the payload instead (a raw
    RuntimeError would skip the fallback and leave the producer's slot to its lease's expiry)."""
    async with consumer(redis_url, prefix, same_gpu_copy=True) as conn:
        same = SameGpu(conn.endpoint)
        with pytest.raises(TransferError, match="same-GPU copy failed: cudaEventQuery failed"):
            await same.wait(FailingCopy())  # type: ignore[arg-type]
        assert same.copies == 0


class RecordingRuntime:
    """Stands in for the CUDA runtime's calls (no GPU here): records them in order; ``fail`` names the one
    the runtime refuses, as it refuses after a lost context."""

    def __init__(self, fail: str | None = None, *, ends: bool = True) -> None:
        self.calls: list[str] = []
        self.fail = fail
        self.ends = ends  # whether a queued copy is ever seen done
        self.events = 0

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed: an illegal memory access was encountered")

    def set_device(self, index: int) -> None:
        self._call("set_device")

    def event(self) -> int:
        self._call("event")
        self.events += 1
        return self.events

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("copy")

    def record(self, event: int, stream: int) -> None:
        self._call("record")

    def synchronize_stream(self, stream: int) -> None:
        self._call("synchronize_stream")

    def done(self, event: int) -> bool:
        self._call("done")
        return self.ends


@pytest.mark.parametrize(
    ("fail", "calls"),
    [
        (None, ["set_device", "event", "copy", "record"]),
        ("event", ["set_device", "event"]),  # nothing queued: nothing to wait for
        ("copy", ["set_device", "event", "copy"]),  # refused: nothing queued
        ("record", ["set_device", "event", "copy", "record", "synchronize_stream"]),
    ],
)
def test_a_copy_is_never_left_queued_without_its_completion(
    fail: str | None, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event is taken before the copy is queued, and a copy queued whose event could not be recorded is
    waited for on its stream: the consumer READs into the same slot next and gives it back if that fails."""
    runtime = RecordingRuntime(fail)
    monkeypatch.setattr(CudaRuntime, "loaded", classmethod(lambda cls: runtime))
    events = EventPool(runtime)  # type: ignore[arg-type]
    arena = IpcArena(exported(), torch.empty(0, dtype=torch.uint8), stream=7, events=events)
    same = SameGpu(SimpleNamespace(config=DataPlaneConfig(same_gpu_copy=True)))  # type: ignore[arg-type]
    slots: Any = {DeviceKind.CUDA: SimpleNamespace(device_id=0, address=1 << 20, nbytes=8192)}
    ref = vram_ref(4096, VRAM_ARENA.address + 8192)
    if fail is None:
        launched = same.launch(ref, arena, slots)
        assert launched.regions == frozenset({0}) and launched.done._event == 1
    else:
        with pytest.raises(TransferError, match=f"same-GPU copy failed: {fail} failed"):
            same.launch(ref, arena, slots)
        if fail != "event":
            assert events.take() == 1  # the event went back to its pool
    assert runtime.calls == calls


@pytest.mark.parametrize("ends", [True, False])
def test_a_warm_up_copy_that_does_not_end_keeps_its_slot_and_its_arena(
    ends: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first copy from a newly mapped arena: once it ended, its slot goes back; if it did not end in time,
    the slot stays taken and the arena stays mapped (it may still be read), and the peer is READ."""
    runtime = RecordingRuntime(ends=ends)
    monkeypatch.setattr(CudaRuntime, "loaded", classmethod(lambda cls: runtime))
    monkeypatch.setattr(peers_module, "WARM_TIMEOUT_S", 0.01)
    pool = MemoryPool(DeviceKind.CPU, 1 << 16, device=torch.device("cpu"), registrar=None)  # our CUDA pool's part
    try:
        endpoint = SimpleNamespace(pools=SimpleNamespace(pools={DeviceKind.CUDA: pool}), redis=aioredis.Redis())
        peers = Peers(endpoint)  # type: ignore[arg-type]  # a client never connected: no Redis call here
        arena = IpcArena(exported(), torch.empty(0, dtype=torch.uint8), stream=7, events=EventPool(runtime))  # type: ignore[arg-type]
        if ends:
            peers._warm_copy(arena)
            assert pool.slots_in_use == 0 and peers._stranded == []
        else:
            with pytest.raises(HandshakeError, match="did not end"):
                peers._warm_copy(arena)
            assert pool.slots_in_use == 1 and peers._stranded == [arena]
        assert runtime.calls[:4] == ["set_device", "event", "copy", "record"]
    finally:
        pool.close()
