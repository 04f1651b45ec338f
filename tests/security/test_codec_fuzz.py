"""Property-based fuzzing of the consumer-side checks, as pure functions (fast, many examples).

The property is the one that matters for memory safety: whatever a hostile manifest, descriptor list or
inline blob says, either the check raises :class:`ManifestError` (or the schema a ``ValidationError``),
or every byte the consumer would then touch lies inside the region (slot, blob, arena) it was given.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stageferry.broker.data.payload_codec import (
    ITEMSIZE,
    decode_inline,
    encode_inline,
    unpack,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.errors import ManifestError
from stageferry.schemas.payload import DeviceKind, DType, Manifest, MemKind, RemoteRegion
from stageferry.testing import tensors_of

CAP = 1 << 20
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Numbers a hostile writer would try: edges, negatives, powers of two, and far beyond int64.
hostile_ints = st.one_of(
    st.integers(-4, 512),
    st.sampled_from([-(2**63), 2**31, 2**32 - 1, 2**40, 2**40 + 1, 2**63 - 1, 2**64, 2**64 + 64, 10**30]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
junk = st.recursive(
    st.none() | st.booleans() | hostile_ints | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)
dtypes = st.sampled_from([d.value for d in DType]) | st.sampled_from(["complex64", "float8", "", "object"])
devices = st.sampled_from(["cpu", "cuda"]) | st.sampled_from(["tpu", "CPU", ""])


def small_or(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible small numbers, sometimes anything: so that some manifests get past the schema."""
    return st.one_of(st.integers(0, 4), st.integers(0, 4).map(lambda n: n * 64), values)


tensor_specs = st.fixed_dictionaries(
    {
        "dtype": dtypes,
        "shape": st.lists(small_or(hostile_ints), max_size=10) | junk,
        "device": devices,
        "region": small_or(hostile_ints),
        "offset": small_or(hostile_ints),
        "nbytes": small_or(hostile_ints),
    }
)
trees = st.recursive(
    st.builds(lambda i: {"t": i}, small_or(hostile_ints)) | st.builds(lambda v: {"v": v}, junk) | junk,
    lambda inner: st.one_of(
        st.builds(lambda xs: {"l": xs}, st.lists(inner, max_size=4)),
        st.builds(lambda xs: {"u": xs}, st.lists(inner, max_size=4)),
        st.builds(lambda xs: {"d": xs}, st.lists(st.tuples(st.text(max_size=3) | junk, inner).map(list), max_size=3)),
    ),
    max_leaves=10,
)
manifests = st.fixed_dictionaries(
    {
        "tree": trees,
        "tensors": st.lists(tensor_specs, max_size=5),
        "regions": st.lists(
            st.fixed_dictionaries({"device": devices, "nbytes": small_or(hostile_ints).map(lambda n: n)}), max_size=3
        ),
    }
)


def parse(raw: Any) -> Manifest | None:
    """The manifest as a consumer gets it: from JSON through the schema (None if the schema refuses)."""
    try:
        return Manifest.model_validate_json(json.dumps(raw))
    except (ValidationError, ValueError):
        return None


def assert_layout_is_safe(m: Manifest) -> None:
    """What acceptance promises: every tensor lies inside its region, sizes agree, nothing overlaps."""
    sizes = {r.device: r.nbytes for r in m.regions}
    assert len(sizes) == len(m.regions)
    spans: list[tuple[int, int, int]] = []
    for t in m.tensors:
        region = m.regions[t.region]
        assert region.device == t.device
        assert t.nbytes == math.prod(t.shape) * ITEMSIZE[t.dtype]
        assert t.offset >= 0 and t.offset + t.nbytes <= region.nbytes
        if t.nbytes:
            spans.append((t.region, t.offset, t.offset + t.nbytes))
    spans.sort()
    for (r0, _, end0), (r1, start1, _) in itertools.pairwise(spans):
        assert r0 != r1 or start1 >= end0
    assert m.total_bytes <= CAP


@FUZZ
@given(raw=manifests)
def test_hostile_manifests_are_rejected_or_stay_inside_their_regions(raw: dict[str, Any]) -> None:
    manifest = parse(raw)
    if manifest is None:
        return
    try:
        validate_manifest(manifest, max_payload_bytes=CAP)
    except ManifestError as exc:
        assert exc.code == "invalid_manifest" and exc.message
        return
    assert_layout_is_safe(manifest)
    if any(r.device is DeviceKind.CUDA for r in manifest.regions):
        return  # no GPU here: the layout property above is what the GPU path relies on too
    # Unpack into a buffer with guard bytes on both sides: views must stay inside, the guards untouched.
    guard = 64
    size = manifest.regions[0].nbytes if manifest.regions else 0
    backing = torch.full((size + 2 * guard,), 0xA5, dtype=torch.uint8)
    slot = backing[guard : guard + size]
    payload = unpack(manifest, {DeviceKind.CPU: slot}, copy=False) if manifest.regions else None
    for leaf in tensors_of(payload):
        if leaf.numel():
            start = leaf.data_ptr()
            end = start + leaf.numel() * leaf.element_size()
            assert slot.data_ptr() <= start and end <= slot.data_ptr() + size
    assert bool((backing[:guard] == 0xA5).all()) and bool((backing[guard + size :] == 0xA5).all())


GOOD_PAYLOAD = {"text": torch.arange(48, dtype=torch.float32).view(4, 12), "ids": torch.arange(5), "n": 2}


@FUZZ
@given(
    tensor=st.integers(0, 1),
    field=st.sampled_from(["dtype", "shape", "offset", "nbytes", "region", "device"]),
    value=hostile_ints | dtypes | st.lists(hostile_ints, max_size=4),
    cut=st.integers(-300, 300),
)
def test_mutated_inline_blobs_are_rejected_or_decode_within_the_blob(
    tensor: int, field: str, value: Any, cut: int
) -> None:
    """Near-valid inline payloads: one manifest field changed, the blob truncated or padded."""
    manifest, blob = encode_inline(GOOD_PAYLOAD)
    raw = manifest.model_dump(mode="json")
    raw["tensors"][tensor][field] = value
    bad_blob = blob[:cut] if cut < 0 else blob + bytes(cut)
    parsed = parse(raw)
    if parsed is None:
        return
    try:
        validate_manifest(parsed, max_payload_bytes=CAP)
        got = decode_inline(parsed, bad_blob, cuda_device=None)
    except ManifestError as exc:
        assert exc.code == "invalid_manifest"
        return
    assert len(bad_blob) == parsed.total_bytes  # decoded only when the blob is exactly what it says
    assert_layout_is_safe(parsed)
    assert isinstance(got, dict)


addresses = st.one_of(
    st.integers(0x10000 - 256, 0x10000 + 8192), st.sampled_from([0, -1, 2**64 - 64, 2**64, 2**70]), hostile_ints
)
remote_regions = st.fixed_dictionaries(
    {
        "mem_kind": st.sampled_from(["DRAM", "VRAM"]) | st.sampled_from(["HBM", ""]),
        "address": addresses,
        "length": small_or(hostile_ints) | st.just(192),
        "device_id": st.integers(-1, 2) | hostile_ints,
    }
)
ARENAS = [
    RemoteRegion(mem_kind=MemKind.DRAM, address=0x10000, length=4096, device_id=0),
    RemoteRegion(mem_kind=MemKind.VRAM, address=0x10000, length=4096, device_id=1),
]


@FUZZ
@given(raws=st.lists(remote_regions, max_size=3))
def test_hostile_descriptors_are_rejected_or_lie_inside_an_advertised_arena(raws: list[dict[str, Any]]) -> None:
    manifest, _ = encode_inline(GOOD_PAYLOAD)  # one CPU region
    try:
        regions = [RemoteRegion.model_validate_json(json.dumps(r)) for r in raws]
    except ValidationError:
        return
    try:
        validate_remote_regions(manifest, regions, ARENAS)
    except ManifestError as exc:
        assert exc.code == "invalid_manifest"
        return
    assert len(regions) == len(manifest.regions)
    for r, spec in zip(regions, manifest.regions, strict=True):
        assert r.length == spec.nbytes
        assert any(
            a.mem_kind == r.mem_kind
            and a.device_id == r.device_id
            and a.address <= r.address
            and r.address + r.length <= a.address + a.length
            for a in ARENAS
        )
