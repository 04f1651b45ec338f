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

from stageferry.broker.data.payload_plan import PackPlan, plan_payload
from stageferry.broker.data.payload_validation import (
    DTYPE_OF,
    ITEMSIZE,
    MANIFEST_ALIGNMENT,
    MAX_ADDRESS,
    MAX_DEVICE_ID,
    MAX_STRING_CHARS,
    TORCH_DTYPE,
    check_structure,
    fail,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.schemas.payload import DeviceKind, Manifest, TensorSpec

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

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
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


class _Views:
    """Typed views of the tensors of one manifest over its region buffers (sizes already validated).

    Each buffer is viewed as each dtype once (``whole``), and each tensor is a slice of that view: two
    torch calls per tensor instead of three.  Offsets are multiples of 64 and sizes whole elements, so the
    slices are exact; a buffer that cannot be viewed as the dtype fails as the per-tensor view would."""

    __slots__ = ("_buffers", "_typed")

    def __init__(self, buffers: Mapping[DeviceKind, torch.Tensor]) -> None:
        self._buffers = buffers
        self._typed: dict[tuple[DeviceKind, torch.dtype], torch.Tensor] = {}

    def of(self, spec: TensorSpec, dtype: torch.dtype) -> torch.Tensor:
        """The tensor ``spec`` describes, viewed as ``dtype`` (its own, or an integer of the same width)."""
        buf = self._buffers[spec.device]
        if spec.nbytes == 0:
            return torch.empty(tuple(spec.shape), dtype=dtype, device=buf.device)
        whole = self._typed.get((spec.device, dtype))
        size = dtype.itemsize
        if whole is None:
            whole = self._typed[spec.device, dtype] = buf[: buf.numel() // size * size].view(dtype)
        return whole[spec.offset // size : (spec.offset + spec.nbytes) // size].view(tuple(spec.shape))


def pack_into(plan: PackPlan, buffers: Mapping[DeviceKind, torch.Tensor]) -> None:
    """Copy every tensor of ``plan`` into its region's buffer (one copy, strided sources included).

    A buffer may live elsewhere than its kind says (:func:`encode_inline` stages CUDA leaves in host
    memory).  CUDA destinations are synchronised before returning: a NIXL READ does not wait on streams.
    """
    manifest = plan.manifest
    _check_buffers(manifest, buffers)
    views = _Views(buffers)
    with torch.no_grad():
        for spec, src in zip(manifest.tensors, plan.tensors, strict=True):
            if spec.nbytes == 0:
                continue
            bits = _BITS_DTYPE[ITEMSIZE[spec.dtype]]
            views.of(spec, bits).copy_(src.resolve_neg().resolve_conj().view(bits))
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
    views = _Views(buffers)
    leaves = []
    for spec in manifest.tensors:
        view = views.of(spec, TORCH_DTYPE[spec.dtype])
        leaves.append(view.clone() if copy and spec.nbytes else view)
    return _build(manifest.tree, leaves)


def unpack(manifest: Manifest, buffers: Mapping[DeviceKind, torch.Tensor], *, copy: bool) -> Any:
    """Rebuild the payload over ``buffers`` (one per region kind, e.g. pool slot views).

    ``copy=False``: tensors are views of the buffers (zero-copy); the caller keeps the buffers (the slots)
    alive and unchanged while the payload is in use.  ``copy=True``: every tensor owns its memory, so the
    buffers may be released at once.  Tensors land on the device of their kind's buffer.  The manifest's
    structure is checked again here (a manifest equal to one already checked costs one key lookup) so
    no unchecked size reaches torch.
    """
    check_structure(manifest)
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
    check_structure(manifest)
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
    return _unpack(manifest, buffers, copy=False)
