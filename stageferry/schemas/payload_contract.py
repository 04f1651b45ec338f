"""The encoder → diffusion payload contract: every entry a conditioning payload holds, and its rules.

One definition, used three ways: a producer builds its payload with :func:`build_payload`; the
consumer stage's leader checks a fetched payload with :meth:`PayloadContract.check` *before* it fans the
payload out to its ranks (a violation ends the request ``rejected`` with one field error per entry, e.g.
``text.hidden_states: expected rank 2, got 3``); and a diffusion model reads its inputs through
:meth:`PayloadContract.read`, which gives them typed, with absent optional entries filled in.  The
table in ``docs/payload-contract.md`` and ``stageferry schema payload`` are rendered from it
(:mod:`stageferry.schemas.payload_contract_doc`).

Each tensor entry has a name (a dotted path into the payload dict), accepted dtypes, a shape whose
dimensions are *fixed* (a constant of the latent geometry), *job* (they follow from the job: frames,
size, audio seconds — see :class:`~stageferry.schemas.payload_layout.Layout`) or *free* (the
producer's choice within bounds; one free symbol is one size across entries, e.g. ``n`` text tokens),
and the tasks that require it.  Float entries must be finite.  Entries the contract does not name are
passed to the model untouched, so a plug-in pair may carry more.

Version history: 1 — first version (layout version 1).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from stageferry.errors import PayloadContractError
from stageferry.schemas.job import JobRequest, Task
from stageferry.schemas.payload import DType
from stageferry.schemas.payload_layout import (
    AUDIO_BANDS,
    HEADER,
    LATENT_CHANNELS,
    LAYOUT_VERSION,
    SPATIAL,
    Layout,
)

CONTRACT_NAME = "stageferry.conditioning"
CONTRACT_VERSION = 1
MAX_TEXT_TOKENS = 16_384
MAX_HIDDEN = 65_536  #: text hidden size a consumer accepts (it sizes the consumer's projection)
MAX_REFERENCE_LATENT_FRAMES = 4_096
MAX_REFERENCE_AUDIO_LATENTS = 65_536  #: about 22 minutes of reference audio
ROLE_SPECIAL, ROLE_TEXT, ROLE_NEGATIVE = 0, 1, 2  #: ``text.role_ids`` values
_MAX_ERRORS = 20
FLOATS = (DType.BFLOAT16, DType.FLOAT16, DType.FLOAT32)
ALL_TASKS = frozenset(Task)


class DimKind(enum.StrEnum):
    """Where a dimension's size comes from."""

    FIXED = "fixed"  #: a constant of the latent geometry
    JOB = "job"  #: follows from the job (task, frames, size, audio seconds)
    FREE = "free"  #: the producer's choice within bounds; one symbol is one size across entries


@dataclass(frozen=True, slots=True)
class Dim:
    """One dimension of an entry's shape; ``bounds`` gives the inclusive range for a job's layout."""

    symbol: str
    kind: DimKind
    rule: str
    bounds: Callable[[Layout], tuple[int, int]]


def fixed(value: int) -> Dim:
    return Dim(str(value), DimKind.FIXED, str(value), lambda _layout: (value, value))


def free(symbol: str, rule: str, hi: int, lo: int = 1) -> Dim:
    return Dim(symbol, DimKind.FREE, f"{rule}, {lo}..{hi}", lambda _layout: (lo, hi))


def from_job(symbol: str, rule: str, bounds: Callable[[Layout], tuple[int, int]]) -> Dim:
    return Dim(symbol, DimKind.JOB, rule, bounds)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of the payload.  ``required`` are the tasks that need it; an absent optional entry
    means ``default(layout)``."""

    name: str
    dtypes: tuple[DType, ...]
    shape: tuple[Dim, ...]
    doc: str
    required: frozenset[Task] = ALL_TASKS
    values: tuple[int, int] | None = None  #: integer entries: every value in this inclusive range
    default: Callable[[Layout], torch.Tensor] | None = None


@dataclass(frozen=True, slots=True)
class PlainEntry:
    """A small plain value (never required)."""

    name: str
    kind: type
    doc: str


@dataclass(frozen=True, slots=True)
class Conditioning:
    """A payload as the contract reads it: tensors as sent (their device, their dtype), absent optional
    entries filled in, and the entries the contract does not name in ``extras``."""

    layout: Layout
    hidden_states: torch.Tensor  #: [n, hidden]
    role_ids: torch.Tensor  #: [n] int64
    visual_latents: torch.Tensor  #: [k, 16, t, H/8, W/8]
    audio_latents: torch.Tensor  #: [1, 64, m]
    audio_style: torch.Tensor  #: [1, 64]
    extras: dict[str, Any] = field(default_factory=dict)


def _k(layout: Layout) -> tuple[int, int]:
    return {Task.FL2VA: (2, 2), Task.REF2VA: (0, 1)}.get(layout.task, (0, 0))


def _t(layout: Layout) -> tuple[int, int]:
    return (1, 1) if layout.task is Task.FL2VA else (0, MAX_REFERENCE_LATENT_FRAMES)


def _m(layout: Layout) -> tuple[int, int]:
    return (0, MAX_REFERENCE_AUDIO_LATENTS) if layout.task is Task.REF2VA else (0, 0)


def _layout_len(layout: Layout) -> tuple[int, int]:
    n = HEADER + len(layout.keyframes)
    return (n, n)


TOKENS = free("n", "text tokens (prompt, then negative prompt)", MAX_TEXT_TOKENS)
TENSORS: tuple[TensorEntry, ...] = (
    TensorEntry(
        "text.hidden_states",
        FLOATS,
        (TOKENS, free("hidden", "text hidden size: the encoder's own", MAX_HIDDEN)),
        "text encoder states, prompt tokens then negative-prompt tokens",
    ),
    TensorEntry(
        "text.role_ids",
        (DType.INT64,),
        (TOKENS,),
        "per token: 0 special (BOS/EOS), 1 prompt, 2 negative prompt; at least one 0 or 1",
        values=(ROLE_SPECIAL, ROLE_NEGATIVE),
    ),
    TensorEntry(
        "visual_latents",
        FLOATS,
        (
            from_job("k", "t2va: 0; fl2va: 2 (first, last frame); ref2va: 0 or 1 (reference video)", _k),
            fixed(LATENT_CHANNELS),
            from_job("t", f"fl2va: 1; else latent frames of the reference, 0..{MAX_REFERENCE_LATENT_FRAMES}", _t),
            from_job("h", f"height / {SPATIAL}", lambda lay: (lay.latent_height, lay.latent_height)),
            from_job("w", f"width / {SPATIAL}", lambda lay: (lay.latent_width, lay.latent_width)),
        ),
        "VAE latents of the media: first and last frame (fl2va), reference video (ref2va)",
        required=frozenset({Task.FL2VA}),
        default=lambda lay: torch.zeros(0, LATENT_CHANNELS, lay.latent_frames, lay.latent_height, lay.latent_width),
    ),
    TensorEntry(
        "audio_latents",
        FLOATS,
        (
            fixed(1),
            fixed(AUDIO_BANDS),
            from_job(
                "m", f"ref2va: reference audio latent frames (50 per s), 0..{MAX_REFERENCE_AUDIO_LATENTS}; else 0", _m
            ),
        ),
        "audio latents of the reference audio (ref2va)",
        required=frozenset(),
        default=lambda _lay: torch.zeros(1, AUDIO_BANDS, 0),
    ),
    TensorEntry(
        "audio_style",
        FLOATS,
        (fixed(1), fixed(AUDIO_BANDS)),
        "mean of the reference audio latents; zeros without reference audio",
        required=frozenset(),
        default=lambda _lay: torch.zeros(1, AUDIO_BANDS),
    ),
    TensorEntry(
        "layout",
        (DType.INT64,),
        (from_job("L", f"{HEADER} + keyframes: {HEADER + 2} for fl2va, {HEADER} otherwise", _layout_len),),
        f"layout metadata version {LAYOUT_VERSION}: equal to the job's (see below)",
    ),
)
PLAIN: tuple[PlainEntry, ...] = (
    PlainEntry("task", str, "the job's task; if present it must be the job's"),
    PlainEntry("seed", int, "informational"),
    PlainEntry("meta", dict, "informational plain values (encoder name, token counts, layout facts)"),
)


@runtime_checkable
class InputContract(Protocol):
    """What a consumer model's ``input_contract`` is: an id for logs and errors, and a check its stage's
    leader runs on every fetched payload before the fan-out, raising :class:`PayloadContractError` (one
    field error per violation).  :class:`PayloadContract` is one; an integration may bring its own."""

    @property
    def id(self) -> str: ...

    def check(self, job: JobRequest, payload: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class PayloadContract:
    """A versioned payload contract; see the module docstring."""

    name: str
    version: int
    tensors: tuple[TensorEntry, ...]
    plain: tuple[PlainEntry, ...]

    @property
    def id(self) -> str:
        return f"{self.name}/{self.version}"

    def check(self, job: JobRequest, payload: Any, *, values: bool = True) -> Conditioning:
        """The payload read through the contract, or a :class:`PayloadContractError` with every
        violation (up to 20).  ``values=False`` skips the scans over tensor values (finite floats,
        role ids in range) — for a model whose runtime has already checked the payload in full."""
        errors: list[tuple[str, str, str]] = []
        if not isinstance(payload, Mapping):
            error = ("payload", f"expected a dict of entries, got {_kind(payload)}", "type")
            raise PayloadContractError.of([error], contract=self.id)
        text = payload.get("text")
        if not isinstance(text, Mapping):
            errors.append(("text", f"expected a dict with hidden_states and role_ids, got {_kind(text)}", "type"))
            text = {}
        layout = _layout(job, payload.get("layout"), errors)
        got: dict[str, torch.Tensor] = {}
        bound: dict[str, tuple[int, str]] = {}
        for entry in self.tensors:
            if any(e[0] == entry.name for e in errors):
                continue  # already refused (the layout, while parsing it)
            value = _lookup(payload, text, entry.name)
            if value is None:
                if job.task in entry.required:
                    need = "required" if entry.required == ALL_TASKS else f"required for {job.task.value}"
                    errors.append((entry.name, f"missing ({need})", "missing"))
                continue
            if _check_tensor(entry, value, layout, bound, errors, values=values):
                got[entry.name] = value
        if values and "text.role_ids" in got and not bool((got["text.role_ids"] != ROLE_NEGATIVE).any()):
            errors.append(("text.role_ids", "no prompt token (every role is 2, negative prompt)", "value"))
        task = payload.get("task")
        if isinstance(task, str) and task != job.task.value:
            errors.append(("task", f"{str(task)[:32]!r} is not the job's task {job.task.value!r}", "value"))
        for plain in self.plain:
            if plain.name in payload and not isinstance(payload[plain.name], plain.kind):
                errors.append((plain.name, f"expected {plain.kind.__name__}, got {_kind(payload[plain.name])}", "type"))
        if errors:
            raise PayloadContractError.of(errors[:_MAX_ERRORS], contract=self.id)
        return self._read(layout, payload, got)

    def read(self, job: JobRequest, payload: Any) -> Conditioning:
        """What a model calls: the structural checks only (its runtime scanned the values already)."""
        return self.check(job, payload, values=False)

    def _read(self, layout: Layout, payload: Mapping[str, Any], got: dict[str, torch.Tensor]) -> Conditioning:
        device = got["text.hidden_states"].device
        filled = dict(got)
        for e in self.tensors:
            if e.name not in filled and e.default is not None:
                filled[e.name] = e.default(layout).to(device)
        named = {e.name.split(".")[0] for e in self.tensors} | {p.name for p in self.plain}
        return Conditioning(
            layout=layout,
            hidden_states=filled["text.hidden_states"],
            role_ids=filled["text.role_ids"],
            visual_latents=filled["visual_latents"],
            audio_latents=filled["audio_latents"],
            audio_style=filled["audio_style"],
            extras={k: v for k, v in payload.items() if k not in named},
        )


def _kind(value: Any) -> str:
    return type(value).__name__


def _lookup(payload: Mapping[str, Any], text: Mapping[str, Any], name: str) -> Any:
    return text.get(name.removeprefix("text.")) if name.startswith("text.") else payload.get(name)


def _layout(job: JobRequest, value: Any, errors: list[tuple[str, str, str]]) -> Layout:
    """The job's layout, which the other entries are checked against (so that their errors are reported
    too); the payload's own ``layout`` is parsed and compared with it, any difference appended."""
    expected = Layout.for_job(job)
    if value is None:
        return expected  # reported as missing by the entry loop
    try:
        layout = Layout.from_tensor(value)
    except PayloadContractError as exc:
        errors.extend((e["field"], e["message"], e["type"]) for e in exc.field_errors)
        return expected
    if layout != expected:
        diff = [k for k, v in layout.plain().items() if expected.plain()[k] != v]
        errors.append(("layout", f"does not match the job ({', '.join(diff)} differ)", "layout"))
    return expected


def _check_tensor(
    entry: TensorEntry,
    value: Any,
    layout: Layout,
    bound: dict[str, tuple[int, str]],
    errors: list[tuple[str, str, str]],
    *,
    values: bool,
) -> bool:
    """Type, dtype, rank, every dimension, then (``values``) finiteness and value range."""
    name = entry.name
    if not isinstance(value, torch.Tensor):
        errors.append((name, f"expected a tensor, got {_kind(value)}", "type"))
        return False
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in entry.dtypes:
        errors.append((name, f"expected dtype {_one_of(entry.dtypes)}, got {dtype}", "dtype"))
        return False
    if value.dim() != len(entry.shape):
        errors.append((name, f"expected rank {len(entry.shape)}, got {value.dim()}", "rank"))
        return False
    ok = True
    for i, (dim, size) in enumerate(zip(entry.shape, value.shape, strict=True)):
        lo, hi = dim.bounds(layout)
        where = f"dimension {i} ({dim.symbol})"
        if dim.kind is DimKind.FREE and dim.symbol in bound and bound[dim.symbol][0] != size:
            size0, first = bound[dim.symbol]
            errors.append((name, f"{where} must be {size0} as in {first}, got {size}", "shape"))
            ok = False
        elif not lo <= size <= hi:
            want = str(lo) if lo == hi else f"in {lo}..{hi}"
            errors.append((name, f"{where} must be {want} for this job, got {size}", "shape"))
            ok = False
        elif dim.kind is DimKind.FREE:
            bound.setdefault(dim.symbol, (size, name))
    if not ok or not values or value.numel() == 0:
        return ok
    if value.is_floating_point() and not _finite(value):
        errors.append((name, "has non-finite values (NaN or infinity)", "value"))
        return False
    if entry.values is not None:
        lo, hi = (int(v) for v in torch.aminmax(value))
        if lo < entry.values[0] or hi > entry.values[1]:
            errors.append((name, f"values must be in {entry.values[0]}..{entry.values[1]}", "value"))
            return False
    return True


def _finite(value: torch.Tensor) -> bool:
    """Whether every value is finite, in one reduction and no temporary of the tensor's size: a NaN or
    an infinity anywhere makes the float64 sum non-finite, and finite half/bfloat16/float32 values
    cannot overflow a float64 sum (at most 3.4e38 each, far fewer than 1e270 of them)."""
    return bool(torch.isfinite(value.sum(dtype=torch.float64)))


def _one_of(dtypes: tuple[DType, ...]) -> str:
    names = [d.value for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


CONDITIONING = PayloadContract(CONTRACT_NAME, CONTRACT_VERSION, TENSORS, PLAIN)
"""The encoder → diffusion conditioning payload contract (the reference diffusion stage's input)."""


def build_payload(
    job: JobRequest,
    hidden_states: torch.Tensor,
    role_ids: torch.Tensor,
    *,
    visual_latents: torch.Tensor | None = None,
    audio_latents: torch.Tensor | None = None,
    audio_style: torch.Tensor | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A payload that follows :data:`CONDITIONING` for ``job``: the given tensors, the job's layout,
    and every optional entry filled with what its absence means (so the payload is self-describing).
    The consumer checks it; nothing is checked here."""
    layout = Layout.for_job(job)
    defaults = {e.name: e.default for e in TENSORS if e.default is not None}
    given = {"visual_latents": visual_latents, "audio_latents": audio_latents, "audio_style": audio_style}
    tensors = {k: v if v is not None else defaults[k](layout) for k, v in given.items()}
    return {
        "task": job.task.value,
        "text": {"hidden_states": hidden_states, "role_ids": role_ids},
        **tensors,
        "layout": layout.to_tensor(),
        "meta": {**layout.plain(), "contract": CONDITIONING.id, **(meta or {})},
        "seed": job.seed,
    }
