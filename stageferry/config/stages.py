"""One stage of the pipeline file: its model, its group's layout (TP × SP ranks) and its devices."""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    JsonValue,
    StrictInt,
    model_validator,
)

from stageferry.config.base import Strict

MAX_GROUP_RANKS = 64
#: The highest GPU index a ``devices`` list may name (as the host numbers its GPUs).
MAX_GPU_INDEX = 1023
#: The model of an aggregated stage: it runs its ``parts`` one after the other in one group.
AGGREGATED_MODEL = "stageferry.stages.group.aggregated:factory"
_GroupDim = Annotated[int, Field(ge=1, le=MAX_GROUP_RANKS)]
_Devices = Annotated[tuple[StrictInt, ...], Field(min_length=1, max_length=MAX_GROUP_RANKS)]  # checked per stage


class LayoutForm(enum.StrEnum):
    """How a stage group's ranks are arranged: rows (the model's sharding group) × columns."""

    TP_SP = "tp_sp"  #: tensor parallel (rows) × sequence parallel (Ulysses, columns)
    HSDP = "hsdp"  #: HSDP: shard groups (rows) × replicate groups (columns)


class GroupLayout(Strict):
    """A stage group's parallel layout: ``{tp = 2, sp = 2}`` or ``{shard = 2, replicate = 2}``.

    Exactly one form; a missing size of that form is 1.  Ranks are numbered row-major: the row size
    (``tp`` or ``shard``) is the fastest-varying coordinate, so a TP (or shard) group is a run of
    consecutive ranks and rank 0 — the leader — sits at coordinates (0, 0)."""

    tp: _GroupDim | None = None
    sp: _GroupDim | None = None
    shard: _GroupDim | None = None
    replicate: _GroupDim | None = None

    @model_validator(mode="after")
    def _one_form(self) -> GroupLayout:
        tp_sp = self.tp is not None or self.sp is not None
        hsdp = self.shard is not None or self.replicate is not None
        if tp_sp == hsdp:
            raise ValueError("a layout is either {tp, sp} or {shard, replicate}: exactly one of the two forms")
        if self.world_size > MAX_GROUP_RANKS:
            raise ValueError(f"a stage group has at most {MAX_GROUP_RANKS} ranks, this layout has {self.world_size}")
        return self

    @property
    def form(self) -> LayoutForm:
        return LayoutForm.HSDP if self.shard is not None or self.replicate is not None else LayoutForm.TP_SP

    @property
    def dims(self) -> tuple[str, str]:
        """The names of the row and column dimensions: ``("tp", "sp")`` or ``("shard", "replicate")``."""
        return ("shard", "replicate") if self.form is LayoutForm.HSDP else ("tp", "sp")

    @property
    def row_size(self) -> int:
        """Ranks per row: the TP (or shard) group size."""
        return (self.shard if self.form is LayoutForm.HSDP else self.tp) or 1

    @property
    def rows(self) -> int:
        """Number of rows: the SP (or replicate) group size."""
        return (self.replicate if self.form is LayoutForm.HSDP else self.sp) or 1

    @property
    def world_size(self) -> int:
        return self.row_size * self.rows

    def row_ranks(self, row: int) -> list[int]:
        """The ranks of one TP (shard) group: row ``row``."""
        return [row * self.row_size + i for i in range(self.row_size)]

    def column_ranks(self, pos: int) -> list[int]:
        """The ranks of one SP (replicate) group: those at TP (shard) index ``pos``."""
        return [pos + r * self.row_size for r in range(self.rows)]

    def describe(self) -> str:
        row, col = self.dims
        return f"{row}{self.row_size}x{col}{self.rows}"


class StageConfig(Strict):
    """One stage of the pipeline.

    The group's size and shape come from ``layout``; ``tp = N`` alone is the 1-D layout ``{tp = N}``
    (and ``tp`` is kept equal to the layout's TP size, 1 for HSDP).  ``parts`` is set on an aggregated
    stage only: the stages whose models it runs in process, each on the first ranks of the group.

    ``devices`` pins the group to GPUs: rank i runs on GPU ``devices[i]`` (indices as the host numbers
    them), one distinct GPU per rank, since two ranks of one NCCL group cannot share a GPU.  Without it
    the placement planner (:mod:`stageferry.stages.process.placement`) picks them; whether the host has those
    GPUs is checked there, when the host is known."""

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    """The stage's name: its stream is `<p>:stage:<name>:in`, its consumer group `<name>`."""
    model: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] = "stageferry.stages.passthrough:factory"
    """`module:factory` of the stage's model, called once per rank (see docs/layouts.md)."""
    tp: _GroupDim = 1
    """Tensor-parallel size of the stage group (the 1-D layout `{tp = N}`)."""
    layout: GroupLayout = GroupLayout(tp=1)
    """`{tp, sp}` (TP × Ulysses SP) or `{shard, replicate}` (HSDP); ranks = the product, at most 64."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: GPUs when the host has them (placed by the planner), else CPU."""
    devices: _Devices | None = None
    """GPU indices, one per rank: rank i on GPU ``devices[i]`` (default: placed by the planner)."""
    parts: Annotated[tuple[StageConfig, ...], Field(max_length=16)] = ()
    entries_in_flight: Annotated[int, Field(ge=1, le=64)] = 1
    """Entries the leader holds at once: one computes, the others are admitted, fetched and handed on
    meanwhile (1: one at a time). Helps a model that is quick next to its Redis round trips; a slow one
    gains nothing, and keeps entries another replica could have taken (see docs/data-plane.md)."""
    options: Annotated[dict[str, JsonValue], Field(max_length=64)] = {}
    """Plain values the stage's model reads (a TOML table), e.g. the diffusers pair's `model_path`, `dtype`."""

    @model_validator(mode="before")
    @classmethod
    def _layout_from_tp(cls, data: Any) -> Any:
        """``tp`` alone means a 1-D TP layout; ``tp`` next to a layout must agree with it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        layout = data.get("layout")
        if layout is None:
            data["layout"] = {"tp": data.get("tp", 1)}
            return data
        layout = GroupLayout.model_validate(layout)
        layout_tp = layout.row_size if layout.form is LayoutForm.TP_SP else 1
        if "tp" in data and data["tp"] != layout_tp:
            raise ValueError(f"tp = {data['tp']} disagrees with layout {layout.describe()}: give one or the other")
        data["tp"] = layout_tp
        return data

    @model_validator(mode="after")
    def _devices_fit(self) -> StageConfig:
        """One distinct GPU per rank, and GPUs only for a stage that may use them."""
        if self.devices is None:
            return self
        where = f"stage {self.name!r}: devices = {list(self.devices)}"
        if self.device == "cpu":
            raise ValueError(f'{where} but device = "cpu": drop one of the two')
        bad = [d for d in self.devices if not 0 <= d <= MAX_GPU_INDEX]
        if bad:
            raise ValueError(f"{where}: GPU index {bad[0]} is out of range (0..{MAX_GPU_INDEX})")
        if len(self.devices) != self.world_size:
            raise ValueError(
                f"{where} names {len(self.devices)} GPUs but its layout {self.layout.describe()} has "
                f"{self.world_size} ranks: list exactly one GPU per rank"
            )
        repeated = sorted({d for d in self.devices if self.devices.count(d) > 1})
        if repeated:
            raise ValueError(
                f"{where} names GPU {repeated[0]} more than once: two ranks of one NCCL group cannot share a GPU"
            )
        return self

    @model_validator(mode="after")
    def _parts_fit(self) -> StageConfig:
        names = [p.name for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError(f"part names must be unique, got {names}")
        for part in self.parts:
            if part.parts:
                raise ValueError(f"part {part.name!r} of stage {self.name!r} has parts of its own")
            if part.devices is not None:
                raise ValueError(
                    f"part {part.name!r} of stage {self.name!r} has devices: an aggregated stage's GPUs are "
                    "set once, under [aggregated]"
                )
            if part.world_size > self.world_size:
                raise ValueError(
                    f"part {part.name!r} needs {part.world_size} ranks, stage {self.name!r} has {self.world_size}"
                )
        return self

    @property
    def world_size(self) -> int:
        """Ranks in the stage group (the product of the layout's sizes)."""
        return self.layout.world_size
