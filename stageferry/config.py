"""Configuration: process settings from the environment, the pipeline from a TOML file.

* :class:`Settings` — per process, ``STAGEFERRY_`` environment variables (e.g. ``STAGEFERRY_REDIS_URL``,
  ``STAGEFERRY_PREFIX``, ``STAGEFERRY_PIPELINE``, ``STAGEFERRY_LOG_FORMAT``).
* :class:`PipelineConfig` — shared by every service of a deployment: the stages in order, their TP sizes
  and models, the connector per edge, thresholds, limits and timeouts.  ``compose/pipeline.toml`` is the
  documented default; with no file the built-in defaults below apply.
"""

from __future__ import annotations

import enum
import socket
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from stageferry.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConnectorKind(enum.StrEnum):
    """Which data plane carries the payload across an edge."""

    NIXL = "nixl"  #: bulk bytes over NIXL, inline below ``inline_max_bytes`` and on failure
    INLINE = "inline"  #: always inline in the stream entry (small payloads, no NIXL available)


class MetadataMode(enum.StrEnum):
    """How a consumer obtains the producer's NIXL agent metadata."""

    QUERIED = "queried"  #: from Redis, ``<prefix>:nixl:agent:<name>``, kept fresh by a TTL heartbeat
    DIRECT = "direct"  #: carried in the envelope as well


class StageConfig(Strict):
    """One stage of the pipeline."""

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    model: Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")] = "stageferry.stages.passthrough:factory"
    tp: Annotated[int, Field(ge=1, le=64)] = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DataPlaneConfig(Strict):
    """Connector choice, thresholds and pool sizes."""

    connector: ConnectorKind = ConnectorKind.NIXL
    metadata_mode: MetadataMode = MetadataMode.QUERIED
    inline_max_bytes: Annotated[int, Field(ge=0, le=64 * MiB)] = 64 * KiB
    inline_fallback_max_bytes: Annotated[int, Field(ge=0, le=256 * MiB)] = 16 * MiB
    cpu_pool_bytes: Annotated[int, Field(ge=MiB, le=64 * GiB)] = 256 * MiB
    gpu_pool_bytes: Annotated[int, Field(ge=0, le=64 * GiB)] = 512 * MiB
    max_payload_bytes: Annotated[int, Field(ge=KiB, le=16 * GiB)] = 1 * GiB
    nixl_backends: tuple[Annotated[str, Field(pattern=r"^[A-Z_0-9]{1,32}$")], ...] = ("UCX",)
    agent_heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    agent_ttl_s: Annotated[float, Field(gt=0, le=600)] = 6.0


class Timeouts(Strict):
    """Every wait has a bound; values in seconds."""

    visibility: Annotated[float, Field(gt=0, le=3600)] = 30.0
    claim_renew_every: Annotated[float, Field(gt=0, le=600)] = 5.0
    handshake: Annotated[float, Field(gt=0, le=120)] = 5.0
    claim: Annotated[float, Field(gt=0, le=600)] = 30.0
    transfer: Annotated[float, Field(gt=0, le=600)] = 30.0
    lease: Annotated[float, Field(gt=0, le=3600)] = 60.0
    pool_wait: Annotated[float, Field(ge=0, le=600)] = 10.0
    resend: Annotated[float, Field(gt=0, le=120)] = 5.0
    redis_unreachable: Annotated[float, Field(gt=0, le=3600)] = 60.0
    request: Annotated[float, Field(gt=0, le=86_400)] = 3600.0


class Limits(Strict):
    """Deployment limits checked on every job, beyond the schema's hard bounds."""

    max_steps: Annotated[int, Field(ge=1, le=200)] = 100
    max_prompt_chars: Annotated[int, Field(ge=1, le=8192)] = 4096
    max_upload_bytes: Annotated[int, Field(ge=KiB, le=1 * GiB)] = 64 * MiB
    max_entry_bytes: Annotated[int, Field(ge=KiB, le=512 * MiB)] = 32 * MiB
    min_reference_audio_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    max_deliveries: Annotated[int, Field(ge=1, le=100)] = 5
    max_recomputes: Annotated[int, Field(ge=0, le=20)] = 3
    lora_adapters: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")], ...] = ()


class Retention(Strict):
    """How long per-request keys live, and how long streams may grow."""

    request_ttl_s: Annotated[int, Field(ge=60, le=30 * 86_400)] = 86_400
    result_inline_max_bytes: Annotated[int, Field(ge=0, le=512 * MiB)] = 64 * MiB
    events_maxlen: Annotated[int, Field(ge=10, le=100_000)] = 2000
    dlq_maxlen: Annotated[int, Field(ge=10, le=10_000_000)] = 100_000
    stream_maxlen: Annotated[int, Field(ge=100, le=100_000_000)] = 1_000_000


class PipelineConfig(Strict):
    """A deployment: stages in order (the first reads client jobs, the last stores results)."""

    stages: Annotated[tuple[StageConfig, ...], Field(min_length=1, max_length=16)] = (
        StageConfig(name="encoder", model="stageferry.stages.reference.encoder:factory", tp=2),
        StageConfig(name="diffusion", model="stageferry.stages.reference.diffusion:factory", tp=4),
    )
    data_plane: DataPlaneConfig = DataPlaneConfig()
    timeouts: Timeouts = Timeouts()
    limits: Limits = Limits()
    retention: Retention = Retention()
    output_dir: str = "out"

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
            data = tomllib.loads(Path(path).read_text())
            return cls.model_validate(data)
        except (OSError, tomllib.TOMLDecodeError, ValidationError) as exc:
            raise ConfigError(f"cannot load pipeline config {path}: {exc}", path=str(path)) from exc


class Settings(BaseSettings):
    """Per-process settings (``STAGEFERRY_*``)."""

    model_config = SettingsConfigDict(env_prefix="STAGEFERRY_", extra="ignore")

    redis_url: str | None = None
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.{}-]{1,64}$")] = "sf"
    pipeline: Path | None = None
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    replica: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = Field(
        default_factory=lambda: socket.gethostname()[:48] or "replica"
    )
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0

    def load_pipeline(self) -> PipelineConfig:
        return PipelineConfig.load(self.pipeline)
