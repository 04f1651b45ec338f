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

The planning and the validation live in :mod:`.payload_plan` and :mod:`.payload_validation`; their
public names are re-exported here, so callers import the codec as one thing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stageferry.broker.data.payload_plan import Leaf, PackPlan, leaves_of, plan_payload
from stageferry.broker.data.payload_validation import (
    DTYPE_OF,
    ITEMSIZE,
    MANIFEST_ALIGNMENT,
    MAX_ADDRESS,
    MAX_DEVICE_ID,
    MAX_STRING_CHARS,
    STRUCTURE_CACHE_SIZE,
    TORCH_DTYPE,
    ShapeCache,
    checked_key,
    fail,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.errors import ManifestError
from stageferry.schemas.payload import DeviceKind, Manifest

__all__ = [
    "DTYPE_OF",
    "ITEMSIZE",
    "MANIFEST_ALIGNMENT",
    "MAX_ADDRESS",
    "MAX_DEVICE_ID",
    "MAX_STRING_CHARS",
    "TORCH_DTYPE",
    "Buffer",
    "PackPlan",
    "Span",
    "TypedViews",
    "decode_inline",
    "encode_inline",
    "pack_into",
    "plan_payload",
    "unpack",
    "validate_manifest",
    "validate_remote_regions",
]

_MAX_ITEMSIZE = max(ITEMSIZE.values())


class TypedViews:
    """A contiguous 1-D uint8 tensor (a pool's arena) and its views as each dtype, each made once and kept.

    Why kept: in a process that has been idle (a stage waiting for its first request), the first call of
    each torch op costs 30–130 µs (cold caches), a repeat of it 3–5 µs.  A payload's tensors made over a
    pool's :class:`Span` with the arena's dtype views kept take one ``as_strided`` each and no other torch
    op (no dtype view, slice or empty tensor per get): a get of a structure never seen pays one cold op,
    not four.  Not thread-safe to fill; a pool makes every dtype's view when it is created."""

    __slots__ = ("_typed", "tensor")

    def __init__(self, tensor: torch.Tensor, dtypes: Iterable[torch.dtype] = ()) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError("typed views need a contiguous 1-D uint8 tensor")
        self.tensor = tensor
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        for dtype in dtypes:
            self.typed(dtype)

    def typed(self, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The tensor as ``dtype`` (a last partial element cut off) and the storage offset, in elements of
        ``dtype``, of the tensor's first byte (a view's ``as_strided`` offset counts from the storage)."""
        got = self._typed.get(dtype)
        if got is None:
            n, size = self.tensor.numel(), dtype.itemsize
            whole = (self.tensor if n % size == 0 else self.tensor[: n - n % size]).view(dtype)
            got = self._typed[dtype] = (whole, int(whole.storage_offset()))
        return got


@dataclass(frozen=True, slots=True)
class Span:
    """Where a region's bytes are: ``nbytes`` from byte ``offset`` of ``views``' tensor (a pool slot:
    :attr:`~stageferry.broker.data.pool.Slot.span`).  ``offset`` is aligned to every dtype's size."""

    views: TypedViews
    offset: int
    nbytes: int


#: What a region's buffer may be given as: a contiguous 1-D uint8 tensor of at least the region's size
#: (its dtype views made on each call), or a :class:`Span` of a pool's arena (its dtype views kept).
Buffer = torch.Tensor | Span


def _spans(manifest: Manifest, buffers: Mapping[DeviceKind, Buffer]) -> dict[DeviceKind, Span]:
    """Each region's buffer as a :class:`Span`, checked: there, of the right kind, at least the region's size."""
    spans: dict[DeviceKind, Span] = {}
    for r in manifest.regions:
        buf = buffers.get(r.device)
        if buf is None:
            raise ValueError(f"no buffer given for the {r.device} region")
        if not isinstance(buf, Span):
            try:
                buf = Span(TypedViews(buf), 0, buf.numel())
            except ValueError:
                raise ValueError(f"the {r.device} buffer must be a contiguous 1-D uint8 tensor") from None
        if buf.nbytes < r.nbytes:
            raise ValueError(f"the {r.device} buffer holds {buf.nbytes} bytes, region needs {r.nbytes}")
        spans[r.device] = buf
    return spans


#: The leaves of manifests that passed the structure checks, by structure key (see ``_checked_leaves``).
_leaves: ShapeCache[tuple[Leaf, ...]] = ShapeCache(STRUCTURE_CACHE_SIZE)


def _checked_leaves(manifest: Manifest) -> tuple[Leaf, ...]:
    """Check ``manifest``'s structure and return its leaves; both remembered for a manifest equal to one
    already seen (see :func:`~stageferry.broker.data.payload_validation.structure_key`)."""
    key = checked_key(manifest)
    if key is None:
        return leaves_of(manifest)
    leaves = _leaves.get(key)
    if leaves is None:
        leaves = leaves_of(manifest)
        _leaves.put(key, leaves)
    return leaves


def _views(leaves: Sequence[Leaf], spans: Mapping[DeviceKind, Span], *, bits: bool) -> list[torch.Tensor]:
    """The tensors ``leaves`` describe, as views over ``spans`` (made by ``_spans``): each as its own dtype,
    or with ``bits`` as the integer dtype of its width.

    Each is one ``as_strided`` of its span's arena viewed as its dtype (:meth:`TypedViews.typed`), empty
    tensors too, and nothing else reaches torch.  ``as_strided`` is bounded by the whole arena, not the
    span, so every view is checked to end inside its span, although the manifest's checks already
    guarantee it."""
    views = []
    for device, dtype, wide, shape, strides, start, numel in leaves:
        if bits:
            dtype = wide
        span = spans[device]
        size = dtype.itemsize
        if span.offset % size:
            raise ValueError(f"a span at byte {span.offset} cannot hold {dtype} elements")
        whole, first = span.views.typed(dtype)
        if numel and start + numel > span.nbytes // size:
            raise ManifestError("tensor extends beyond its buffer", start=start, count=numel)
        views.append(whole.as_strided(shape, strides, first + span.offset // size + (start if numel else 0)))
    return views


def pack_into(plan: PackPlan, buffers: Mapping[DeviceKind, Buffer]) -> None:
    """Copy every tensor of ``plan`` into its region's buffer (one copy, strided sources included).

    A buffer may live elsewhere than its kind says (:func:`encode_inline` stages CUDA leaves in host
    memory).  CUDA destinations are synchronised before returning: a NIXL READ does not wait on streams.
    """
    manifest = plan.manifest
    spans = _spans(manifest, buffers)
    with torch.no_grad():
        for leaf, dest, src in zip(plan.leaves, _views(plan.leaves, spans, bits=True), plan.tensors, strict=True):
            if leaf.numel:
                dest.copy_(src.resolve_neg().resolve_conj().view(leaf.bits))
    for r in manifest.regions:
        buf = spans[r.device].views.tensor
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


def _unpack(manifest: Manifest, leaves: Sequence[Leaf], buffers: Mapping[DeviceKind, Buffer], copy: bool) -> Any:
    views = _views(leaves, _spans(manifest, buffers), bits=False)
    if copy:  # empty ones too: a view keeps its whole arena alive
        views = [view.clone() for view in views]
    return _build(manifest.tree, views)


def unpack(manifest: Manifest, buffers: Mapping[DeviceKind, Buffer], *, copy: bool) -> Any:
    """Rebuild the payload over ``buffers`` (one per region kind: a pool slot's :class:`Span`, or a tensor).

    ``copy=False``: tensors are views of the buffers (zero-copy); the caller keeps the buffers (the slots)
    alive and unchanged while the payload is in use.  ``copy=True``: every tensor owns its memory, so the
    buffers may be released at once.  Tensors land on the device of their kind's buffer.  The manifest's
    structure is checked again here (a manifest equal to one already checked costs one key lookup) so
    no unchecked size reaches torch.
    """
    return _unpack(manifest, _checked_leaves(manifest), buffers, copy)


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
    leaves = _checked_leaves(manifest)
    size = memoryview(blob).nbytes
    if size != manifest.total_bytes:
        fail("inline blob size does not match the manifest", blob_bytes=size, expected=manifest.total_bytes)
    needs_gpu = any(r.device is DeviceKind.CUDA for r in manifest.regions)
    if needs_gpu and cuda_device is None:
        fail("payload has CUDA tensors but this process has no GPU for them")
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
    return _unpack(manifest, leaves, buffers, copy=False)
