"""Payload codec: bit-exact round trips (pool buffers and inline) and rejection of corrupted manifests."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from stageferry.broker.data import payload_codec
from stageferry.broker.data.payload_codec import (
    TORCH_DTYPE,
    Span,
    TypedViews,
    decode_inline,
    encode_inline,
    pack_into,
    plan_payload,
    unpack,
    validate_manifest,
)
from stageferry.broker.data.pool import MemoryPool, PoolSet
from stageferry.errors import ManifestError
from stageferry.schemas.payload import (
    MAX_TREE_DEPTH,
    DeviceKind,
    Manifest,
    RegionSpec,
    TensorSpec,
)
from stageferry.testing import HIDDEN, TASKS, assert_same, bits, randn, tensor_bytes, tensors_of
from tests.broker.data.test_payload_validation import with_tensor
from tests.torch_ops import TorchOps

GiB = 1 << 30
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU")


# -- helpers ----------------------------------------------------------------------------------------------


def over_the_wire(manifest: Manifest) -> Manifest:
    """What the consumer sees: the manifest re-parsed from the envelope's JSON."""
    return Manifest.model_validate_json(manifest.model_dump_json())


@pytest.fixture(scope="module", params=list(TASKS))
def task_payload(request: pytest.FixtureRequest) -> Any:
    build, total = TASKS[request.param]
    payload = build()
    assert tensor_bytes(payload) == total
    return payload


def region_buffers(manifest: Manifest, device: torch.device | None = None) -> dict[DeviceKind, torch.Tensor]:
    """Stand-ins for pool slot views, one per region (CUDA regions on ``device``)."""
    return {
        r.device: torch.empty(r.nbytes, dtype=torch.uint8, device=device if r.device is DeviceKind.CUDA else "cpu")
        for r in manifest.regions
    }


def inside(t: torch.Tensor, buf: torch.Tensor) -> bool:
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    return start <= t.data_ptr() < end


# -- round trips ------------------------------------------------------------------------------------------


def test_task_totals_and_layout(task_payload: Any) -> None:
    plan = plan_payload(task_payload)
    m = plan.manifest
    assert sum(t.nbytes for t in m.tensors) == tensor_bytes(task_payload)
    assert [r.device for r in m.regions] == [DeviceKind.CPU]
    assert all(t.offset % 64 == 0 for t in m.tensors)
    assert m.total_bytes % 64 == 0 and m.total_bytes - tensor_bytes(task_payload) < 64 * len(m.tensors)
    validate_manifest(over_the_wire(m), max_payload_bytes=GiB)


@pytest.mark.parametrize("copy", [False, True], ids=["zero_copy", "copy"])
def test_task_round_trip_through_buffers(task_payload: Any, copy: bool) -> None:
    plan = plan_payload(task_payload)
    buffers = region_buffers(plan.manifest)
    pack_into(plan, buffers)
    manifest = over_the_wire(plan.manifest)
    validate_manifest(manifest, max_payload_bytes=GiB)
    got = unpack(manifest, buffers, copy=copy)
    assert_same(got, task_payload)
    buf = buffers[DeviceKind.CPU]
    for t in tensors_of(got):
        if t.numel():
            assert inside(t, buf) is not copy
    if copy:  # owned clones survive the buffer being reused
        before = got["text"]["hidden_states"].clone()
        buf.fill_(0xAB)
        assert torch.equal(bits(got["text"]["hidden_states"]), bits(before))


@pytest.mark.parametrize("as_type", [bytes, bytearray], ids=["bytes", "bytearray"])
def test_task_round_trip_inline(task_payload: Any, as_type: type) -> None:
    manifest, blob = encode_inline(task_payload)
    assert isinstance(blob, bytes) and len(blob) == manifest.total_bytes
    source = as_type(blob)
    got = decode_inline(over_the_wire(manifest), source, cuda_device=None)
    assert_same(got, task_payload)
    hidden = got["text"]["hidden_states"]
    if as_type is bytearray:  # zero-copy: the payload shares the writable blob
        source[0] ^= 0xFF
        assert not torch.equal(bits(hidden), bits(task_payload["text"]["hidden_states"]))
    else:  # an immutable bytes object is never written through
        hidden.zero_()
        assert bytes(source) == blob


def test_scalars_empty_and_odd_dtypes_round_trip() -> None:
    payload = {
        "scalar_bf16": torch.tensor(1.5, dtype=torch.bfloat16),
        "nan_bits": torch.tensor([0x7FC1, -1, -(2**15)], dtype=torch.int16).view(torch.float16),
        "f64": torch.tensor([math.pi, -0.0, float("inf")], dtype=torch.float64),
        "mask": torch.tensor([[True, False], [False, True]]).t(),
        "small": [
            torch.tensor([-128, 127], dtype=torch.int8),
            torch.tensor([255], dtype=torch.uint8),
            torch.tensor([-(2**31)], dtype=torch.int32),
            torch.tensor([7], dtype=torch.int16),
        ],
        "empty": (torch.empty(0), torch.empty(3, 0, dtype=torch.int64)),
        "grad": torch.ones(3, requires_grad=True) * 2,
        "values": [0, -1, 2**63 - 1, 1e-300, -0.0, "", "ünïcode ✓", None, False],
    }
    manifest, blob = encode_inline(payload)
    assert_same(decode_inline(over_the_wire(manifest), blob, cuda_device=None), payload)


def test_only_empty_tensors_and_no_tensors() -> None:
    for payload in ({"e": torch.empty(0, 5)}, {"a": [1, "x"]}, None, 3.0):
        manifest, blob = encode_inline(payload)
        assert blob == b"" and manifest.total_bytes == 0
        assert_same(decode_inline(over_the_wire(manifest), blob, cuda_device=None), payload)


def test_buffer_contract() -> None:
    plan = plan_payload({"x": torch.ones(16)})
    with pytest.raises(ValueError, match="no buffer"):
        pack_into(plan, {})
    with pytest.raises(ValueError, match="holds"):
        pack_into(plan, {DeviceKind.CPU: torch.empty(8, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="uint8"):
        unpack(plan.manifest, {DeviceKind.CPU: torch.empty(64)}, copy=False)


# -- hypothesis: random nested payloads -------------------------------------------------------------------


@st.composite
def random_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(list(TORCH_DTYPE.values())))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    raw = bytearray(draw(st.binary(min_size=n, max_size=n)))
    if dtype == torch.bool:
        raw = bytearray(b & 1 for b in raw)
    t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)
    return t


plain_values = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63) + 1, 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
payloads = st.recursive(
    random_tensors() | plain_values,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=16,
)


def depth(obj: Any) -> int:
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return 1 + max((depth(v) for v in obj), default=0)
    return 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=payloads, copy=st.booleans())
def test_random_payloads_round_trip(payload: Any, copy: bool) -> None:
    assume(depth(payload) <= MAX_TREE_DEPTH)
    plan = plan_payload(payload)
    buffers = region_buffers(plan.manifest)
    pack_into(plan, buffers)
    manifest = over_the_wire(plan.manifest)
    validate_manifest(manifest, max_payload_bytes=GiB)
    assert_same(unpack(manifest, buffers, copy=copy), payload)
    inline_manifest, blob = encode_inline(payload)
    assert_same(decode_inline(over_the_wire(inline_manifest), blob, cuda_device=None), payload)


# -- inline blob ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [-1, 1, -192], ids=["truncated", "extra_byte", "empty"])
def test_inline_blob_size_mismatch_rejected(cut: int) -> None:
    manifest, blob = encode_inline({"x": torch.ones(40)})
    bad = blob[:cut] if cut < 0 else blob + b"\0" * cut
    with pytest.raises(ManifestError, match="blob size"):
        decode_inline(manifest, bad, cuda_device=None)


def test_inline_corrupted_manifest_rejected_before_copy() -> None:
    manifest, blob = encode_inline({"x": torch.ones(40), "y": torch.ones(4)})
    bad = with_tensor(manifest, 1, offset=0)
    with pytest.raises(ManifestError, match="overlap"):
        decode_inline(bad, blob, cuda_device=None)


def test_inline_cuda_leaf_without_gpu_rejected() -> None:
    manifest = Manifest(
        tree={"t": 0},
        tensors=[TensorSpec(dtype="float32", shape=[4], device="cuda", region=0, offset=0, nbytes=16)],
        regions=[RegionSpec(device="cuda", nbytes=64)],
    )
    with pytest.raises(ManifestError, match="no GPU"):
        decode_inline(manifest, bytes(64), cuda_device=None)


def test_inline_misaligned_region_start_is_copied() -> None:
    """A hostile but valid layout: the second region starts at an odd blob offset; views must still work."""
    manifest = Manifest(
        tree={"l": [{"t": 0}, {"t": 1}]},
        tensors=[
            TensorSpec(dtype="uint8", shape=[3], device="cuda", region=0, offset=0, nbytes=3),
            TensorSpec(dtype="float64", shape=[1], device="cpu", region=1, offset=0, nbytes=8),
        ],
        regions=[RegionSpec(device="cuda", nbytes=3), RegionSpec(device="cpu", nbytes=8)],
    )
    validate_manifest(manifest, max_payload_bytes=GiB)
    if not CUDA:
        pytest.skip("the CUDA region needs a GPU")
    blob = bytes([1, 2, 3]) + torch.tensor([2.5], dtype=torch.float64).view(torch.uint8).numpy().tobytes()
    got = decode_inline(manifest, bytearray(blob), cuda_device=torch.device("cuda", 0))
    assert got[0].tolist() == [1, 2, 3] and got[1].item() == 2.5


# -- CUDA leaves ------------------------------------------------------------------------------------------


def cuda_payload() -> Any:
    dev = torch.device("cuda", 0)
    return {
        "text": randn(7, HIDDEN, dtype=torch.bfloat16).to(dev),
        "ids": torch.arange(7, device=dev),
        "lat": randn(4, 6).t().to(dev),
        "cpu_side": torch.arange(5, dtype=torch.int32),
        "empty": torch.empty(0, device=dev),
        "n": 3,
    }


@needs_cuda
@pytest.mark.parametrize("copy", [False, True], ids=["zero_copy", "copy"])
def test_cuda_leaves_through_gpu_buffers(copy: bool) -> None:
    payload = cuda_payload()
    plan = plan_payload(payload)
    assert [r.device for r in plan.manifest.regions] == [DeviceKind.CPU, DeviceKind.CUDA]
    buffers = region_buffers(plan.manifest, torch.device("cuda", 0))
    pack_into(plan, buffers)
    got = unpack(over_the_wire(plan.manifest), buffers, copy=copy)
    assert_same(got, payload)
    assert got["text"].is_cuda and not got["cpu_side"].is_cuda and got["empty"].is_cuda
    assert inside(got["text"], buffers[DeviceKind.CUDA]) is not copy


@needs_cuda
def test_cuda_leaves_inline() -> None:
    payload = cuda_payload()
    manifest, blob = encode_inline(payload)
    assert manifest.tensors[0].device is DeviceKind.CUDA
    got = decode_inline(over_the_wire(manifest), blob, cuda_device=torch.device("cuda", 0))
    assert_same(got, payload)
    assert got["lat"].device == torch.device("cuda", 0)


def test_a_view_never_reaches_past_its_buffer() -> None:
    """Views are ``as_strided`` over the whole arena; each is checked against its own span first, whether
    the region's buffer is a tensor (a slice of the arena) or a :class:`Span` of it."""
    plan = plan_payload({"x": torch.arange(16, dtype=torch.int32)})
    arena = TypedViews(torch.zeros(1024, dtype=torch.uint8))
    for buffer in (arena.tensor[256:320], Span(arena, 256, 64)):  # exactly the region: 64 bytes
        arena.tensor.zero_()
        pack_into(plan, {DeviceKind.CPU: buffer})
        assert torch.equal(
            unpack(plan.manifest, {DeviceKind.CPU: buffer}, copy=False)["x"], torch.arange(16, dtype=torch.int32)
        )
        assert not arena.tensor[:256].any() and not arena.tensor[320:].any()
        spans = payload_codec._spans(plan.manifest, {DeviceKind.CPU: buffer})
        beyond = plan.leaves[0]._replace(start=1)  # one element past the slot's end
        with pytest.raises(ManifestError, match="beyond its buffer"):
            payload_codec._views([beyond], spans, bits=False)


def test_a_span_is_checked_like_a_tensor() -> None:
    plan = plan_payload({"x": torch.arange(16, dtype=torch.int32)})
    arena = TypedViews(torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(ValueError, match="holds 60 bytes"):
        unpack(plan.manifest, {DeviceKind.CPU: Span(arena, 256, 60)}, copy=False)
    with pytest.raises(ValueError, match="cannot hold"):  # int32 elements at a byte offset of 2
        unpack(plan.manifest, {DeviceKind.CPU: Span(arena, 258, 64)}, copy=False)
    with pytest.raises(ValueError, match="uint8"):
        TypedViews(torch.zeros(16))


def _unpack_over_pool_slots(payload: Any, devices: dict[DeviceKind, torch.device], copy: bool) -> None:
    """Pack ``payload`` into slots of pools on ``devices`` and unpack it over their spans: one ``as_strided``
    per tensor and no other torch op; with ``copy`` each then cloned, so none keeps an arena alive."""
    plan = plan_payload(payload)
    size = plan.manifest.total_bytes + (1 << 16)
    pools = PoolSet({kind: MemoryPool(kind, size, device=device, registrar=None) for kind, device in devices.items()})
    slots = pools.take_regions_now(plan.manifest)
    assert slots is not None
    spans = {kind: slot.span for kind, slot in slots.items()}
    pack_into(plan, spans)
    manifest = over_the_wire(plan.manifest)
    validate_manifest(manifest, max_payload_bytes=GiB)
    with TorchOps() as ops:
        got = unpack(manifest, spans, copy=copy)
    n = len(manifest.tensors)
    assert ops.names[:n] == ["aten.as_strided.default"] * n
    assert len(ops.names) == (2 * n if copy else n)  # clone: its own ops, one tensor each
    assert_same(got, payload)
    arenas = {pool.buffer.untyped_storage().data_ptr() for pool in pools.pools.values()}
    for t in tensors_of(got):
        assert (t.untyped_storage().data_ptr() in arenas) is not copy
    pools.release_all(slots)


@pytest.mark.parametrize("copy", [False, True], ids=["zero_copy", "copy"])
def test_views_over_a_pool_slot_are_one_as_strided_each(task_payload: Any, copy: bool) -> None:
    """Over a pool slot's :class:`Span` a payload's tensors, empty ones too, are made with one ``as_strided``
    each (the pool made its arena's dtype views when it was created)."""
    payload = {"task": task_payload, "empty": torch.empty(3, 0, dtype=torch.int64)}
    _unpack_over_pool_slots(payload, {DeviceKind.CPU: torch.device("cpu")}, copy)


@needs_cuda
@pytest.mark.parametrize("copy", [False, True], ids=["zero_copy", "copy"])
def test_views_over_cuda_and_host_slots_are_one_as_strided_each(copy: bool) -> None:
    """The same-GPU plan's shape: bf16 states and an empty latent in a CUDA slot, the layout in a host one."""
    cuda = torch.device("cuda", 0)
    payload = {
        "hidden_states": randn(35, 64, dtype=torch.bfloat16).to(cuda),
        "audio_latents": torch.zeros(1, 64, 0, device=cuda),
        "layout": torch.arange(11),
    }
    _unpack_over_pool_slots(payload, {DeviceKind.CPU: torch.device("cpu"), DeviceKind.CUDA: cuda}, copy)
