"""Planning a payload: walk its structure once, lay its tensors out in regions, describe it in a manifest.

Producer side.  :func:`plan_payload` turns a nested structure of tensors and plain values into a
:class:`PackPlan` (the manifest plus the source tensors in manifest order); the caller then takes one
buffer per region (a pool slot, or part of an inline blob) and fills it with
:func:`stageferry.broker.data.payload_codec.pack_into`.  Every emitted manifest has passed the same
checks a consumer applies (:mod:`.payload_validation`), so a producer never sends what will be rejected.
Nothing is copied here; the plan holds references to the caller's tensors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack
import torch

from stageferry.broker.data.payload_validation import (
    DTYPE_OF,
    ITEMSIZE,
    MANIFEST_ALIGNMENT,
    MAX_INT,
    MAX_KEY_BYTES,
    MAX_STRING_CHARS,
    TORCH_DTYPE,
    ShapeCache,
    check_structure,
    fail,
)
from stageferry.schemas.payload import (
    MAX_NDIM,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    DeviceKind,
    DType,
    Manifest,
    RegionSpec,
    TensorSpec,
)

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Leaf(NamedTuple):
    """One tensor of a checked manifest in the terms torch takes: its dtype (and the integer dtype of the
    same width, which copies go through so that every bit survives), a contiguous shape and strides,
    and where it starts in its region and how many elements it has.  Worked out once per payload shape.

    A named tuple: a structure never seen makes one per tensor inside its first get's hop, after the
    stage idled, where a frozen dataclass's field-by-field ``__init__`` costs four times as much (1.0 against
    0.24 µs a leaf on the CPU box)."""

    device: DeviceKind
    dtype: torch.dtype
    bits: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    start: int
    numel: int


#: Per dtype of a manifest: its torch dtype, the integer dtype of its width, and that width.
_TYPES: dict[DType, tuple[torch.dtype, torch.dtype, int]] = {
    k: (v, _BITS_DTYPE[v.itemsize], v.itemsize) for k, v in TORCH_DTYPE.items()
}


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous strides of ``shape`` (a dimension of 0 counts as 1, as torch's do)."""
    n = len(shape)
    if n <= 1:
        return (1,) * n
    strides = [1] * n
    step = 1
    for i in range(n - 1, 0, -1):
        step *= shape[i] or 1
        strides[i - 1] = step
    return tuple(strides)


def leaves_of(manifest: Manifest) -> tuple[Leaf, ...]:
    """The :class:`Leaf` of every tensor of ``manifest``, which must have passed ``check_structure``."""
    leaves = []
    for spec in manifest.tensors:
        dtype, bits, size = _TYPES[spec.dtype]
        shape = tuple(spec.shape)
        leaves.append(Leaf(spec.device, dtype, bits, shape, _strides(shape), spec.offset // size, spec.nbytes // size))
    return tuple(leaves)


@dataclass(frozen=True, slots=True)
class PackPlan:
    """A payload's manifest plus the source tensors (manifest order) that :func:`pack_into` copies, and
    the manifest's :class:`Leaf` list (shared by every plan of that shape)."""

    manifest: Manifest
    tensors: tuple[torch.Tensor, ...]
    leaves: tuple[Leaf, ...]


#: Manifests already built, and their leaves, by payload *shape* (tree, dtypes, shapes, devices,
#: alignment).  A stage emits the same few shapes over and over; building and checking the pydantic
#: manifest was most of a T2VA put's planning (its 23-node tree).  Manifests are frozen models and
#: leaves hold no tensor, so sharing them between puts is safe.  A key longer than ``MAX_KEY_BYTES``
#: (long plain values) is not kept, so the cache stays small whatever the payloads carry.
PLAN_CACHE_SIZE = 256
_manifests: ShapeCache[tuple[Manifest, tuple[Leaf, ...]]] = ShapeCache(PLAN_CACHE_SIZE)


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


# -- producer side: structure -> plan -------------------------------------------------------------------


Path = str | tuple[Any, str | int]
"""Where a value sits in the payload, for error messages: ``"$"``, or ``(parent, key or index)``.  Built
as cheap tuples while walking and spelled out (``$.text[0]``) only when something is rejected."""


def _shown(path: Path) -> str:
    pieces = []
    while isinstance(path, tuple):
        path, piece = path
        pieces.append(f"[{piece}]" if isinstance(piece, int) else f".{piece}")
    return path + "".join(reversed(pieces))


def _plain(value: Any, path: Path) -> str | int | float | bool | None:
    """The JSON-safe form of a plain value, or a ManifestError saying why it cannot travel."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            fail("integer value outside int64", path=_shown(path))
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            fail("non-finite float value (JSON cannot carry it)", path=_shown(path))
        return float(value)
    if isinstance(value, str):
        return _plain_str(value, path)
    fail("unsupported value type in payload", path=_shown(path), type=type(value).__name__)


def _plain_str(value: str, path: Path) -> str:
    if len(value) > MAX_STRING_CHARS:
        fail("string too long", path=_shown(path), chars=len(value), limit=MAX_STRING_CHARS)
    if value.isascii():  # no lone surrogate possible
        return str.__str__(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        fail("string is not valid UTF-8 (lone surrogate)", path=_shown(path))
    return str.__str__(value)


def _device_kind(t: torch.Tensor, path: Path) -> DeviceKind:
    if t.is_cpu:
        return DeviceKind.CPU
    if t.is_cuda:
        return DeviceKind.CUDA
    fail("tensor on an unsupported device", path=_shown(path), device=str(t.device))


class _Flattener:
    """Walks a payload once, collecting its tensors and its structure as a flat list of *tokens*.

    Every put walks its payload (the plain values are the request's own), so the walk is kept lean: it
    writes tokens, not the tree — ``"v", value``; ``"t"`` (tensors are numbered in walk order);
    ``"d", n`` then n times ``key, node``; ``"l"``/``"u", n`` then n nodes — so the tree, which
    :func:`_tree` reads back from them, is built only for a shape not planned before.  Exact plain types
    are dispatched first and paths are spelled out only for an error."""

    def __init__(self) -> None:
        self.tokens: list[Any] = []
        self.tensors: list[torch.Tensor] = []
        self.kinds: list[DeviceKind] = []
        self.dtypes: list[DType] = []

    def node(self, obj: Any, depth: int, path: Path) -> None:
        tokens = self.tokens
        cls = type(obj)
        if cls is str:
            tokens.append("v")
            tokens.append(_plain_str(obj, path))
        elif (cls is int and -MAX_INT <= obj <= MAX_INT) or obj is None or cls is bool:
            tokens.append("v")
            tokens.append(obj)
        elif isinstance(obj, torch.Tensor):
            self._tensor(obj, path)
            tokens.append("t")
        elif isinstance(obj, dict | list | tuple):
            if depth >= MAX_TREE_DEPTH:
                fail("payload nested too deeply", path=_shown(path), limit=MAX_TREE_DEPTH)
            if isinstance(obj, dict):
                tokens.append("d")
                tokens.append(len(obj))
                for k, v in obj.items():
                    if not isinstance(k, str):
                        fail("dict keys must be str", path=_shown(path), key_type=type(k).__name__)
                    tokens.append(_plain_str(k, path))
                    self.node(v, depth + 1, (path, k))
            else:
                tokens.append("l" if isinstance(obj, list) else "u")
                tokens.append(len(obj))
                for i, v in enumerate(obj):
                    self.node(v, depth + 1, (path, i))
        else:
            tokens.append("v")
            tokens.append(_plain(obj, path))

    def _tensor(self, t: torch.Tensor, path: Path) -> int:
        if t.layout != torch.strided:
            fail("only strided (dense) tensors can travel", path=_shown(path), layout=str(t.layout))
        dtype = DTYPE_OF.get(t.dtype)
        if dtype is None:
            fail("unsupported tensor dtype", path=_shown(path), dtype=str(t.dtype), supported=[d.value for d in DType])
        if t.dim() > MAX_NDIM:
            fail("tensor has too many dimensions", path=_shown(path), ndim=t.dim(), limit=MAX_NDIM)
        if len(self.tensors) >= MAX_TENSORS:
            fail("too many tensors in payload", limit=MAX_TENSORS)
        self.kinds.append(_device_kind(t, path))
        self.dtypes.append(dtype)
        self.tensors.append(t.detach())
        return len(self.tensors) - 1


def _tree(tokens: list[Any]) -> dict[str, Any]:
    """The typed-node tree that :class:`_Flattener`'s ``tokens`` spell (their format is described there)."""
    read = iter(tokens).__next__
    count = itertools.count()

    def node() -> dict[str, Any]:
        tag = read()
        if tag == "v":
            return {"v": read()}
        if tag == "t":
            return {"t": next(count)}
        n = read()
        if tag == "d":
            return {"d": [[read(), node()] for _ in range(n)]}
        return {tag: [node() for _ in range(n)]}

    return node()


def plan_payload(payload: Any, *, alignment: int = MANIFEST_ALIGNMENT) -> PackPlan:
    """Flatten ``payload`` into a manifest, copying no bytes; ManifestError if it cannot travel.

    Regions are ordered CPU, CUDA (only kinds present); offsets are multiples of ``alignment`` (a multiple
    of 64) and each region's size is rounded up to it, so regions concatenated inline stay aligned.
    Zero-size tensors get offset 0 and nbytes 0.  The plan keeps references to the source tensors.
    """
    if alignment <= 0 or alignment % MANIFEST_ALIGNMENT:
        raise ValueError(f"alignment must be a positive multiple of {MANIFEST_ALIGNMENT}, got {alignment}")
    flat = _Flattener()
    flat.node(payload, 0, "$")
    shape_key = (
        msgpack.packb(flat.tokens, use_bin_type=True),  # keeps 1, 1.0 and True, and str and bytes, apart
        alignment,
        tuple(zip(flat.kinds, flat.dtypes, (tuple(t.shape) for t in flat.tensors), strict=True)),
    )
    cacheable = len(shape_key[0]) <= MAX_KEY_BYTES  # a payload with long plain values is planned every time
    known = _manifests.get(shape_key) if cacheable else None
    if known is None:
        manifest = _build_manifest(_tree(flat.tokens), flat, alignment)
        known = (manifest, leaves_of(manifest))
        if cacheable:
            _manifests.put(shape_key, known)
    return PackPlan(manifest=known[0], tensors=tuple(flat.tensors), leaves=known[1])


def _build_manifest(tree: dict[str, Any], flat: _Flattener, alignment: int) -> Manifest:
    kinds = [k for k in DeviceKind if k in flat.kinds]
    region_of = {k: i for i, k in enumerate(kinds)}
    cursor = dict.fromkeys(kinds, 0)
    specs = []
    for t, kind, dtype in zip(flat.tensors, flat.kinds, flat.dtypes, strict=True):
        nbytes = t.numel() * ITEMSIZE[dtype]
        offset = cursor[kind] if nbytes else 0
        if nbytes:
            cursor[kind] = _round_up(offset + nbytes, alignment)
        specs.append(
            TensorSpec(
                dtype=dtype, shape=list(t.shape), device=kind, region=region_of[kind], offset=offset, nbytes=nbytes
            )
        )
    regions = [RegionSpec(device=k, nbytes=cursor[k]) for k in kinds]
    manifest = Manifest(tree=tree, tensors=specs, regions=regions)
    check_structure(manifest)  # never emit what a consumer would reject
    return manifest
