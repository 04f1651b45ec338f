"""The pipeline file: :class:`PipelineConfig` (the stages in order and every section), loaded from TOML."""

from __future__ import annotations

import enum
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    ValidationError,
    model_validator,
)

from stageferry.config.base import Strict
from stageferry.config.data_plane import DataPlaneConfig
from stageferry.config.limits import Limits, Retention, Security, Streaming, Timeouts
from stageferry.config.stages import AGGREGATED_MODEL, GroupLayout, StageConfig, _Devices
from stageferry.config_errors import describe
from stageferry.errors import ConfigError


class Mode(enum.StrEnum):
    """How the stages are served."""

    DISAGGREGATED = "disaggregated"  #: one service (group) per stage; payloads cross over the data plane
    AGGREGATED = "aggregated"  #: one service whose one group runs every stage's model, payloads in process


class AggregatedConfig(Strict):
    """The one stage of an aggregated pipeline (``mode = "aggregated"``)."""

    name: Annotated[str | None, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")] = None
    """The one stage's name; default: the first stage's, so clients submit as before."""
    layout: GroupLayout | None = None
    """Default: the layout of the stage with the most ranks."""
    device: Literal["auto", "cpu", "cuda"] | None = None
    """Default: the first stage's."""
    devices: _Devices | None = None
    """Default: placed by the planner (see :mod:`stageferry.stages.process.placement`)."""


DEFAULT_STAGES = (
    StageConfig(name="encoder", model="stageferry.stages.reference.encoder:factory", tp=2),
    StageConfig(name="diffusion", model="stageferry.stages.reference.diffusion:factory", tp=4),
)


class PipelineConfig(Strict):
    """A deployment: stages in order (the first reads client jobs, the last stores results).

    With ``mode = "aggregated"`` the declared stages become the ``parts`` of one served stage (named
    after the first, so clients and the raw protocol submit exactly as before); ``stages`` then holds
    that one stage, and :meth:`disaggregated` gives back the declared ones."""

    mode: Mode = Mode.DISAGGREGATED
    """disaggregated: one service per stage; aggregated: one service runs every stage's model (docs/layouts.md)."""
    aggregated: AggregatedConfig = AggregatedConfig()
    stages: Annotated[tuple[StageConfig, ...], Field(min_length=1, max_length=16)] = DEFAULT_STAGES
    data_plane: DataPlaneConfig = DataPlaneConfig()
    timeouts: Timeouts = Timeouts()
    streaming: Streaming = Streaming()
    limits: Limits = Limits()
    retention: Retention = Retention()
    security: Security = Security()
    output_dir: str = "out"
    """Where the last stage writes results (MP4s); relative paths are resolved against the working directory."""

    @model_validator(mode="before")
    @classmethod
    def _aggregate(cls, data: Any) -> Any:
        """In aggregated mode, fold the declared stages into one stage that runs them as its parts."""
        if not isinstance(data, dict) or data.get("mode") != Mode.AGGREGATED.value:
            return data
        stages = [StageConfig.model_validate(s) for s in data.get("stages", DEFAULT_STAGES)]
        if len(stages) == 1 and stages[0].parts:
            return data  # already folded (a dumped config loaded again)
        agg = AggregatedConfig.model_validate(data.get("aggregated", {}))
        layout = agg.layout or max(stages, key=lambda s: s.world_size).layout
        merged = StageConfig(
            name=agg.name or stages[0].name,
            model=AGGREGATED_MODEL,
            layout=layout,
            device=agg.device or stages[0].device,
            devices=agg.devices,
            parts=tuple(stages),
        )
        return {**data, "stages": (merged,)}

    def disaggregated(self) -> PipelineConfig:
        """The pipeline as declared: an aggregated stage's parts as stages of their own.  Their model
        factories see this, so a model that asks "am I the last stage?" gets the same answer."""
        if self.mode is Mode.DISAGGREGATED:
            return self
        return self.model_copy(update={"mode": Mode.DISAGGREGATED, "stages": self.stages[0].parts})

    @model_validator(mode="after")
    def _unique_stage_names(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        return self

    def stage(self, name: str) -> StageConfig:
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError(f"no stage named {name!r}", stages=[s.name for s in self.stages])

    def index_of(self, name: str) -> int:
        return [s.name for s in self.stages].index(self.stage(name).name)

    def next_stage(self, name: str) -> StageConfig | None:
        i = self.index_of(name)
        return self.stages[i + 1] if i + 1 < len(self.stages) else None

    def previous_stage(self, name: str) -> StageConfig | None:
        i = self.index_of(name)
        return self.stages[i - 1] if i > 0 else None

    @classmethod
    def load(cls, path: str | Path | None) -> PipelineConfig:
        """Read a TOML pipeline file; ``None`` gives the built-in default."""
        if path is None:
            return cls()
        try:
            return cls.model_validate(tomllib.loads(Path(path).read_text()))
        except ValidationError as exc:
            raise ConfigError(f"cannot load pipeline config {path}: {describe(exc, cls)}", path=str(path)) from exc
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot load pipeline config {path}: {exc}", path=str(path)) from exc
