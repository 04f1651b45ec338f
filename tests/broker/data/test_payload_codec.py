"""Payload codec: bit-exact round trips (pool buffers and inline) and rejection of corrupted manifests."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stageferry.broker.data.payload_codec import (
    TORCH_DTYPE,
    decode_inline,
    encode_inline,
    pack_into,
    plan_payload,
    unpack,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.errors import ManifestError
from stageferry.schemas.payload import (
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    DeviceKind,
    Manifest,
    MemKind,
    RegionSpec,
    RemoteRegion,
    TensorSpec,
)
from stageferry.testing import HIDDEN, TASKS, assert_same, bits, randn, tensor_bytes, tensors_of

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


def test_alignment_option() -> None:
    plan = plan_payload([torch.ones(3), torch.ones(5)], alignment=256)
    assert [t.offset for t in plan.manifest.tensors] == [0, 256]
    with pytest.raises(ValueError):
        plan_payload([], alignment=48)


@pytest.mark.parametrize(
    "payload, match",
    [
        ({"c": torch.ones(2, dtype=torch.complex64)}, "dtype"),
        ({"u": torch.ones(2, dtype=torch.uint16)}, "dtype"),
        ({"b": b"raw bytes"}, "unsupported value type"),
        ({"o": object()}, "unsupported value type"),
        ({1: torch.ones(1)}, "keys must be str"),
        ({"n": float("nan")}, "non-finite"),
        ({"i": 2**64}, "int64"),
        ({"s": "x" * 5000}, "too long"),
        ({"s": torch.ones(4).to_sparse()}, "strided"),
    ],
    ids=["complex", "uint16", "bytes", "object", "int_key", "nan", "big_int", "long_str", "sparse"],
)
def test_plan_rejects_what_cannot_travel(payload: Any, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        plan_payload(payload)


def test_plan_rejects_deep_and_cyclic_payloads() -> None:
    deep: Any = 1
    for _ in range(MAX_TREE_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ManifestError, match="deeply"):
        plan_payload(deep)
    ok: Any = 1
    for _ in range(MAX_TREE_DEPTH):
        ok = [ok]
    assert_same(unpack(plan_payload(ok).manifest, {}, copy=False), ok)
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(ManifestError):
        plan_payload(cyclic)


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


# -- corrupted manifests ----------------------------------------------------------------------------------


def base_manifest() -> Manifest:
    """text [2,4] bf16 @0, ids [3] int64 @64, latents [2,2] fp32 @128; one CPU region of 192 bytes."""
    payload = {
        "text": torch.ones(2, 4, dtype=torch.bfloat16),
        "ids": torch.arange(3),
        "lat": torch.zeros(2, 2),
        "meta": {"n": 1},
    }
    m = plan_payload(payload).manifest
    assert [t.offset for t in m.tensors] == [0, 64, 128] and m.regions[0].nbytes == 192
    return m


def with_tensor(m: Manifest, i: int, **changes: Any) -> Manifest:
    """Bypasses pydantic on purpose: the validator must not rely on the schema's bounds alone."""
    tensors = list(m.tensors)
    tensors[i] = TensorSpec.model_construct(**{**tensors[i].model_dump(), **changes})
    return m.model_copy(update={"tensors": tensors})


def with_tree(m: Manifest, tree: Any) -> Manifest:
    return m.model_copy(update={"tree": tree})


def nested(levels: int) -> Any:
    node: Any = {"l": [{"t": 0}, {"t": 1}, {"t": 2}]}
    for _ in range(levels - 1):
        node = {"l": [node]}
    return node


ALL_T = [{"t": 0}, {"t": 1}, {"t": 2}]
MANIFEST_CORRUPTIONS: dict[str, tuple[Callable[[Manifest], Manifest], str]] = {
    "nbytes_not_shape_x_itemsize": (lambda m: with_tensor(m, 0, nbytes=15), "shape x itemsize"),
    "offset_beyond_region": (lambda m: with_tensor(m, 2, offset=192), "beyond its region"),
    "misaligned_offset": (lambda m: with_tensor(m, 1, offset=65), "not aligned"),
    "negative_offset": (lambda m: with_tensor(m, 1, offset=-64), "offset out of range"),
    "huge_nbytes": (lambda m: with_tensor(m, 0, shape=[2**40, 2**4], nbytes=2**46), "nbytes out of range"),
    "overflowing_dims": (lambda m: with_tensor(m, 0, shape=[2**40] * 8), "shape x itemsize"),
    "negative_dim": (lambda m: with_tensor(m, 0, shape=[-2, -4]), "dimension out of range"),
    "too_many_dims": (lambda m: with_tensor(m, 2, shape=[1] * 9), "too many dimensions"),
    "unknown_dtype": (lambda m: with_tensor(m, 2, dtype="complex64"), "dtype"),
    "region_index_out_of_range": (lambda m: with_tensor(m, 0, region=1), "region that does not exist"),
    "region_kind_mismatch": (lambda m: with_tensor(m, 0, device=DeviceKind.CUDA), "does not match"),
    "duplicate_region_kinds": (
        lambda m: m.model_copy(update={"regions": [m.regions[0], m.regions[0]]}),
        "same device kind",
    ),
    "overlapping_tensors": (lambda m: with_tensor(m, 1, offset=0), "overlap"),
    "missing_tensor_index": (lambda m: with_tree(m, {"l": [*ALL_T, {"t": 3}]}), "does not exist"),
    "same_index_twice": (lambda m: with_tree(m, {"l": [*ALL_T, {"t": 0}]}), "twice"),
    "bool_as_index": (lambda m: with_tree(m, {"l": [{"t": True}, {"t": 1}, {"t": 2}]}), "does not exist"),
    "unreferenced_tensor": (lambda m: with_tree(m, {"l": ALL_T[:2]}), "not referenced"),
    "tree_too_deep": (lambda m: with_tree(m, nested(MAX_TREE_DEPTH + 1)), "too deeply"),
    "too_many_nodes": (lambda m: with_tree(m, {"l": [*ALL_T, *([{"v": 0}] * MAX_TREE_NODES)]}), "too many nodes"),
    "node_with_two_keys": (lambda m: with_tree(m, {"l": ALL_T, "v": 1}), "exactly one key"),
    "node_not_an_object": (lambda m: with_tree(m, [0, 1, 2]), "exactly one key"),
    "unknown_tag": (lambda m: with_tree(m, {"x": ALL_T}), "unknown tag"),
    "container_body_not_list": (lambda m: with_tree(m, {"l": {"t": 0}}), "must be a list"),
    "non_str_dict_key": (lambda m: with_tree(m, {"d": [[1, {"l": ALL_T}]]}), "not a string"),
    "duplicate_dict_key": (lambda m: with_tree(m, {"d": [["a", {"l": ALL_T}], ["a", {"v": 1}]]}), "duplicate dict key"),
    "malformed_dict_entry": (lambda m: with_tree(m, {"d": [["a"]]}), "malformed dict entry"),
    "forbidden_plain_value": (lambda m: with_tree(m, {"l": [*ALL_T, {"v": [1, 2]}]}), "forbidden type"),
    "nan_plain_value": (lambda m: with_tree(m, {"l": [*ALL_T, {"v": math.nan}]}), "not finite"),
    "huge_plain_int": (lambda m: with_tree(m, {"l": [*ALL_T, {"v": 2**70}]}), "int64"),
    "overlong_string": (lambda m: with_tree(m, {"l": [*ALL_T, {"v": "x" * 5000}]}), "too long"),
    "overlong_key": (lambda m: with_tree(m, {"d": [["k" * 5000, {"l": ALL_T}]]}), "key too long"),
}


@pytest.mark.parametrize("corrupt", list(MANIFEST_CORRUPTIONS), ids=list(MANIFEST_CORRUPTIONS))
def test_corrupted_manifest_rejected(corrupt: str) -> None:
    mutate, match = MANIFEST_CORRUPTIONS[corrupt]
    bad = mutate(base_manifest())
    with pytest.raises(ManifestError, match=match) as info:
        validate_manifest(bad, max_payload_bytes=GiB)
    assert info.value.code == "invalid_manifest"
    assert info.value.to_dict()["message"]
    # the consumer's other entry points refuse it too, before any copy
    with pytest.raises(ManifestError):
        unpack(bad, {DeviceKind.CPU: torch.zeros(256, dtype=torch.uint8)}, copy=False)


def test_payload_above_deployment_cap_rejected() -> None:
    m = base_manifest()
    validate_manifest(m, max_payload_bytes=192)
    with pytest.raises(ManifestError, match="larger than this deployment accepts") as info:
        validate_manifest(m, max_payload_bytes=191)
    assert info.value.details == {"nbytes": 192, "limit": 191}


RAW_JSON_CORRUPTIONS = {
    "unknown_dtype": ("tensors", 0, "dtype", "complex64"),
    "negative_nbytes": ("tensors", 0, "nbytes", -16),
    "huge_dim": ("tensors", 0, "shape", [2**41, 1]),
    "region_index_schema": ("tensors", 0, "region", 7),
    "negative_region_size": ("regions", 0, "nbytes", -1),
    "unknown_device": ("regions", 0, "device", "tpu"),
}


@pytest.mark.parametrize("corrupt", list(RAW_JSON_CORRUPTIONS), ids=list(RAW_JSON_CORRUPTIONS))
def test_corrupted_raw_json_rejected(corrupt: str) -> None:
    """From the wire: the schema (ValidationError) or the validator (ManifestError) must say no."""
    section, index, field, value = RAW_JSON_CORRUPTIONS[corrupt]
    raw = base_manifest().model_dump(mode="json")
    raw[section][index][field] = value
    with pytest.raises((ValidationError, ManifestError)):
        validate_manifest(Manifest.model_validate(raw), max_payload_bytes=GiB)


def test_extra_manifest_field_rejected() -> None:
    raw = base_manifest().model_dump(mode="json")
    raw["pickle"] = "gASV"
    with pytest.raises(ValidationError):
        Manifest.model_validate(raw)


# -- remote regions ---------------------------------------------------------------------------------------

ARENA = RemoteRegion(mem_kind=MemKind.DRAM, address=0x10000, length=4096, device_id=0)
GOOD = RemoteRegion(mem_kind=MemKind.DRAM, address=0x10000 + 256, length=192, device_id=0)


def region(**changes: Any) -> RemoteRegion:
    return RemoteRegion.model_construct(**{**GOOD.model_dump(), **changes})


REMOTE_CORRUPTIONS: dict[str, tuple[list[RemoteRegion], list[RemoteRegion], str]] = {
    "count_mismatch_none": ([], [ARENA], "count"),
    "count_mismatch_extra": ([GOOD, GOOD], [ARENA], "count"),
    "length_mismatch": ([region(length=191)], [ARENA], "length does not match"),
    "mem_kind_mismatch": (
        [region(mem_kind=MemKind.VRAM)],
        [ARENA, ARENA.model_copy(update={"mem_kind": MemKind.VRAM})],
        "memory kind",
    ),
    "outside_arena": ([region(address=0x20000)], [ARENA], "outside every advertised arena"),
    "straddles_arena_end": ([region(address=0x10000 + 4096 - 64)], [ARENA], "outside every"),
    "below_arena_start": ([region(address=0x10000 - 64)], [ARENA], "outside every"),
    "other_device": ([region(device_id=1)], [ARENA], "outside every"),
    "no_arenas": ([GOOD], [], "outside every"),
    "zero_address": ([region(address=0)], [ARENA], "out-of-range"),
    "negative_address": ([region(address=-4096)], [ARENA], "out-of-range"),
    "negative_length": ([region(length=-1)], [ARENA], "out-of-range"),
    "huge_length": ([region(length=2**62)], [ARENA], "out-of-range"),
    "address_wraps": ([region(address=2**64 - 64)], [ARENA], "out-of-range"),
    "negative_device": ([region(device_id=-1)], [ARENA], "out-of-range"),
}


@pytest.mark.parametrize("corrupt", list(REMOTE_CORRUPTIONS), ids=list(REMOTE_CORRUPTIONS))
def test_corrupted_remote_regions_rejected(corrupt: str) -> None:
    regions, arenas, match = REMOTE_CORRUPTIONS[corrupt]
    with pytest.raises(ManifestError, match=match):
        validate_remote_regions(base_manifest(), regions, arenas)


def test_good_remote_regions_accepted() -> None:
    validate_remote_regions(base_manifest(), [GOOD], [ARENA])
    edge = region(address=0x10000 + 4096 - 192)
    validate_remote_regions(base_manifest(), [edge], [ARENA])


def test_remote_region_schema_rejects_bad_json() -> None:
    for bad in ({"address": 0}, {"length": -1}, {"device_id": 5000}, {"mem_kind": "HBM"}):
        with pytest.raises(ValidationError):
            RemoteRegion.model_validate({**GOOD.model_dump(mode="json"), **bad})


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
