"""The stage model interface: what a deployment plugs in with ``module:factory``.

A factory is called once per rank at start-up as ``factory(stage=StageConfig, pipeline=PipelineConfig)``
and returns a :class:`StageModel`.  The model is called on every rank of the stage group, in a worker
thread (never on the event loop), with the validated job and the payload the previous stage produced
(``None`` for the first stage).  It returns the next stage's payload — a nested structure of tensors
and plain values — or, on the last stage, a :class:`FinalOutput`.  Only the leader's return value is
used; followers compute their shard and return whatever they like.

A model may declare what it reads with an ``input_contract`` attribute (an
:class:`~stageferry.schemas.payload_contract.InputContract`: the conditioning contract ``CONDITIONING``
of the reference diffusion model, or an integration's own, e.g. the diffusers pair's).  The stage's
leader then checks every payload against it before the fan-out, and a violation ends the request
``rejected`` with one field error per entry; the model reads its inputs with ``contract.read``.  What
a model raises itself ends the request as ``errors.OUTCOMES`` says (a
:class:`~stageferry.errors.RejectedError` — bad media, a job it refuses — ``rejected``; an untyped
exception ``failed``).

Writing the output in place: a model that knows its output's shapes before its last ops may call
``ctx.output_tensors(template)`` once — ``template`` is the payload it will return with each tensor
replaced by a description of it (:func:`stageferry.broker.data.staging.blank`, or any tensor of the right
shape, dtype and device) — and write its results into the answer (``out=`` forms, ``copy_``;
:func:`~stageferry.broker.data.staging.write_into` copies the rest), then return the answer.  On the
leader those tensors are the next hop's pool slot, so the put copies nothing; a payload returned with
another layout, or tensors made elsewhere, are copied as usual.  The answer is valid until the model
returns; the stage frees it if the model raises or the request ends otherwise.

Streaming (docs/streaming.md; opt-in, whole-payload models are unaffected): a producer model may hand its
output on in chunks with ``ctx.emit_chunk(chunk)`` — each a payload of its own, put and announced at
once, so the next stage starts on chunk 0 while this one computes chunk 1 — and ``emit_chunk(chunk,
final=True)`` for the last, or return after its last ``emit_chunk`` (a returned payload is then the final
chunk, ``None`` only closes the stream).  A chunk is published while the model computes the next one, so
its tensors are the stage's once emitted: make new ones for the next chunk.  ``emit_chunk`` blocks while the consumer is
``streaming.max_chunks_in_flight`` chunks behind (back-pressure).  A consumer model that sets
``takes_chunks = True`` receives a :class:`~stageferry.stages.entry.streaming.ChunkStream` as its payload when
its producer streams: iterate it (``for chunk in payload``, in the model's thread; ``async for`` from a
coroutine) for the chunks in order; each is valid until the next is asked for.  A whole payload still
comes as itself, so such a model handles both.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from stageferry.broker.data.staging import materialize
from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import ConfigError, JobValidationError, field_error
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.payload_contract import InputContract


@dataclass(frozen=True, slots=True)
class StageContext:
    """What a model may know and do besides computing."""

    stage: str
    rank: int
    world_size: int
    device: torch.device
    request_id: str
    key: str
    output_dir: Path
    #: ``report_progress(step, total)`` after each step; ``report_progress(step, total, phase="decode")``
    #: for work after the steps (a decode, a mux), which the status and the console then name.
    report_progress: Callable[..., None] = lambda step, total, phase=None: None
    is_cancelled: Callable[[], bool] = lambda: False
    process_group: Any = None
    media: dict[str, bytes] = field(default_factory=dict)
    #: Every dimension's group of the stage's layout (``tp``/``sp`` or ``shard``/``replicate``, and
    #: ``world``; ``None`` for a dimension of size 1) and this rank's index along each.  ``process_group``
    #: is the TP group (the HSDP shard group); ``tp_rank``/``tp_size`` are this rank's place in it (they
    #: default to ``rank``/``world_size``, which is what they are in a 1-D TP group).
    groups: Mapping[str, Any] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)
    tp_rank: int = -1
    tp_size: int = 0
    #: ``output_tensors(template)``: the tensors to write this stage's output payload into, laid out as
    #: ``template`` describes (see the module docstring).  On the leader of a stage whose output goes over
    #: NIXL they live in a registered pool slot and the hand-on copies nothing; elsewhere (followers, the
    #: last stage, inline payloads, a full pool) they are ordinary fresh tensors.  Call it from the model.
    output_tensors: Callable[[Any], Any] = materialize
    #: ``emit_chunk(payload, final=False)``: hand the next stage one chunk of the output now (see the module
    #: docstring).  On followers a no-op (only the leader's chunks are used).
    emit_chunk: Callable[..., None] = lambda payload, final=False: None

    def __post_init__(self) -> None:
        if self.tp_size == 0:
            object.__setattr__(self, "tp_rank", self.rank)
            object.__setattr__(self, "tp_size", self.world_size)


@dataclass(frozen=True, slots=True)
class FinalOutput:
    """The last stage's result: bytes to store and/or a file written under the output directory."""

    data: bytes | None = None
    path: Path | None = None
    media: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class StageModel(Protocol):
    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any: ...


ModelFactory = Callable[..., StageModel]


def input_contract_of(model: Any) -> InputContract | None:
    """The contract a model declares for its input payload (``model.input_contract``), if any."""
    contract = getattr(model, "input_contract", None)
    if contract is not None and not isinstance(contract, InputContract):
        raise ConfigError(
            f"input_contract of {type(model).__name__} must be an InputContract (id, check), got "
            f"{type(contract).__name__}"
        )
    return contract


def takes_chunks(model: Any) -> bool:
    """Whether ``model`` takes a streamed payload as chunks (``takes_chunks = True``)."""
    return getattr(model, "takes_chunks", False) is True


def refuse_task(job: JobRequest, tasks: Collection[Task], *, model: str) -> None:
    """Refuse a job whose task ``model`` does not serve, naming the field (``rejected``, ``invalid_job``)."""
    if job.task not in tasks:
        served = ", ".join(t.value for t in Task if t in tasks)
        message = f"{model} does not generate {job.task.value} (it serves {served})"
        raise JobValidationError(f"invalid job: task: {message}", [field_error("task", message, "unsupported_task")])


def load_model(stage: StageConfig, pipeline: PipelineConfig) -> StageModel:
    """Import ``stage.model`` (``module:factory``) and build the model; failures are config errors."""
    module_name, _, attr = stage.model.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load model {stage.model!r}: {exc}", model=stage.model) from exc
    model = factory(stage=stage, pipeline=pipeline)
    if not callable(model):
        raise ConfigError(f"factory {stage.model!r} returned a non-callable", model=stage.model)
    return model
