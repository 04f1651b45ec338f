"""Payload structure <-> (:class:`~stageferry.schemas.payload.Manifest`, packed regions), and its validation.

A payload is a nested structure of dicts (str keys), lists and tuples whose leaves are torch tensors or
plain values (str, int, float, bool, None).  The manifest's ``tree`` is JSON made of typed nodes, so it
is unambiguous whatever keys the user's dicts use::

    {"t": 3}                       tensor number 3 of ``manifest.tensors``
    {"d": [["key", node], ...]}    dict (insertion order kept)
    {"l": [node, ...]}             list
    {"u": [node, ...]}             tuple
    {"v": 1.5}                     plain value

Tensor bytes are laid out in one region per device kind, at aligned offsets; a region travels over NIXL
(a pool slot) or inline (all regions concatenated in manifest order).  It is the safetensors idea (JSON
header + raw bytes) with the nesting kept, and nothing is ever unpickled.

Who calls what:

* producer: :func:`plan_payload`, then a slot per region, then :func:`pack_into`; or :func:`encode_inline`;
* consumer: :func:`validate_manifest` (and :func:`validate_remote_regions` for NIXL) *before* any slot is
  taken or byte is read, then :func:`unpack`; or :func:`decode_inline`, which validates itself.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import structlog
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

log = structlog.get_logger(__name__)

MANIFEST_ALIGNMENT = 64
"""Every tensor offset is a multiple of this (manifest version 1): any dtype can be viewed in place."""
MAX_STRING_CHARS = 4096
"""Longest plain string value or dict key; conditioning metadata, not documents."""
MAX_ADDRESS = 2**64
MAX_DEVICE_ID = 1024
_MAX_INT = 2**63 - 1  # plain ints stay within int64 so that every JSON reader keeps them exact

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
# Copies go through same-width integer views so that every bit (NaN payloads included) survives.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_ITEMSIZE = max(ITEMSIZE.values())

_TAGS = frozenset({"t", "d", "l", "u", "v"})


@dataclass(frozen=True, slots=True)
class PackPlan:
    """A payload's manifest plus the source tensors (manifest order) that :func:`pack_into` copies."""

    manifest: Manifest
    tensors: tuple[torch.Tensor, ...]


def _fail(message: str, **details: Any) -> NoReturn:
    raise ManifestError(message, **details)


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


# -- producer side: structure -> plan -------------------------------------------------------------------


def _plain(value: Any, path: str) -> str | int | float | bool | None:
    """The JSON-safe form of a plain value, or a ManifestError saying why it cannot travel."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > _MAX_INT:
            _fail("integer value outside int64", path=path)
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            _fail("non-finite float value (JSON cannot carry it)", path=path)
        return float(value)
    if isinstance(value, str):
        return _plain_str(value, path)
    _fail("unsupported value type in payload", path=path, type=type(value).__name__)


def _plain_str(value: str, path: str) -> str:
    if len(value) > MAX_STRING_CHARS:
        _fail("string too long", path=path, chars=len(value), limit=MAX_STRING_CHARS)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _fail("string is not valid UTF-8 (lone surrogate)", path=path)
    return str.__str__(value)


def _device_kind(t: torch.Tensor, path: str) -> DeviceKind:
    if t.device.type == "cpu":
        return DeviceKind.CPU
    if t.device.type == "cuda":
        return DeviceKind.CUDA
    _fail("tensor on an unsupported device", path=path, device=str(t.device))


class _Flattener:
    """Walks a payload once, collecting tensors and building the typed-node tree."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.kinds: list[DeviceKind] = []
        self.dtypes: list[DType] = []

    def node(self, obj: Any, depth: int, path: str) -> dict[str, Any]:
        if isinstance(obj, torch.Tensor):
            return {"t": self._tensor(obj, path)}
        if isinstance(obj, dict | list | tuple) and depth >= MAX_TREE_DEPTH:
            _fail("payload nested too deeply", path=path, limit=MAX_TREE_DEPTH)
        if isinstance(obj, dict):
            items = []
            for k, v in obj.items():
                if not isinstance(k, str):
                    _fail("dict keys must be str", path=path, key_type=type(k).__name__)
                items.append([_plain_str(k, path), self.node(v, depth + 1, f"{path}.{k}")])
            return {"d": items}
        if isinstance(obj, list | tuple):
            tag = "l" if isinstance(obj, list) else "u"
            return {tag: [self.node(v, depth + 1, f"{path}[{i}]") for i, v in enumerate(obj)]}
        return {"v": _plain(obj, path)}

    def _tensor(self, t: torch.Tensor, path: str) -> int:
        if t.layout != torch.strided:
            _fail("only strided (dense) tensors can travel", path=path, layout=str(t.layout))
        dtype = DTYPE_OF.get(t.dtype)
        if dtype is None:
            _fail("unsupported tensor dtype", path=path, dtype=str(t.dtype), supported=[d.value for d in DType])
        if t.dim() > MAX_NDIM:
            _fail("tensor has too many dimensions", path=path, ndim=t.dim(), limit=MAX_NDIM)
        if len(self.tensors) >= MAX_TENSORS:
            _fail("too many tensors in payload", limit=MAX_TENSORS)
        self.kinds.append(_device_kind(t, path))
        self.dtypes.append(dtype)
        self.tensors.append(t.detach())
        return len(self.tensors) - 1


def plan_payload(payload: Any, *, alignment: int = MANIFEST_ALIGNMENT) -> PackPlan:
    """Flatten ``payload`` into a manifest, copying no bytes; ManifestError if it cannot travel.

    Regions are ordered CPU, CUDA (only kinds present); offsets are multiples of ``alignment`` (a multiple
    of 64) and each region's size is rounded up to it, so regions concatenated inline stay aligned.
    Zero-size tensors get offset 0 and nbytes 0.  The plan keeps references to the source tensors.
    """
    if alignment <= 0 or alignment % MANIFEST_ALIGNMENT:
        raise ValueError(f"alignment must be a positive multiple of {MANIFEST_ALIGNMENT}, got {alignment}")
    flat = _Flattener()
    tree = flat.node(payload, 0, "$")
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
    _check_structure(manifest)  # never emit what a consumer would reject
    return PackPlan(manifest=manifest, tensors=tuple(flat.tensors))


# -- validation (consumer side, before any native call) -------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_regions(manifest: Manifest) -> None:
    seen: set[DeviceKind] = set()
    for i, r in enumerate(manifest.regions):
        if r.device not in MEM_KIND_OF:
            _fail("region has an unknown device kind", region=i)
        if r.device in seen:
            _fail("two regions of the same device kind", region=i, device=str(r.device))
        seen.add(r.device)
        if not _is_int(r.nbytes) or not 0 <= r.nbytes <= MAX_REGION_BYTES:
            _fail("region size out of range", region=i, nbytes=r.nbytes, limit=MAX_REGION_BYTES)


def _check_tensor(i: int, t: TensorSpec, regions: Sequence[RegionSpec]) -> None:
    if t.dtype not in ITEMSIZE:
        _fail("unsupported tensor dtype", tensor=i, dtype=str(t.dtype))
    if not isinstance(t.shape, list | tuple) or len(t.shape) > MAX_NDIM:
        _fail("tensor shape malformed or has too many dimensions", tensor=i, limit=MAX_NDIM)
    if not all(_is_int(d) and 0 <= d <= MAX_DIM for d in t.shape):
        _fail("tensor dimension out of range", tensor=i, shape=[str(d) for d in t.shape], limit=MAX_DIM)
    for name in ("offset", "nbytes"):
        v = getattr(t, name)
        if not _is_int(v) or not 0 <= v <= MAX_REGION_BYTES:
            _fail(f"tensor {name} out of range", tensor=i, value=str(v), limit=MAX_REGION_BYTES)
    if not _is_int(t.region) or not 0 <= t.region < len(regions):
        _fail("tensor refers to a region that does not exist", tensor=i, region=str(t.region), regions=len(regions))
    region = regions[t.region]
    if region.device != t.device:
        _fail(
            "tensor device does not match its region's device",
            tensor=i,
            device=str(t.device),
            region_device=str(region.device),
        )
    expected = math.prod(t.shape) * ITEMSIZE[t.dtype]  # Python ints: no overflow, whatever the dims
    if expected != t.nbytes:
        _fail(
            "tensor nbytes does not equal shape x itemsize",
            tensor=i,
            nbytes=t.nbytes,
            expected=expected if expected <= MAX_REGION_BYTES else "huge",
        )
    if t.offset % MANIFEST_ALIGNMENT:
        _fail("tensor offset is not aligned", tensor=i, offset=t.offset, alignment=MANIFEST_ALIGNMENT)
    if t.offset + t.nbytes > region.nbytes:
        _fail(
            "tensor extends beyond its region", tensor=i, offset=t.offset, nbytes=t.nbytes, region_nbytes=region.nbytes
        )


def _check_overlaps(manifest: Manifest) -> None:
    spans = sorted((t.region, t.offset, t.offset + t.nbytes, i) for i, t in enumerate(manifest.tensors) if t.nbytes)
    for (r0, _, end0, i0), (r1, start1, _, i1) in itertools.pairwise(spans):
        if r0 == r1 and start1 < end0:
            _fail("tensors overlap within a region", tensors=[i0, i1], region=r0)


class _TreeChecker:
    """Checks the tree's shape, limits and tensor references without recursing past the depth limit."""

    def __init__(self, n_tensors: int) -> None:
        self.n_tensors = n_tensors
        self.seen: set[int] = set()
        self.nodes = 0

    def node(self, node: Any, depth: int) -> None:
        self.nodes += 1
        if self.nodes > MAX_TREE_NODES:
            _fail("payload tree has too many nodes", limit=MAX_TREE_NODES)
        if not isinstance(node, dict) or len(node) != 1:
            _fail("malformed tree node: expected an object with exactly one key", depth=depth)
        ((tag, body),) = node.items()
        if tag not in _TAGS:
            _fail("malformed tree node: unknown tag", tag=str(tag)[:16], depth=depth)
        if tag == "t":
            self._index(body)
        elif tag == "v":
            self._value(body, depth)
        else:
            if depth >= MAX_TREE_DEPTH:
                _fail("payload tree nested too deeply", limit=MAX_TREE_DEPTH)
            if not isinstance(body, list | tuple):
                _fail("malformed tree node: container body must be a list", tag=tag, depth=depth)
            if tag == "d":
                self._dict(body, depth)
            else:
                for child in body:
                    self.node(child, depth + 1)

    def _index(self, idx: Any) -> None:
        if not _is_int(idx) or not 0 <= idx < self.n_tensors:
            _fail("tree refers to a tensor that does not exist", index=str(idx)[:32], tensors=self.n_tensors)
        if idx in self.seen:
            _fail("tree refers to the same tensor twice", index=idx)
        self.seen.add(idx)

    def _value(self, v: Any, depth: int) -> None:
        if v is None or isinstance(v, bool):
            return
        if _is_int(v):
            if abs(v) > _MAX_INT:
                _fail("plain integer outside int64", depth=depth)
        elif isinstance(v, float):
            if not math.isfinite(v):
                _fail("plain float is not finite", depth=depth)
        elif isinstance(v, str):
            if len(v) > MAX_STRING_CHARS:
                _fail("plain string too long", chars=len(v), limit=MAX_STRING_CHARS)
        else:
            _fail("plain value of a forbidden type", type=type(v).__name__, depth=depth)

    def _dict(self, items: Sequence[Any], depth: int) -> None:
        keys: set[str] = set()
        for item in items:
            if not isinstance(item, list | tuple) or len(item) != 2:
                _fail("malformed dict entry: expected [key, node]", depth=depth)
            key, child = item
            if not isinstance(key, str):
                _fail("dict key is not a string", key_type=type(key).__name__, depth=depth)
            if len(key) > MAX_STRING_CHARS:
                _fail("dict key too long", chars=len(key), limit=MAX_STRING_CHARS)
            if key in keys:
                _fail("duplicate dict key", key=key[:64], depth=depth)
            keys.add(key)
            self.node(child, depth + 1)


def _check_structure(manifest: Manifest) -> None:
    """Everything :func:`validate_manifest` checks except the deployment's size cap."""
    if len(manifest.tensors) > MAX_TENSORS:
        _fail("too many tensors", tensors=len(manifest.tensors), limit=MAX_TENSORS)
    if len(manifest.regions) > len(DeviceKind):
        _fail("too many regions", regions=len(manifest.regions), limit=len(DeviceKind))
    _check_regions(manifest)
    for i, t in enumerate(manifest.tensors):
        _check_tensor(i, t, manifest.regions)
    _check_overlaps(manifest)
    checker = _TreeChecker(len(manifest.tensors))
    checker.node(manifest.tree, 0)
    if len(checker.seen) != len(manifest.tensors):
        missing = sorted(set(range(len(manifest.tensors))) - checker.seen)
        _fail("tensors not referenced by the tree", unreferenced=missing[:16], count=len(missing))


def validate_manifest(manifest: Manifest, *, max_payload_bytes: int) -> None:
    """Reject (ManifestError) any manifest whose layout, sizes or tree are inconsistent or too large.

    Pure Python over Python ints: nothing here touches torch, so hostile sizes cannot reach an allocator.
    """
    _check_structure(manifest)
    total = sum(r.nbytes for r in manifest.regions)
    if total > max_payload_bytes:
        _fail("payload larger than this deployment accepts", nbytes=total, limit=max_payload_bytes)


def validate_remote_regions(
    manifest: Manifest, regions: Sequence[RemoteRegion], arenas: Sequence[RemoteRegion]
) -> None:
    """Reject descriptors that do not match the (already validated) manifest or leave the peer's arenas.

    ``arenas`` are the registered pool arenas the producer advertises; every region must lie inside one
    of the same memory kind and device, so a READ can only touch memory the producer offered.
    """
    if len(regions) != len(manifest.regions):
        _fail("remote region count does not match the manifest", regions=len(regions), expected=len(manifest.regions))
    for i, (rr, spec) in enumerate(zip(regions, manifest.regions, strict=True)):
        _check_address_range(rr, what="remote region", index=i)
        if rr.length != spec.nbytes:
            _fail("remote region length does not match the manifest", region=i, length=rr.length, expected=spec.nbytes)
        if rr.mem_kind != MEM_KIND_OF[spec.device]:
            _fail(
                "remote region memory kind does not match the manifest",
                region=i,
                mem_kind=str(rr.mem_kind),
                device=str(spec.device),
            )
        if not any(_inside(rr, a) for a in arenas):
            _fail(
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
        _fail(
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


def _check_buffers(manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor]) -> None:
    """Caller-side contract on buffers: a uint8, 1-D, contiguous tensor of at least the region's size."""
    for r in manifest.regions:
        buf = buffers.get(r.device)
        if buf is None:
            raise ValueError(f"no buffer given for the {r.device} region")
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"the {r.device} buffer must be a contiguous 1-D uint8 tensor")
        if buf.numel() < r.nbytes:
            raise ValueError(f"the {r.device} buffer holds {buf.numel()} bytes, region needs {r.nbytes}")


def _typed_view(buf: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view over ``buf`` (sizes already validated)."""
    dtype = TORCH_DTYPE[spec.dtype]
    if spec.nbytes == 0:
        return torch.empty(tuple(spec.shape), dtype=dtype, device=buf.device)
    return buf[spec.offset : spec.offset + spec.nbytes].view(dtype).view(tuple(spec.shape))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def pack_into(plan: PackPlan, buffers: Mapping[DeviceKind, torch.Tensor]) -> None:
    """Copy every tensor of ``plan`` into its region's buffer (one copy, strided sources included).

    A buffer may live elsewhere than its kind says (:func:`encode_inline` stages CUDA leaves in host
    memory).  CUDA destinations are synchronised before returning: a NIXL READ does not wait on streams.
    """
    manifest = plan.manifest
    _check_buffers(manifest, buffers)
    with torch.no_grad():
        for spec, src in zip(manifest.tensors, plan.tensors, strict=True):
            if spec.nbytes == 0:
                continue
            dest = _typed_view(buffers[spec.device], spec)
            _bits(dest).copy_(_bits(src.resolve_neg().resolve_conj()))
    for r in manifest.regions:
        buf = buffers[r.device]
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)


def _build(node: dict[str, Any], leaves: Sequence[Any]) -> Any:
    ((tag, body),) = node.items()
    if tag == "t":
        return leaves[body]
    if tag == "v":
        return body
    if tag == "d":
        return {key: _build(child, leaves) for key, child in body}
    children = [_build(child, leaves) for child in body]
    return children if tag == "l" else tuple(children)


def _unpack(manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor], copy: bool) -> Any:
    _check_buffers(manifest, buffers)
    leaves = []
    for spec in manifest.tensors:
        view = _typed_view(buffers[spec.device], spec)
        leaves.append(view.clone() if copy and spec.nbytes else view)
    return _build(manifest.tree, leaves)


def unpack(manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor], *, copy: bool) -> Any:
    """Rebuild the payload over ``buffers`` (one per region kind, e.g. pool slot views).

    ``copy=False``: tensors are views of the buffers (zero-copy); the caller keeps the buffers (the slots)
    alive and unchanged while the payload is in use.  ``copy=True``: every tensor owns its memory, so the
    buffers may be released at once.  Tensors land on the device of their kind's buffer.  The manifest's
    structure is checked again here (cheap) so no unchecked size reaches torch.
    """
    _check_structure(manifest)
    return _unpack(manifest, buffers, copy)


def encode_inline(payload: Any) -> tuple[Manifest, bytes]:
    """The manifest and the regions concatenated in manifest order: the inline (no NIXL) form.

    CUDA leaves are copied to host memory here but keep device kind CUDA in the manifest, so they land
    on the consumer's GPU.
    """
    plan = plan_payload(payload)
    total = plan.manifest.total_bytes
    if total == 0:
        return plan.manifest, b""
    blob = bytearray(total)
    flat = torch.frombuffer(blob, dtype=torch.uint8)
    buffers: dict[DeviceKind, torch.Tensor] = {}
    start = 0
    for r in plan.manifest.regions:
        buffers[r.device] = flat[start : start + r.nbytes]
        start += r.nbytes
    pack_into(plan, buffers)
    return plan.manifest, bytes(blob)


def _blob_view(blob: bytes | bytearray | memoryview) -> tuple[torch.Tensor, bool]:
    """A uint8 tensor over ``blob`` and whether it may be handed out (writable) without a copy."""
    writable = not (isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only sources are only ever copied from, see decode_inline
        return torch.frombuffer(blob, dtype=torch.uint8), writable


def decode_inline(manifest: Manifest, blob: bytes | bytearray | memoryview, *, cuda_device: torch.device | None) -> Any:
    """Validate ``manifest`` against ``blob`` and rebuild the payload; the result owns or shares ``blob``.

    A writable ``blob`` (bytearray) is shared zero-copy for CPU leaves; an immutable one (``bytes``, as
    Redis returns) is copied once, so in-place ops on the payload can never mutate a ``bytes`` object.
    CUDA leaves are moved to ``cuda_device``; without one the payload is rejected (ManifestError).
    """
    _check_structure(manifest)
    size = memoryview(blob).nbytes
    if size != manifest.total_bytes:
        _fail("inline blob size does not match the manifest", blob_bytes=size, expected=manifest.total_bytes)
    needs_gpu = any(r.device is DeviceKind.CUDA for r in manifest.regions)
    if needs_gpu and cuda_device is None:
        _fail("payload has CUDA tensors but this process has no GPU for them")
    flat, writable = _blob_view(blob) if size else (torch.empty(0, dtype=torch.uint8), True)
    buffers: dict[DeviceKind, torch.Tensor] = {}
    start = 0
    for r in manifest.regions:
        part = flat[start : start + r.nbytes]
        if r.device is DeviceKind.CUDA:
            part = part.to(cuda_device)
        elif not writable or start % _MAX_ITEMSIZE or part.data_ptr() % _MAX_ITEMSIZE:
            part = part.clone()  # immutable source, or too misaligned for typed views
        buffers[r.device] = part
        start += r.nbytes
    return _unpack(manifest, buffers, copy=False)
