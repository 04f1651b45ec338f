"""The values of a Kubernetes deployment: what the pipeline file does not say (replicas, autoscaling
bounds, resources per rank, the longest job), read from ``deploy/kubernetes/values.toml``.

Everything about a stage's shape (its name, its ranks, its pools) comes from the pipeline file; these
values only size and scale what that file describes.  A stage the values do not name takes
``[stage_defaults]``; a stage named here but absent from the pipeline file is an error, so the two
files cannot drift apart silently.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationError

from stageferry.config import GiB, MiB, PipelineConfig, StageConfig, Strict
from stageferry.errors import ConfigError

_Quantity = Annotated[str, Field(pattern=r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti)?$")]
_Name = Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")]
#: What the fan-out and gloo need on top of the leader's pool (the ranks' shared-memory transports).
SHM_HEADROOM_BYTES = 256 * MiB


class StageValues(Strict):
    """How one stage is sized and scaled (every field optional: unset ones come from ``stage_defaults``)."""

    replicas: Annotated[int, Field(ge=0, le=1000)] | None = None
    """Replicas without KEDA (the Deployment's own count)."""
    min_replicas: Annotated[int, Field(ge=0, le=1000)] | None = None
    """KEDA's `minReplicaCount` (0 lets an idle stage scale to zero)."""
    max_replicas: Annotated[int, Field(ge=1, le=1000)] | None = None
    """KEDA's `maxReplicaCount`."""
    pending_per_replica: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """KEDA target: entries delivered to the stage's group and not yet acked (`XPENDING`), per replica."""
    lag_per_replica: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """KEDA target: entries not yet delivered to the group (`XINFO GROUPS` lag), per replica."""
    cpu_per_rank: _Quantity | None = None
    """CPU profile: CPU requested per rank (a TP2 stage requests twice this)."""
    memory_per_rank: _Quantity | None = None
    """CPU profile: memory per rank (requested and limit; `/dev/shm` is added on top)."""
    gpu_memory_per_rank: _Quantity | None = None
    """GPU profile: host memory per rank (requested and limit; `/dev/shm` is added on top)."""
    job_seconds: Annotated[int, Field(ge=1, le=86_400)] | None = None
    """The longest job of this stage: the termination grace (drain) covers it."""
    spread: Literal["ScheduleAnyway", "DoNotSchedule"] | None = None
    """Topology spread of the stage's replicas over nodes: preferred, or required."""


_DEFAULTS = StageValues(
    replicas=1,
    min_replicas=1,
    max_replicas=4,
    pending_per_replica=2,
    lag_per_replica=4,
    cpu_per_rank="1",
    memory_per_rank="3Gi",
    gpu_memory_per_rank="16Gi",
    job_seconds=600,
    spread="ScheduleAnyway",
)


class Values(Strict):
    """``deploy/kubernetes/values.toml``."""

    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.{}-]{1,64}$")] = "sf"
    """`STAGEFERRY_PREFIX`: the key prefix, also in the stream names KEDA watches."""
    ucx_tcp_ports: Annotated[str, Field(pattern=r"^[0-9]{4,5}-[0-9]{4,5}$")] = "20000-20999"
    """`UCX_TCP_PORT_RANGE`: the ports NIXL's UCX listens on; the NetworkPolicy opens them between stage pods."""
    stage_defaults: StageValues = _DEFAULTS
    stages: dict[_Name, StageValues] = {}

    def for_stage(self, stage: StageConfig) -> StageValues:
        """The stage's values: its own section over ``stage_defaults`` over the built-in defaults."""
        own = self.stages.get(object_name(stage.name), StageValues())
        layers = (_DEFAULTS, self.stage_defaults, own)
        return StageValues(**{k: v for layer in layers for k, v in layer.model_dump(exclude_none=True).items()})

    def check_against(self, pipeline: PipelineConfig) -> None:
        """Every stage the values name is a stage of the pipeline file."""
        names = {object_name(s.name) for s in pipeline.stages}
        unknown = sorted(set(self.stages) - names)
        if unknown:
            raise ConfigError(f"values name stages the pipeline file does not have: {unknown}", stages=sorted(names))

    @classmethod
    def load(cls, path: str | Path | None) -> Values:
        if path is None:
            return cls()
        try:
            return cls.model_validate(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError, ValidationError) as exc:
            raise ConfigError(f"cannot load values {path}: {exc}", path=str(path)) from exc


def object_name(stage: str) -> str:
    """A stage name as a Kubernetes name (DNS-1123: ``_`` becomes ``-``)."""
    return stage.replace("_", "-")


def shm_bytes(pipeline: PipelineConfig, stage: StageConfig) -> int:
    """``/dev/shm`` for one stage pod: the leader's DRAM pool, one payload per further rank (the group's
    fan-out over shared memory), and :data:`SHM_HEADROOM_BYTES` for gloo; rounded up to whole MiB."""
    dp = pipeline.data_plane
    total = dp.cpu_pool_bytes + dp.max_payload_bytes * (stage.world_size - 1) + SHM_HEADROOM_BYTES
    return -(-total // MiB) * MiB


def mebibytes(nbytes: int) -> str:
    """Bytes as a Kubernetes quantity in Mi (or Gi when whole)."""
    return f"{nbytes // GiB}Gi" if nbytes % GiB == 0 else f"{-(-nbytes // MiB)}Mi"


def quantity_bytes(quantity: str) -> int:
    """A memory quantity (``3Gi``, ``512Mi``, ``1073741824``) in bytes."""
    units = {"Ki": 1 << 10, "Mi": MiB, "Gi": GiB, "Ti": 1 << 40}
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * scale)
    return int(float(quantity))
