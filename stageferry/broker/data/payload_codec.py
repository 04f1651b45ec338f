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
from collections.abc import Mapping, Sequence
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
    "PackPlan",
    "decode_inline",
    "encode_inline",
    "pack_into",
    "plan_payload",
    "unpack",
    "validate_manifest",
    "validate_remote_regions",
]

_MAX_ITEMSIZE = max(ITEMSIZE.values())


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


def _views(leaves: Sequence[Leaf], buffers: Mapping[DeviceKind, torch.Tensor], *, bits: bool) -> list[torch.Tensor]:
    """The tensors ``leaves`` describe, as views over ``buffers`` (checked by ``_check_buffers``): each as
    its own dtype, or with ``bits`` as the integer dtype of its width.

    Each buffer is viewed as each dtype once, and each tensor is one ``as_strided`` of that view (one
    torch call per tensor).  ``as_strided`` is bounded by the whole pool, not the slot, so every view is
    checked to end inside its buffer, although the manifest's checks already guarantee it."""
    typed: dict[tuple[DeviceKind, torch.dtype], torch.Tensor] = {}
    views = []
    for leaf in leaves:
        dtype = leaf.bits if bits else leaf.dtype
        buf = buffers[leaf.device]
        if leaf.count == 0:
            views.append(torch.empty(leaf.shape, dtype=dtype, device=buf.device))
            continue
        whole = typed.get((leaf.device, dtype))
        if whole is None:
            size, n = dtype.itemsize, buf.numel()
            whole = typed[leaf.device, dtype] = (buf if n % size == 0 else buf[: n - n % size]).view(dtype)
        if leaf.start + leaf.count > whole.numel():
            raise ManifestError("tensor extends beyond its buffer", start=leaf.start, count=leaf.count)
        views.append(whole.as_strided(leaf.shape, leaf.strides, whole.storage_offset() + leaf.start))
    return views


def pack_into(plan: PackPlan, buffers: Mapping[DeviceKind, torch.Tensor]) -> None:
    """Copy every tensor of ``plan`` into its region's buffer (one copy, strided sources included).

    A buffer may live elsewhere than its kind says (:func:`encode_inline` stages CUDA leaves in host
    memory).  CUDA destinations are synchronised before returning: a NIXL READ does not wait on streams.
    """
    manifest = plan.manifest
    _check_buffers(manifest, buffers)
    with torch.no_grad():
        for leaf, dest, src in zip(plan.leaves, _views(plan.leaves, buffers, bits=True), plan.tensors, strict=True):
            if leaf.count:
                dest.copy_(src.resolve_neg().resolve_conj().view(leaf.bits))
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


def _unpack(manifest: Manifest, leaves: Sequence[Leaf], buffers: Mapping[DeviceKind, torch.Tensor], copy: bool) -> Any:
    _check_buffers(manifest, buffers)
    views = _views(leaves, buffers, bits=False)
    if copy:
        views = [view.clone() if leaf.count else view for leaf, view in zip(leaves, views, strict=True)]
    return _build(manifest.tree, views)


def unpack(manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor], *, copy: bool) -> Any:
    """Rebuild the payload over ``buffers`` (one per region kind, e.g. pool slot views).

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
