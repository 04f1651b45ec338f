"""Payload planning: what may travel, how it is laid out, and what is refused before any byte is packed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from stageferry.broker.data import payload_plan
from stageferry.broker.data.payload_codec import unpack
from stageferry.broker.data.payload_plan import plan_payload
from stageferry.errors import ManifestError
from stageferry.schemas.payload import (
    MAX_TREE_DEPTH,
)
from stageferry.testing import assert_same

CUDA = torch.cuda.is_available()


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


def test_a_payload_shape_is_planned_once_and_its_manifest_reused() -> None:
    """Same tree, dtypes and shapes: the manifest built for the first put is reused (same object); any
    difference — a shape, a dtype, a plain value, the alignment — gets a manifest of its own."""

    def payload(n: int, steps: int = 2, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        return {"text": torch.randn(n, 8).to(dtype), "meta": {"steps": steps, "name": "t2va"}}

    first, again = plan_payload(payload(4)), plan_payload(payload(4))
    assert again.manifest is first.manifest
    assert again.tensors[0] is not first.tensors[0]  # the plan still holds this put's own tensors
    for other in (
        plan_payload(payload(5)),
        plan_payload(payload(4, steps=3)),
        plan_payload(payload(4, dtype=torch.bfloat16)),
        plan_payload(payload(4), alignment=256),
    ):
        assert other.manifest is not first.manifest
    p = payload(4, steps=3)
    assert_same(unpack(plan_payload(p).manifest, _packed(p), copy=True), p)
    for i in range(payload_plan.PLAN_CACHE_SIZE + 5):  # bounded
        plan_payload({"x": torch.zeros(i + 1)})
    assert len(payload_plan._manifests) <= payload_plan.PLAN_CACHE_SIZE


def _packed(payload: Any) -> dict[Any, torch.Tensor]:
    from stageferry.broker.data.payload_codec import pack_into

    plan = plan_payload(payload)
    regions = {r.device: torch.empty(r.nbytes, dtype=torch.uint8) for r in plan.manifest.regions}
    pack_into(plan, regions)
    return regions


def test_a_refusal_names_where_the_value_sits() -> None:
    with pytest.raises(ManifestError) as info:
        plan_payload({"a": [1, {"b": object()}]})
    assert info.value.details["path"] == "$.a[1].b"
    with pytest.raises(ManifestError) as info:
        plan_payload({"s": ["ok", "lone \udc80 surrogate"]})
    assert info.value.details["path"] == "$.s[1]"


def test_payloads_that_differ_only_in_plain_types_or_order_get_their_own_manifests() -> None:
    """The plan cache's key keeps 1, 1.0 and True (and dict order, and list vs tuple) apart."""
    t = torch.ones(2)
    variants: list[Any] = [
        {"x": t, "n": 1},
        {"x": t, "n": True},
        {"x": t, "n": 1.0},
        {"x": t, "n": "1"},
        {"n": 1, "x": t},
        {"x": t, "n": [1, [2]]},
        {"x": t, "n": (1, [2])},
        {"x": t, "n": [1, (2,)]},
        {"x": t, "n": [[1], 2]},
    ]
    wires = [plan_payload(v).manifest.model_dump_json() for v in variants]
    assert len(set(wires)) == len(variants)
    for v in variants:  # and each comes back as itself, plain types included
        assert_same(unpack(plan_payload(v).manifest, _packed(v), copy=False), v)


def test_a_payload_with_long_plain_values_is_planned_but_not_kept() -> None:
    before = len(payload_plan._manifests)
    payload = {f"k{i}": "x" * 4000 for i in range(5)}  # its key is longer than MAX_KEY_BYTES
    first, again = plan_payload(payload), plan_payload(payload)
    assert first.manifest == again.manifest and first.manifest is not again.manifest
    assert len(payload_plan._manifests) == before


@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 4), (1, 64, 0), (2, 3, 4, 5), (0, 16, 1, 96, 168)])
def test_leaves_carry_torchs_contiguous_strides(shape: tuple[int, ...]) -> None:
    """A leaf's strides are those of a contiguous tensor of its shape, empty dimensions included."""
    plan = plan_payload({"x": torch.zeros(shape, dtype=torch.float16)})
    (leaf,) = plan.leaves
    assert leaf.shape == shape and leaf.strides == torch.empty(shape).stride()
    assert leaf.numel == math.prod(shape) and leaf.dtype is torch.float16 and leaf.bits is torch.int16
