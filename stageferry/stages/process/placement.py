"""Stage placement: the device of every rank of every stage group, from the pipeline and the GPU count.

Why a pure function of (pipeline, number of GPUs): a deployment's stages start as separate ``serve``
processes (``up`` starts one per stage, compose one container per stage, each group's supervisor one
process per rank).  Each computes the plan by itself; since nothing else goes in, they agree on who takes
which GPU without talking to each other, and ``stageferry plan`` shows beforehand exactly what they do.

The rule, stage by stage:

1. ``device = "cpu"`` — every rank on the CPU (gloo).  So is ``device = "auto"`` on a host without GPUs.
2. ``devices = [...]`` — taken as written: rank i on GPU ``devices[i]``; each index must exist here.
3. Every other stage is planned in pipeline order, over the GPUs no ``devices`` list took:

   * when the planned groups fit side by side, each takes the next ``world_size`` free GPUs
     (disjoint: TP2 → TP4 on six GPUs is encoder 0–1, diffusion 2–5);
   * otherwise, when each group fits on the host by itself, stages *share* GPUs: each starts where the
     previous one ended and wraps around the host's GPUs (TP1 → TP2 on two GPUs: encoder 0, diffusion
     1 and 0).  The plan lists the shared GPUs, and services log them at start;
   * a group with more ranks than the host has GPUs is refused before any process starts, in one line
     naming the stage and the fix.

``up`` and ``plan`` refuse the whole pipeline when one stage is refused (every stage runs here);
``serve <stage>`` only its own stage: in a deployment over several hosts a stage that cannot run on this
host runs on another, and is simply not placed here.

Whatever the rule, one group never has two ranks on one GPU: NCCL refuses that ("Duplicate GPU
detected"), and that crash, on every host with fewer GPUs than the default's six, is why this exists.

With no pipeline file the built-in default is fitted to the host (:func:`default_stages`); a file is
taken as written.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from stageferry.config import DEFAULT_STAGES, ConnectorKind, GroupLayout, PipelineConfig, StageConfig
from stageferry.errors import ConfigError

#: The reference layout (encoder TP2 → diffusion TP4) needs this many GPUs to run on disjoint GPUs.
REFERENCE_GPUS = sum(s.world_size for s in DEFAULT_STAGES)
# The device nodes a CUDA (NVIDIA) or ROCm (AMD) GPU is reached through: without any, torch sees no GPU.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd")


class PlacedBy(enum.StrEnum):
    """Where a stage's devices came from."""

    DEVICES = "devices"  #: the stage's ``devices`` list (or ``serve --devices``)
    PLANNER = "planner"  #: picked by the rule above
    CPU = "cpu"  #: ``device = "cpu"``, or no GPU on this host


@dataclass(frozen=True, slots=True)
class RankPlacement:
    rank: int
    device: str  #: ``"cuda:<index>"`` or ``"cpu"``

    @property
    def gpu(self) -> int | None:
        return int(self.device.split(":")[1]) if self.device.startswith("cuda:") else None


@dataclass(frozen=True, slots=True)
class GroupPlacement:
    """A process group of the stage: ``name`` is ``world`` or the layout's dimension (tp, sp, shard, replicate)."""

    name: str
    ranks: tuple[int, ...]
    backends: tuple[str, ...]  #: gloo carries headers and CPU tensors; NCCL the CUDA tensors


@dataclass(frozen=True, slots=True)
class PoolPlacement:
    """A pool the stage's leader registers with NIXL at start."""

    kind: str  #: ``DRAM`` or ``VRAM``
    device: str
    nbytes: int


@dataclass(frozen=True, slots=True)
class StagePlacement:
    name: str
    layout: str
    placed_by: PlacedBy
    ranks: tuple[RankPlacement, ...]
    groups: tuple[GroupPlacement, ...]
    pools: tuple[PoolPlacement, ...]
    computing: int = 1  #: ranks that compute: all, or 1 for a model that runs on rank 0 alone

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(r.device for r in self.ranks)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(g for g in (r.gpu for r in self.ranks) if g is not None)


#: Models whose group computes on rank 0 alone (a diffusers pipeline runs on one device: docs/diffusers.md).
RANK0_MODELS = ("stageferry.integrations.diffusers:",)


@dataclass(frozen=True, slots=True)
class Plan:
    """Every stage's placement on a host with ``gpus`` GPUs; ``shared`` maps a GPU used by more than one
    stage to the ranks on it (``"encoder/0"``)."""

    gpus: int
    stages: tuple[StagePlacement, ...]
    shared: dict[int, tuple[str, ...]]
    refused: dict[str, ConfigError] = field(default_factory=dict, compare=False)  #: stages not placed here

    def stage(self, name: str) -> StagePlacement:
        """The stage's placement; its refusal (:class:`ConfigError`) when it cannot run on this host."""
        if name in self.refused:
            raise self.refused[name]
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError(f"no stage named {name!r} in the plan", stages=[s.name for s in self.stages])

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "stages": [
                {
                    "name": s.name,
                    "layout": s.layout,
                    "placed_by": s.placed_by.value,
                    "ranks": [{"rank": r.rank, "device": r.device} for r in s.ranks],
                    "groups": [
                        {"name": g.name, "ranks": list(g.ranks), "backends": list(g.backends)} for g in s.groups
                    ],
                    "pools": [{"kind": p.kind, "device": p.device, "bytes": p.nbytes} for p in s.pools],
                    "computing_ranks": s.computing,
                }
                for s in self.stages
            ],
            "shared": [{"gpu": gpu, "ranks": list(ranks)} for gpu, ranks in sorted(self.shared.items())],
        }

    def summary(self) -> str:
        """One line: each stage's layout and devices, and the GPUs stages share."""
        parts = [f"{s.name} {s.layout} on {', '.join(_compact(s.devices))}" for s in self.stages]
        shared = f"; sharing GPU {', '.join(map(str, sorted(self.shared)))}" if self.shared else ""
        return " → ".join(parts) + shared

    def render(self) -> str:
        """The plan for people, one block per stage."""
        lines = [f"placement on {self.gpus} GPU{'s' if self.gpus != 1 else ''}"]
        for s in self.stages:
            lines.append(f"{s.name} ({s.layout}, {s.placed_by.value}):")
            lines.append("  ranks:  " + ", ".join(f"{r.rank} → {r.device}" for r in s.ranks))
            for g in s.groups:
                lines.append(f"  group {g.name}: ranks {list(g.ranks)} over {' + '.join(g.backends)}")
            if not s.groups:
                lines.append("  group:  none (one rank)")
            pools = ", ".join(f"{p.kind} {p.nbytes / 2**20:.0f} MiB on {p.device}" for p in s.pools)
            lines.append(f"  pools:  {pools or 'none (no NIXL edge)'}")
            if s.computing < len(s.ranks):
                lines.append(f"  compute: rank 0 only (its model runs on one device; ranks 1..{len(s.ranks) - 1} idle)")
        for gpu, ranks in sorted(self.shared.items()):
            lines.append(f"shared: GPU {gpu} runs {', '.join(ranks)}")
        return "\n".join(lines)


def _compact(devices: Sequence[str]) -> list[str]:
    """``["cpu", "cpu"]`` → ``["cpu x2"]``; GPU lists stay as they are (their order is the ranks')."""
    if devices and all(d == "cpu" for d in devices):
        return [f"cpu x{len(devices)}" if len(devices) > 1 else "cpu"]
    return list(devices)


# ---------------------------------------------------------------------------------------------- planning


def plan(pipeline: PipelineConfig, gpus: int, *, strict: bool = True) -> Plan:
    """The placement of ``pipeline`` on a host with ``gpus`` GPUs.  A stage that cannot run there is
    refused with a :class:`ConfigError` (one line, naming the stage and the fix): raised at once when
    ``strict``, else kept in :attr:`Plan.refused` (raised by :meth:`Plan.stage`) and left out of the
    placement of the others."""
    if gpus < 0:
        raise ConfigError(f"a host has 0 or more GPUs, not {gpus}")
    refused: dict[str, ConfigError] = {}
    fixed: dict[str, list[int] | None] = {}
    for s in pipeline.stages:
        try:
            fixed[s.name] = _fixed_devices(s, gpus)
            if fixed[s.name] is None and s.world_size > gpus:
                raise _too_few_gpus(s, gpus)
        except ConfigError as exc:
            if strict:
                raise
            refused[s.name] = exc
    stages = [s for s in pipeline.stages if s.name not in refused]
    wanted = [s for s in stages if fixed[s.name] is None]
    taken = {d for devs in fixed.values() if devs for d in devs}
    free = [g for g in range(gpus) if g not in taken]
    planned: dict[str, list[int]] = {}
    if sum(s.world_size for s in wanted) <= len(free):  # side by side, in pipeline order
        at = 0
        for s in wanted:
            planned[s.name] = free[at : at + s.world_size]
            at += s.world_size
    else:  # each fits alone: share, each stage starting where the previous one ended
        at = 0
        for s in wanted:
            planned[s.name] = [(at + i) % gpus for i in range(s.world_size)]
            at = (at + s.world_size) % gpus
    placed = []
    for s in stages:
        devs = fixed[s.name]
        by = PlacedBy.DEVICES
        if devs is None:
            devs, by = planned[s.name], PlacedBy.PLANNER
        elif not devs:
            by = PlacedBy.CPU
        names = [f"cuda:{d}" for d in devs] if devs else ["cpu"] * s.world_size
        ranks = tuple(RankPlacement(i, device) for i, device in enumerate(names))
        placed.append(
            StagePlacement(
                name=s.name,
                layout=s.layout.describe(),
                placed_by=by,
                ranks=ranks,
                groups=_groups(s, cuda=bool(devs)),
                pools=_pools(pipeline, pipeline.index_of(s.name), ranks[0].device, gpus),
                computing=1 if s.model.startswith(RANK0_MODELS) else s.world_size,
            )
        )
    return Plan(gpus=gpus, stages=tuple(placed), shared=_shared(placed), refused=refused)


def _fixed_devices(stage: StageConfig, gpus: int) -> list[int] | None:
    """The stage's GPUs when they are not for the planner to pick: ``[]`` for CPU, its ``devices``
    (checked against the host), or ``None``."""
    if stage.device == "cpu":
        return []
    if gpus == 0:
        if stage.device == "cuda":
            raise ConfigError(
                f'stage {stage.name!r} has device = "cuda" but this host has no GPU: set device = "auto" or "cpu"',
                stage=stage.name,
            )
        if stage.devices is None:
            return []
    if stage.devices is None:
        return None
    outside = [d for d in stage.devices if d >= gpus]
    if outside:
        have = f"GPUs 0..{gpus - 1}" if gpus else "no GPU"
        raise ConfigError(
            f"stage {stage.name!r}: devices = {list(stage.devices)} names GPU {outside[0]} but this host has "
            f'{have}: list GPUs it has in devices, drop devices to let the planner pick, or set device = "cpu"',
            stage=stage.name,
            devices=list(stage.devices),
            gpus=gpus,
        )
    return list(stage.devices)


def _too_few_gpus(stage: StageConfig, gpus: int) -> ConfigError:
    return ConfigError(
        f"stage {stage.name!r} needs {stage.world_size} GPUs (one per rank of {stage.layout.describe()}; two "
        f"ranks of one NCCL group cannot share a GPU) but this host has {gpus}: give it at most {gpus} ranks "
        f'(e.g. tp = {gpus}), run it where devices can list {stage.world_size} GPUs, or set device = "cpu"',
        stage=stage.name,
        ranks=stage.world_size,
        gpus=gpus,
    )


def _groups(stage: StageConfig, *, cuda: bool) -> tuple[GroupPlacement, ...]:
    """The process groups :func:`stageferry.stages.group.grid.build_channel` makes for this layout (none for
    one rank)."""
    if stage.world_size == 1:
        return ()
    backends = ("gloo", "nccl") if cuda else ("gloo",)
    layout = stage.layout
    groups = [GroupPlacement("world", tuple(range(layout.world_size)), backends)]
    if layout.rows > 1 and layout.row_size > 1:
        row, column = layout.dims
        groups += [GroupPlacement(row, tuple(layout.row_ranks(r)), backends) for r in range(layout.rows)]
        groups += [GroupPlacement(column, tuple(layout.column_ranks(p)), backends) for p in range(layout.row_size)]
    return tuple(groups)


def _pools(pipeline: PipelineConfig, index: int, leader: str, gpus: int) -> tuple[PoolPlacement, ...]:
    """What the leader's NIXL connector registers (``PoolSet.from_config``): a DRAM pool, and a VRAM pool
    on the leader's GPU (on GPU 0 for a CPU leader on a GPU host), for a stage with an edge."""
    dp = pipeline.data_plane
    has_edge = index > 0 or index < len(pipeline.stages) - 1
    if not has_edge or dp.connector is not ConnectorKind.NIXL:
        return ()
    pools = [PoolPlacement("DRAM", "cpu", dp.cpu_pool_bytes)]
    if dp.gpu_pool_bytes > 0 and gpus > 0:
        pools.append(PoolPlacement("VRAM", leader if leader.startswith("cuda") else "cuda:0", dp.gpu_pool_bytes))
    return tuple(pools)


def _shared(stages: Sequence[StagePlacement]) -> dict[int, tuple[str, ...]]:
    users: dict[int, list[str]] = {}
    for s in stages:
        for r in s.ranks:
            if r.gpu is not None:
                users.setdefault(r.gpu, []).append(f"{s.name}/{r.rank}")
    return {gpu: tuple(ranks) for gpu, ranks in sorted(users.items()) if len({r.split("/")[0] for r in ranks}) > 1}


# ---------------------------------------------------------------------------------- pipelines for a host


def default_stages(gpus: int) -> tuple[StageConfig, ...]:
    """The built-in pipeline fitted to a host: the reference TP2 → TP4 with six GPUs or more (and on CPU),
    else the largest groups that run on disjoint GPUs — the diffusion stage first (it does the heavy
    work): 1 → TP1 and TP1 sharing GPU 0, 2 → TP1 → TP1, 3 → TP1 → TP2, 4 → TP2 → TP2, 5 → TP1 → TP4."""
    if gpus == 0 or gpus >= REFERENCE_GPUS:
        return DEFAULT_STAGES
    encoder, diffusion = DEFAULT_STAGES
    dif = 1
    while dif * 2 <= min(diffusion.world_size, max(1, gpus - 1)):
        dif *= 2
    enc = max(1, min(encoder.world_size, gpus - dif))
    return (_with_tp(encoder, enc), _with_tp(diffusion, dif))


def _with_tp(stage: StageConfig, tp: int) -> StageConfig:
    return StageConfig.model_validate({**stage.model_dump(exclude={"layout", "tp"}), "tp": tp})


def pipeline_for_host(path: Path | None, gpus: int) -> PipelineConfig:
    """The pipeline a service on this host runs: the file as written, or the default fitted to ``gpus``."""
    if path is not None:
        return PipelineConfig.load(path)
    return PipelineConfig(stages=default_stages(gpus))


def with_overrides(
    pipeline: PipelineConfig, name: str, *, tp: int | None = None, devices: Sequence[int] | None = None
) -> PipelineConfig:
    """``serve --tp / --devices``: the pipeline with one stage's TP size and GPUs replaced.  ``--tp`` alone
    drops the stage's ``devices`` (they were listed for the other size)."""
    stage = pipeline.stage(name)
    if tp is not None and stage.layout == GroupLayout(tp=tp):
        tp = None  # the size it has already: keep its devices
    if tp is None and devices is None:
        return pipeline
    data = stage.model_dump(exclude={"layout", "tp"} if tp is not None else set())
    if tp is not None:
        data["tp"] = tp
        data["devices"] = None
    if devices is not None:
        data["devices"] = tuple(devices)
    try:
        new = StageConfig.model_validate(data)
    except ValidationError as exc:
        msg = exc.errors(include_url=False)[0]["msg"]
        raise ConfigError(f"bad override for stage {name!r}: {msg}", stage=name) from exc
    stages = tuple(new if s.name == name else s for s in pipeline.stages)
    return pipeline.model_copy(update={"stages": stages})


def parse_devices(text: str) -> tuple[int, ...]:
    """``--devices 2,3,4,5`` (also ``2-5``) as GPU indices; :class:`ConfigError` for anything else."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo or hi - lo > 1023:
                    raise ValueError(part)
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ConfigError(f"--devices takes GPU indices such as 2,3,4,5 or 2-5, not {text!r}") from None
    return tuple(out)


def host_gpus() -> int:
    """How many GPUs this process sees (CUDA's numbering, after ``CUDA_VISIBLE_DEVICES``).

    On a host with none of a GPU driver's device nodes (:data:`GPU_DEVICE_NODES`) that is 0, known
    without importing torch, whose import is about half of a stage process's start (1.1 of 2.0 s on the
    CPU box): a group's supervisor asks this and needs nothing else of torch."""
    if not any(os.path.exists(node) for node in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


__all__ = [
    "GPU_DEVICE_NODES",
    "REFERENCE_GPUS",
    "GroupPlacement",
    "PlacedBy",
    "Plan",
    "PoolPlacement",
    "RankPlacement",
    "StagePlacement",
    "default_stages",
    "host_gpus",
    "parse_devices",
    "pipeline_for_host",
    "plan",
    "with_overrides",
]
