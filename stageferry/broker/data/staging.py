"""Output templates: how a producer model asks for the tensors it will write its payload into.

A model that knows its output's shapes before computing the last op can ask its stage for the output
tensors (:meth:`stageferry.stages.model.StageContext.output_tensors`) and write its results straight
into them; on a NIXL leader they are views over a registered pool slot, so the put copies nothing
(:mod:`stageferry.broker.data.nixl.staged_outputs`).  Everywhere else (followers, the inline connector, a
full pool) they are ordinary tensors and the put copies as before.

The request is a *template*: the payload's structure (dicts, lists, tuples, plain values) whose tensor
leaves *describe* the wanted tensors — only their shape, dtype and device are read.  :func:`blank` makes
such a description without allocating the tensor; a real tensor in a template (e.g. a small one the model
already has) describes itself and is not read either.

Who calls what:

* connectors: :func:`materialize` for the ordinary-tensor answer; :func:`describe` to plan a template;
* models: :func:`blank` to build a template, :func:`write_into` to put the tensors they did not write
  with ``out=`` into the answer (a ``copy_`` each, skipped for tensors that already are the answer's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Template = Any
"""A payload structure whose tensor leaves describe the output tensors (shape, dtype, device)."""


def blank(
    shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A template leaf: a tensor of ``shape``/``dtype``/``device`` backed by one element (zero strides).

    Cheap whatever the shape; never write into it (every element is the same memory)."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape))


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with every tensor leaf replaced by ``fn(leaf)`` (dicts, lists and tuples rebuilt)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple):
        return tuple(map_tensors(v, fn) for v in tree)
    return tree


def materialize(template: Template) -> Any:
    """The ordinary answer to a template: fresh, uninitialised tensors of the described shapes."""
    return map_tensors(template, lambda t: torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device))


def describe(template: Template) -> Any:
    """``template`` with every tensor leaf replaced by a :func:`blank` of it, so that planning it
    (:func:`~stageferry.broker.data.payload_plan.plan_payload`) reads no tensor memory."""
    return map_tensors(template, lambda t: blank(t.shape, t.dtype, t.device))


def is_same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b``'s memory with ``b``'s layout (a view of it, or it), so nothing needs copying."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and (a.numel() == 0 or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()))
    )


def write_into(out: Any, source: Any) -> Any:
    """Copy ``source``'s tensors into the matching tensors of ``out`` (same structure) and return ``out``.

    A source tensor that already is its ``out`` tensor (written with ``out=``) is skipped; dtypes are
    converted by ``copy_``.  Plain values are taken from ``out`` (the template fixed them)."""
    if isinstance(out, torch.Tensor):
        if not isinstance(source, torch.Tensor):
            raise TypeError(f"expected a tensor to write into the output, got {type(source).__name__}")
        if out.numel() and not is_same_tensor(source, out):
            with torch.no_grad():
                out.copy_(source)
        return out
    if isinstance(out, dict):
        for k, v in out.items():
            write_into(v, source[k])
    elif isinstance(out, list | tuple):
        if len(out) != len(source):
            raise TypeError("the source's structure differs from the output's")
        for o, s in zip(out, source, strict=True):
            write_into(o, s)
    return out
