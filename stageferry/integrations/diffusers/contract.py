"""The diffusers pair's payload contracts: the pipeline's own precomputed conditioning, one contract per
family, checked by the diffusion stage's leader before the fan-out like the reference contract.

A payload is a flat dict.  Each tensor entry has accepted dtypes and a shape of fixed sizes and symbols:
a symbol is one size across entries (``L`` text positions in the embeddings and the mask), bounded, or
given by the job (``b``: 2 rows, negative then positive prompt, when the pipeline runs classifier-free
guidance, else 1).  Float entries must be finite, integer ones inside their range.  A violation ends the
request ``rejected`` with code ``payload_contract`` and one field error per entry, as
:class:`stageferry.errors.PayloadContractError` says.

Version history: 1 — first version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stageferry.errors import PayloadContractError
from stageferry.schemas import JobRequest, Task

CONTRACT_VERSION = 1
MAX_TOKENS = 16_384
MAX_WIDTH = 65_536
MAX_IMAGE_SIDE = 8_192
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_MAX_ERRORS = 20


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor: ``shape`` holds ints (fixed) and symbols; ``needed(job)`` says whether it must be there."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    shape: tuple[int | str, ...]
    doc: str
    needed: Callable[[JobRequest, bool], bool] = lambda job, cfg: True
    values: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class DiffusersContract:
    """A family's contract; ``guided(job)`` says whether the consumer's pipeline runs CFG for the job."""

    family: str
    entries: tuple[Entry, ...]
    plain: Mapping[str, type]
    bounds: Mapping[str, tuple[int, int]]
    guided: Callable[[JobRequest], bool]
    #: Bounds of plain ints (what the consumer allocates or passes on from them), inclusive.
    ranges: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"stageferry.diffusers.{self.family}/{CONTRACT_VERSION}"

    def check(self, job: JobRequest, payload: Any) -> dict[str, Any]:
        """The payload, or a :class:`PayloadContractError` naming every violation (up to 20)."""
        if not isinstance(payload, Mapping):
            raise PayloadContractError.of([("payload", "expected a dict of entries", "type")], contract=self.id)
        errors: list[tuple[str, str, str]] = []
        family = payload.get("family")
        if family != self.family:
            errors.append(("family", f"{str(family)[:32]!r} is not this stage's {self.family!r}", "value"))
        task = payload.get("task")
        if task != job.task.value:
            errors.append(("task", f"{str(task)[:32]!r} is not the job's task {job.task.value!r}", "value"))
        cfg = self.guided(job)
        sizes: dict[str, tuple[int, str]] = {"b": (2 if cfg else 1, "the job's guidance")}
        for entry in self.entries:
            value = payload.get(entry.name)
            if value is None:
                if entry.needed(job, cfg):
                    errors.append((entry.name, "missing", "missing"))
                continue
            self._tensor(entry, value, sizes, errors)
        for name, kind in self.plain.items():
            if name not in payload:
                continue
            value = payload[name]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                errors.append((name, f"expected {kind.__name__}, got {type(value).__name__}", "type"))
            elif name in self.ranges and isinstance(value, int):
                low, high = self.ranges[name]
                if not low <= value <= high:
                    errors.append((name, f"{str(value)[:24]} is outside {low}..{high}", "value"))
        known = {e.name for e in self.entries} | set(self.plain) | {"family", "task"}
        errors += [(str(k)[:64], "is not an entry of this contract", "unknown") for k in payload if k not in known]
        if errors:
            raise PayloadContractError.of(errors[:_MAX_ERRORS], contract=self.id)
        return dict(payload)

    def _tensor(
        self, entry: Entry, value: Any, sizes: dict[str, tuple[int, str]], errors: list[tuple[str, str, str]]
    ) -> None:
        name = entry.name
        if not isinstance(value, torch.Tensor):
            errors.append((name, f"expected a tensor, got {type(value).__name__}", "type"))
            return
        if value.dtype not in entry.dtypes:
            want = ", ".join(str(d).removeprefix("torch.") for d in entry.dtypes)
            errors.append((name, f"expected dtype {want}, got {str(value.dtype).removeprefix('torch.')}", "dtype"))
            return
        if value.dim() != len(entry.shape):
            errors.append((name, f"expected rank {len(entry.shape)}, got {value.dim()}", "rank"))
            return
        for i, (dim, size) in enumerate(zip(entry.shape, value.shape, strict=True)):
            where = f"dimension {i} ({dim})"
            if isinstance(dim, int):
                if size != dim:
                    errors.append((name, f"{where} must be {dim}, got {size}", "shape"))
                    return
            elif dim in sizes:
                if size != sizes[dim][0]:
                    errors.append((name, f"{where} must be {sizes[dim][0]} as in {sizes[dim][1]}, got {size}", "shape"))
                    return
            else:
                lo, hi = self.bounds[dim]
                if not lo <= size <= hi:
                    errors.append((name, f"{where} must be in {lo}..{hi}, got {size}", "shape"))
                    return
                sizes[dim] = (size, name)
        if value.numel() == 0:
            return
        if value.is_floating_point() and not bool(torch.isfinite(value.sum(dtype=torch.float64))):
            errors.append((name, "has non-finite values (NaN or infinity)", "value"))
        elif entry.values is not None:
            lo, hi = (int(v) for v in torch.aminmax(value))
            if lo < entry.values[0] or hi > entry.values[1]:
                errors.append((name, f"values must be in {entry.values[0]}..{entry.values[1]}", "value"))


def _i2va(job: JobRequest, _cfg: bool) -> bool:
    return job.task is Task.I2VA


def _guided(job: JobRequest, cfg: bool) -> bool:
    return cfg


_BOUNDS = {"L": (1, MAX_TOKENS), "n": (1, MAX_TOKENS), "m": (1, MAX_TOKENS), "D": (1, MAX_WIDTH), "A": (1, MAX_WIDTH)}
_BOUNDS |= {"h": (1, MAX_IMAGE_SIDE), "w": (1, MAX_IMAGE_SIDE)}


def ltx2_contract(guided: Callable[[JobRequest], bool]) -> DiffusersContract:
    """LTX-2: the text connectors' outputs (the encoder stage runs Gemma 3 and the connectors), the first
    frame's pixels for i2va (the pipeline encodes them with the VAE the diffusion stage holds)."""
    entries = (
        Entry("prompt_embeds", FLOATS, ("b", "L", "D"), "video text embeddings (connector output), [neg,] pos"),
        Entry("audio_prompt_embeds", FLOATS, ("b", "L", "A"), "audio text embeddings (connector output)"),
        Entry("attention_mask", (torch.int64,), ("b", "L"), "the connectors' mask, 1 = attend", values=(0, 1)),
        Entry("image", (torch.uint8,), ("h", "w", 3), "i2va: the first frame, RGB", needed=_i2va),
    )
    plain = {"image_crf": int, "meta": dict}
    return DiffusersContract("ltx2", entries, plain, _BOUNDS, guided, ranges={"image_crf": (0, 51)})  # x264's CRF


def wan_contract(guided: Callable[[JobRequest], bool], width: int) -> DiffusersContract:
    """Wan: the UMT5 embeddings of the prompt and negative prompt, trailing padding dropped (the consumer
    pads them back with zeros to ``max_sequence_length``, which is what the pipeline's own padding is)."""
    entries = (
        Entry("prompt_embeds", FLOATS, ("n", width), "prompt embeddings, padding dropped"),
        Entry("negative_prompt_embeds", FLOATS, ("m", width), "negative prompt embeddings (CFG)", needed=_guided),
    )
    plain = {"max_sequence_length": int, "meta": dict}  # the consumer pads to it: bounded as token counts are
    return DiffusersContract("wan", entries, plain, _BOUNDS, guided, ranges={"max_sequence_length": (1, MAX_TOKENS)})
