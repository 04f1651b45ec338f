"""Validation of payload manifests and NIXL descriptors: everything a consumer checks before it takes a
slot or posts a READ, and what a producer checks before it emits a manifest.

Who calls: the consumer (:func:`validate_manifest`, then :func:`validate_remote_regions` for NIXL
descriptors) before any native call; :mod:`.payload_plan` (every plan is checked before it is emitted);
:mod:`.payload_codec` (unpacking checks the structure again, cheaply).  Errors are
:class:`~stageferry.errors.ManifestError`, never anything from torch: the checks are pure Python over
Python ints, so hostile sizes cannot reach an allocator.  The dtype tables live here because the size
rules depend on them.

A stage sees the same few payload shapes over and over, so the structure checks remember (in a small
:class:`ShapeCache`) the manifests that passed them, by :func:`structure_key`: the manifest's whole
content in one byte string.  Only a manifest equal to one that passed is let through unchecked, and
the deployment's size cap is checked every time.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any, Generic, NoReturn, TypeVar

import msgpack
import torch

from stageferry.errors import ManifestError
from stageferry.schemas.payload import (
    MAX_DIM,
    MAX_NDIM,
    MAX_REGION_BYTES,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    MAX_TREE_NODES,
    MEM_KIND_OF,
    DeviceKind,
    DType,
    Manifest,
    RegionSpec,
    RemoteRegion,
    TensorSpec,
)

MANIFEST_ALIGNMENT = 64
"""Every tensor offset is a multiple of this (manifest version 1): any dtype can be viewed in place."""
MAX_STRING_CHARS = 4096
"""Longest plain string value or dict key; conditioning metadata, not documents."""
MAX_ADDRESS = 2**64
MAX_DEVICE_ID = 1024

TORCH_DTYPE: dict[DType, torch.dtype] = {
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.FLOAT32: torch.float32,
    DType.FLOAT64: torch.float64,
    DType.INT64: torch.int64,
    DType.INT32: torch.int32,
    DType.INT16: torch.int16,
    DType.INT8: torch.int8,
    DType.UINT8: torch.uint8,
    DType.BOOL: torch.bool,
}
DTYPE_OF: dict[torch.dtype, DType] = {v: k for k, v in TORCH_DTYPE.items()}
ITEMSIZE: dict[DType, int] = {k: v.itemsize for k, v in TORCH_DTYPE.items()}
MAX_INT = 2**63 - 1
"""Plain ints and a tensor's strides stay within int64 (every JSON reader keeps them exact; torch's views)."""
_TAGS = frozenset({"t", "d", "l", "u", "v"})


STRUCTURE_CACHE_SIZE = 256
"""Manifests remembered as checked (by :func:`structure_key`); a stage emits and receives a few shapes."""
MAX_KEY_BYTES = 16 * 1024
"""A manifest whose key is longer is checked every time, not remembered: the caches stay small."""

V = TypeVar("V")


def fail(message: str, **details: Any) -> NoReturn:
    """Raise the :class:`ManifestError` every check of the codec raises."""
    raise ManifestError(message, **details)


class ShapeCache(Generic[V]):
    """A small LRU map from a payload's shape to what was worked out for it once (a manifest, a check's
    outcome, an unpacking recipe).  Thread-safe: the inline codec runs in worker threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_checked: ShapeCache[bool] = ShapeCache(STRUCTURE_CACHE_SIZE)


def structure_key(manifest: Manifest) -> bytes | None:
    """Everything :func:`check_structure` looks at, as one byte string; ``None`` when it cannot be made
    (a value msgpack cannot encode, nesting past its limit) or is longer than :data:`MAX_KEY_BYTES`.

    Two manifests with the same key are equal for every check here: msgpack keeps None, bool, int,
    float, str and bytes apart (``1``, ``1.0`` and ``True`` differ), and what it merges — a list and a
    tuple, a subclass of str or int and its base — the checks treat alike.  A hostile manifest costs one
    transient encoding no longer than the entry it came in."""
    try:
        key = msgpack.packb(
            (
                manifest.version,
                manifest.tree,
                [(t.dtype, t.shape, t.device, t.region, t.offset, t.nbytes) for t in manifest.tensors],
                [(r.device, r.nbytes) for r in manifest.regions],
            ),
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError):  # not encodable: checked every time
        return None
    return key if len(key) <= MAX_KEY_BYTES else None


# -- validation (consumer side, before any native call) -------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_regions(manifest: Manifest) -> None:
    seen: set[DeviceKind] = set()
    for i, r in enumerate(manifest.regions):
        if r.device not in MEM_KIND_OF:
            fail("region has an unknown device kind", region=i)
        if r.device in seen:
            fail("two regions of the same device kind", region=i, device=str(r.device))
        seen.add(r.device)
        if not _is_int(r.nbytes) or not 0 <= r.nbytes <= MAX_REGION_BYTES:
            fail("region size out of range", region=i, nbytes=r.nbytes, limit=MAX_REGION_BYTES)


def _check_tensor(i: int, t: TensorSpec, regions: Sequence[RegionSpec]) -> None:
    if t.dtype not in ITEMSIZE:
        fail("unsupported tensor dtype", tensor=i, dtype=str(t.dtype))
    if not isinstance(t.shape, list | tuple) or len(t.shape) > MAX_NDIM:
        fail("tensor shape malformed or has too many dimensions", tensor=i, limit=MAX_NDIM)
    if not all(_is_int(d) and 0 <= d <= MAX_DIM for d in t.shape):
        fail("tensor dimension out of range", tensor=i, shape=[str(d) for d in t.shape], limit=MAX_DIM)
    # An empty tensor's other dimensions are not bounded by its bytes (0): its strides (torch counts a 0 as
    # 1) must still fit int64, or making its view fails inside torch instead of here.
    if math.prod(d or 1 for d in t.shape[1:]) > MAX_INT:
        fail("tensor strides overflow int64", tensor=i, shape=[str(d) for d in t.shape])
    for name in ("offset", "nbytes"):
        v = getattr(t, name)
        if not _is_int(v) or not 0 <= v <= MAX_REGION_BYTES:
            fail(f"tensor {name} out of range", tensor=i, value=str(v), limit=MAX_REGION_BYTES)
    if not _is_int(t.region) or not 0 <= t.region < len(regions):
        fail("tensor refers to a region that does not exist", tensor=i, region=str(t.region), regions=len(regions))
    region = regions[t.region]
    if region.device != t.device:
        fail(
            "tensor device does not match its region's device",
            tensor=i,
            device=str(t.device),
            region_device=str(region.device),
        )
    expected = math.prod(t.shape) * ITEMSIZE[t.dtype]  # Python ints: no overflow, whatever the dims
    if expected != t.nbytes:
        fail(
            "tensor nbytes does not equal shape x itemsize",
            tensor=i,
            nbytes=t.nbytes,
            expected=expected if expected <= MAX_REGION_BYTES else "huge",
        )
    if t.offset % MANIFEST_ALIGNMENT:
        fail("tensor offset is not aligned", tensor=i, offset=t.offset, alignment=MANIFEST_ALIGNMENT)
    if t.offset + t.nbytes > region.nbytes:
        fail(
            "tensor extends beyond its region", tensor=i, offset=t.offset, nbytes=t.nbytes, region_nbytes=region.nbytes
        )


def _check_overlaps(manifest: Manifest) -> None:
    spans = sorted((t.region, t.offset, t.offset + t.nbytes, i) for i, t in enumerate(manifest.tensors) if t.nbytes)
    for (r0, _, end0, i0), (r1, start1, _, i1) in itertools.pairwise(spans):
        if r0 == r1 and start1 < end0:
            fail("tensors overlap within a region", tensors=[i0, i1], region=r0)


class _TreeChecker:
    """Checks the tree's shape, limits and tensor references without recursing past the depth limit."""

    def __init__(self, n_tensors: int) -> None:
        self.n_tensors = n_tensors
        self.seen: set[int] = set()
        self.nodes = 0

    def node(self, node: Any, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_TREE_NODES:
            fail("payload tree has too many nodes", limit=MAX_TREE_NODES)
        if not isinstance(node, dict) or len(node) != 1:
            fail("malformed tree node: expected an object with exactly one key", depth=depth)
        ((tag, body),) = node.items()
        if tag not in _TAGS:
            fail("malformed tree node: unknown tag", tag=str(tag)[:16], depth=depth)
        if tag == "t":
            self._index(body)
        elif tag == "v":
            self._value(body, depth)
        else:
            if depth >= MAX_TREE_DEPTH:
                fail("payload tree nested too deeply", limit=MAX_TREE_DEPTH)
            if not isinstance(body, list | tuple):
                fail("malformed tree node: container body must be a list", tag=tag, depth=depth)
            if tag == "d":
                self._dict(body, depth)
            else:
                for child in body:
                    self.node(child, depth + 1)

    def _index(self, idx: Any) -> None:
        if not _is_int(idx) or not 0 <= idx < self.n_tensors:
            fail("tree refers to a tensor that does not exist", index=str(idx)[:32], tensors=self.n_tensors)
        if idx in self.seen:
            fail("tree refers to the same tensor twice", index=idx)
        self.seen.add(idx)

    def _value(self, v: Any, depth: int) -> None:
        if v is None or isinstance(v, bool):
            return
        if _is_int(v):
            if abs(v) > MAX_INT:
                fail("plain integer outside int64", depth=depth)
        elif isinstance(v, float):
            if not math.isfinite(v):
                fail("plain float is not finite", depth=depth)
        elif isinstance(v, str):
            if len(v) > MAX_STRING_CHARS:
                fail("plain string too long", chars=len(v), limit=MAX_STRING_CHARS)
        else:
            fail("plain value of a forbidden type", type=type(v).__name__, depth=depth)

    def _dict(self, items: Sequence[Any], depth: int) -> None:
        keys: set[str] = set()
        for item in items:
            if not isinstance(item, list | tuple) or len(item) != 2:
                fail("malformed dict entry: expected [key, node]", depth=depth)
            key, child = item
            if not isinstance(key, str):
                fail("dict key is not a string", key_type=type(key).__name__, depth=depth)
            if len(key) > MAX_STRING_CHARS:
                fail("dict key too long", chars=len(key), limit=MAX_STRING_CHARS)
            if key in keys:
                fail("duplicate dict key", key=key[:64], depth=depth)
            keys.add(key)
            self.node(child, depth + 1)


def check_structure(manifest: Manifest) -> None:
    """Everything :func:`validate_manifest` checks except the deployment's size cap."""
    checked_key(manifest)


#: The manifest object that passed last and its key: a get checks its manifest, then unpacks by it.
_last_passed: tuple[Manifest, bytes] | None = None


def checked_key(manifest: Manifest) -> bytes | None:
    """:func:`check_structure`, returning the manifest's :func:`structure_key` for callers that cache
    more by shape (``None``: not cacheable).  A manifest equal to one that passed is not checked again,
    and the very object that passed last not even keyed again (manifests are frozen)."""
    global _last_passed
    last = _last_passed
    if last is not None and last[0] is manifest:
        return last[1]
    key = structure_key(manifest)
    if key is None:  # not cacheable: checked every time
        _check_structure(manifest)
        return None
    if not _checked.get(key):
        _check_structure(manifest)
        _checked.put(key, True)
    _last_passed = (manifest, key)
    return key


def _check_structure(manifest: Manifest) -> None:
    if len(manifest.tensors) > MAX_TENSORS:
        fail("too many tensors", tensors=len(manifest.tensors), limit=MAX_TENSORS)
    if len(manifest.regions) > len(DeviceKind):
        fail("too many regions", regions=len(manifest.regions), limit=len(DeviceKind))
    _check_regions(manifest)
    for i, t in enumerate(manifest.tensors):
        _check_tensor(i, t, manifest.regions)
    _check_overlaps(manifest)
    checker = _TreeChecker(len(manifest.tensors))
    checker.node(manifest.tree, 0)
    if len(checker.seen) != len(manifest.tensors):
        missing = sorted(set(range(len(manifest.tensors))) - checker.seen)
        fail("tensors not referenced by the tree", unreferenced=missing[:16], count=len(missing))


def validate_manifest(manifest: Manifest, *, max_payload_bytes: int) -> None:
    """Reject (ManifestError) any manifest whose layout, sizes or tree are inconsistent or too large.

    Pure Python over Python ints: nothing here touches torch, so hostile sizes cannot reach an allocator.
    """
    check_structure(manifest)
    total = sum(r.nbytes for r in manifest.regions)
    if total > max_payload_bytes:
        fail("payload larger than this deployment accepts", nbytes=total, limit=max_payload_bytes)


def validate_remote_regions(
    manifest: Manifest, regions: Sequence[RemoteRegion], arenas: Sequence[RemoteRegion]
) -> None:
    """Reject descriptors that do not match the (already validated) manifest or leave the peer's arenas.

    ``arenas`` are the registered pool arenas the producer advertises; every region must lie inside one
    of the same memory kind and device, so a READ can only touch memory the producer offered.
    """
    if len(regions) != len(manifest.regions):
        fail("remote region count does not match the manifest", regions=len(regions), expected=len(manifest.regions))
    for i, (rr, spec) in enumerate(zip(regions, manifest.regions, strict=True)):
        _check_address_range(rr, what="remote region", index=i)
        if rr.length != spec.nbytes:
            fail("remote region length does not match the manifest", region=i, length=rr.length, expected=spec.nbytes)
        if rr.mem_kind != MEM_KIND_OF[spec.device]:
            fail(
                "remote region memory kind does not match the manifest",
                region=i,
                mem_kind=str(rr.mem_kind),
                device=str(spec.device),
            )
        if not any(_inside(rr, a) for a in arenas):
            fail(
                "remote region is outside every advertised arena",
                region=i,
                address=rr.address,
                length=rr.length,
                mem_kind=str(rr.mem_kind),
                device_id=rr.device_id,
            )


def _check_address_range(r: RemoteRegion, *, what: str, index: int) -> None:
    ok = (
        _is_int(r.address)
        and _is_int(r.length)
        and _is_int(r.device_id)
        and 1 <= r.address < MAX_ADDRESS
        and 0 <= r.length <= MAX_REGION_BYTES
        and r.address + r.length <= MAX_ADDRESS
        and 0 <= r.device_id <= MAX_DEVICE_ID
    )
    if not ok:
        fail(
            f"{what} has an out-of-range address, length or device",
            index=index,
            address=str(r.address),
            length=str(r.length),
            device_id=str(r.device_id),
        )


def _inside(r: RemoteRegion, arena: RemoteRegion) -> bool:
    return (
        arena.mem_kind == r.mem_kind
        and arena.device_id == r.device_id
        and arena.address <= r.address
        and r.address + r.length <= arena.address + arena.length
    )


# -- bytes in and out ------------------------------------------------------------------------------------
