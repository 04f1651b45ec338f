"""Aggregated mode: one stage group runs every stage's model, handing each payload over in process.

``mode = "aggregated"`` in the pipeline file folds the declared stages (encoder TP2, diffusion TP4) into
one served stage whose model is this one (see :class:`stageferry.config.PipelineConfig`).  Its group has
the largest part's layout by default (TP4), and every rank runs, per request:

1. each part's model on the part's own ranks — the first ``part.world_size`` ranks of the group, in the
   part's own layout (TP2 on ranks 0-1 for the encoder) — so each part computes exactly what its own
   group computes in the disaggregated pipeline (the reference encoder's float reductions depend on its
   TP size; running it on a TP2 subgroup, with the same threads per rank, gives the same bits);
2. one all-reduce of a failure flag over the whole group, so a part that fails on any rank fails the
   request on the leader (with the leader's typed error) instead of leaving ranks waiting;
3. the hand-over: the part's rank 0 (the group leader) checks its output against the next part's
   declared input contract (as a consumer leader does before its fan-out), packs it into local memory and
   broadcasts the regions to the other ranks, exactly as a consumer leader fans out a payload it got
   over NIXL; every rank — the leader too — computes on views of the same packed bytes.  No connector,
   no Redis entry, no NIXL transfer: the leader's connector counters stay at zero.

The last part's :class:`FinalOutput` (rank 0) gets ``info["aggregated"]``: the parts, their seconds, the
hand-over's bytes and seconds.  Part factories see the pipeline as declared
(:meth:`PipelineConfig.disaggregated`), so they are the unchanged stage models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from stageferry.broker.data.payload_codec import unpack
from stageferry.broker.data.staging import materialize
from stageferry.config import GroupLayout, Mode, PipelineConfig, StageConfig
from stageferry.errors import ConfigError, StageFailedError
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_contract import InputContract
from stageferry.stages.group.grid import build_channel
from stageferry.stages.group.group import cpu_threads, pack_payload, placement
from stageferry.stages.group.group_channel import GroupChannel, MessageKind
from stageferry.stages.model import FinalOutput, StageContext, StageModel, input_contract_of, load_model

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Part:
    stage: StageConfig
    model: StageModel
    channel: GroupChannel | None  #: ``None`` on ranks outside the part


@dataclass(frozen=True, slots=True)
class _Group:
    """The parts as placed on this rank, and a channel over the whole group for flags and hand-overs."""

    parts: tuple[_Part, ...]
    world: GroupChannel


class Aggregated:
    """Runs ``stage.parts`` in order on every rank of the group (see the module docstring)."""

    def __init__(self, stage: StageConfig, pipeline: PipelineConfig) -> None:
        if not stage.parts:
            raise ConfigError(f"stage {stage.name!r} runs the aggregated model but has no parts", stage=stage.name)
        declared = pipeline.model_copy(update={"mode": Mode.DISAGGREGATED, "stages": stage.parts})
        self.stage = stage
        self.models = [load_model(part, declared) for part in stage.parts]
        self.contracts = [input_contract_of(model) for model in self.models]
        #: The first part's: the stage's worker checks incoming payloads against it.
        self.input_contract: InputContract | None = self.contracts[0]
        self._group: _Group | None = None

    def group(self, ctx: StageContext) -> _Group:
        """The parts' subgroups, built on the first request.  Creating process groups is collective; every
        rank runs the model at the same time, so every rank builds them here, in the same order."""
        if self._group is None:
            parts = tuple(
                _Part(part, model, build_channel(part.layout, ctx.rank, ctx.device))
                for part, model in zip(self.stage.parts, self.models, strict=True)
            )
            world = build_channel(GroupLayout(tp=ctx.world_size), ctx.rank, ctx.device)
            assert world is not None
            self._group = _Group(parts, world)
        return self._group

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        group = self.group(ctx)
        output: Any = None
        seconds: dict[str, float] = {}
        handed: list[dict[str, float | int]] = []
        for i, part in enumerate(group.parts):
            last = i + 1 == len(group.parts)
            started = time.perf_counter()
            contract = None if last else self.contracts[i + 1]
            output, packed, error = self._run_part(part, job, payload, ctx, pack=not last, contract=contract)
            if group.world.any_failed(error is not None):
                if error is not None:
                    raise error
                raise StageFailedError(f"{part.stage.name}: another rank of the group failed", stage=part.stage.name)
            seconds[part.stage.name] = round(time.perf_counter() - started, 6)
            if not last:
                started = time.perf_counter()
                payload, nbytes = _hand_over(group.world, packed)
                handed.append({"bytes": nbytes, "seconds": round(time.perf_counter() - started, 6)})
                log.info("aggregated.handover", from_part=part.stage.name, bytes=nbytes, seconds=handed[-1]["seconds"])
        if isinstance(output, FinalOutput):
            info = {"parts": [p.stage.name for p in group.parts], "seconds": seconds, "handovers": handed}
            output = dataclasses.replace(output, info={**output.info, "aggregated": info})
        return output

    def _run_part(
        self,
        part: _Part,
        job: JobRequest,
        payload: Any,
        ctx: StageContext,
        *,
        pack: bool,
        contract: InputContract | None = None,
    ) -> tuple[Any, Any, Exception | None]:
        """Run one part on this rank (if it is one of the part's) and, on the leader, check its output
        against the next part's ``contract`` and pack it."""
        if part.channel is None:
            return None, None, None
        try:
            with _threads(ctx.device, part.stage.world_size):
                part_ctx = dataclasses.replace(
                    ctx,
                    stage=part.stage.name,
                    # only the last part's output leaves the group: the others' go to plain tensors
                    output_tensors=materialize if pack else ctx.output_tensors,
                    **placement(part.channel),
                )
                output = part.model(job, payload, part_ctx)
            if contract is not None and ctx.rank == 0:
                contract.check(job, output)
            packed = pack_payload(output) if pack and ctx.rank == 0 and output is not None else None
            return output, packed, None
        except Exception as exc:  # agreed on by the whole group before anyone moves on
            return None, None, exc


def _hand_over(world: GroupChannel, packed: Any) -> tuple[Any, int]:
    """The leader's packed output to every rank, as views of the same bytes on each (the leader's own
    buffers included); ``(payload, bytes)``."""
    if world.rank == 0:
        manifest, buffers = packed if packed is not None else (None, None)
        world.send(MessageKind.JOB, {}, manifest=manifest, buffers=buffers)
    else:  # the channel unpacked it (a kept frame's payload holds until the next hand-over)
        message = world.receive()
        return message.payload, message.manifest.total_bytes if message.manifest is not None else 0
    if manifest is None or buffers is None:
        return None, 0
    return unpack(manifest, buffers, copy=False), manifest.total_bytes


@contextlib.contextmanager
def _threads(device: torch.device, ranks: int) -> Iterator[None]:
    """CPU ranks run a part with the threads its own group would have (the same kernels, the same bits)."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(ranks))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> Aggregated:
    """The model of an aggregated stage (``mode = "aggregated"``): its parts' models, in process."""
    return Aggregated(stage, pipeline)
