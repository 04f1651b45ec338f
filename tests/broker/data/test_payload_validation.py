"""Manifest and descriptor validation: every corruption a hostile writer could send is refused, typed,
before any slot is taken or native call made."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from stageferry.broker.data import payload_validation
from stageferry.broker.data.payload_codec import unpack
from stageferry.broker.data.payload_plan import plan_payload
from stageferry.broker.data.payload_validation import (
    STRUCTURE_CACHE_SIZE,
    structure_key,
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
    RemoteRegion,
    TensorSpec,
)

GiB = 1 << 30


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
    "overflowing_dims": (lambda m: with_tensor(m, 0, shape=[2**40] * 2), "shape x itemsize"),
    "negative_dim": (lambda m: with_tensor(m, 0, shape=[-2, -4]), "dimension out of range"),
    "empty_with_huge_strides": (lambda m: with_tensor(m, 0, shape=[0, 2**40, 2**40], nbytes=0), "strides overflow"),
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


# -- the structure cache: only a manifest equal to one that passed skips the checks ------------------------


def counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[Manifest]:
    checked: list[Manifest] = []
    real = payload_validation._check_structure

    def counting(m: Manifest) -> None:
        checked.append(m)
        real(m)

    monkeypatch.setattr(payload_validation, "_check_structure", counting)
    return checked


TYPE_TWINS: dict[str, Callable[[Manifest], Manifest]] = {
    "float_dim": lambda m: with_tensor(m, 0, shape=[2.0, 4]),
    "bool_dim": lambda m: with_tensor(m, 0, shape=[True, 4]),
    "float_offset": lambda m: with_tensor(m, 1, offset=64.0),
    "float_index": lambda m: with_tree(m, {"d": [["text", {"t": 0.0}], *m.tree["d"][1:]]}),
    "bool_index": lambda m: with_tree(m, {"d": [["text", {"t": True}], *m.tree["d"][1:]]}),
}


def test_a_manifest_equal_to_a_checked_one_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    payload_validation._checked.clear()
    checked = counted_checks(monkeypatch)
    m = base_manifest()
    wire = m.model_dump_json()
    for _ in range(3):  # as a consumer receives it: a fresh object from the same JSON each time
        validate_manifest(Manifest.model_validate_json(wire), max_payload_bytes=GiB)
    assert len(checked) == 1
    with pytest.raises(ManifestError, match="larger than this deployment accepts"):
        validate_manifest(Manifest.model_validate_json(wire), max_payload_bytes=191)  # the cap: every time


@pytest.mark.parametrize("corrupt", [*MANIFEST_CORRUPTIONS, *TYPE_TWINS])
def test_a_manifest_near_a_checked_one_is_checked_in_full(corrupt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """1, 1.0 and True differ; every corruption of a remembered manifest is still refused."""
    m = base_manifest()
    validate_manifest(m, max_payload_bytes=GiB)
    mutate = MANIFEST_CORRUPTIONS[corrupt][0] if corrupt in MANIFEST_CORRUPTIONS else TYPE_TWINS[corrupt]
    bad = mutate(m)
    assert structure_key(bad) != structure_key(m)
    checked = counted_checks(monkeypatch)
    with pytest.raises(ManifestError):
        validate_manifest(bad, max_payload_bytes=GiB)
    assert checked == [bad]


def test_the_structure_cache_is_bounded_and_skips_large_manifests(monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(STRUCTURE_CACHE_SIZE + 5):
        validate_manifest(plan_payload({"x": torch.zeros(i + 1)}).manifest, max_payload_bytes=GiB)
    assert len(payload_validation._checked) <= STRUCTURE_CACHE_SIZE
    large = plan_payload({f"k{i}": "x" * 4000 for i in range(5)}).manifest  # a key over MAX_KEY_BYTES
    assert structure_key(large) is None
    checked = counted_checks(monkeypatch)
    validate_manifest(large, max_payload_bytes=GiB)
    validate_manifest(large, max_payload_bytes=GiB)
    assert len(checked) == 2
    assert structure_key(with_tree(large, {"v": object()})) is None  # not encodable: checked every time


def test_the_manifest_just_checked_is_not_keyed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get validates its manifest, then unpacks by it: the second look at the same object is free."""
    m = Manifest.model_validate_json(base_manifest().model_dump_json())
    keyed: list[Manifest] = []
    real = payload_validation.structure_key

    def counting(manifest: Manifest) -> bytes | None:
        keyed.append(manifest)
        return real(manifest)

    monkeypatch.setattr(payload_validation, "structure_key", counting)
    key = payload_validation.checked_key(m)
    assert payload_validation.checked_key(m) == key and keyed == [m]
    twin = Manifest.model_validate_json(m.model_dump_json())  # equal, another object: keyed, not checked
    assert payload_validation.checked_key(twin) == key and keyed == [m, twin]
