"""Configuration: process settings from the environment, the pipeline from a TOML file.

* :class:`Settings` — per process, ``STAGEFERRY_`` environment variables (e.g. ``STAGEFERRY_REDIS_URL``,
  ``STAGEFERRY_PREFIX``, ``STAGEFERRY_PIPELINE``, ``STAGEFERRY_LOG_FORMAT``) (:mod:`.settings`).
* :class:`PipelineConfig` — shared by every service of a deployment: the stages in order, their TP sizes
  and models, the connector per edge, thresholds, limits and timeouts (:mod:`.pipeline`, its sections in
  :mod:`.stages`, :mod:`.data_plane` and :mod:`.limits`).  ``compose/pipeline.toml`` is the documented
  default; with no file the built-in defaults apply.

Every name is importable from here (``from stageferry.config import PipelineConfig``).
"""

from stageferry.config.base import GiB, KiB, MiB, Strict
from stageferry.config.data_plane import ConnectorKind, DataPlaneConfig, MetadataMode
from stageferry.config.limits import DEFAULT_MAX_PIXEL_FRAMES, Limits, Retention, Security, Streaming, Timeouts
from stageferry.config.pipeline import DEFAULT_STAGES, AggregatedConfig, Mode, PipelineConfig
from stageferry.config.settings import Settings
from stageferry.config.stages import (
    AGGREGATED_MODEL,
    MAX_GPU_INDEX,
    MAX_GROUP_RANKS,
    GroupLayout,
    LayoutForm,
    StageConfig,
)

__all__ = [
    "AGGREGATED_MODEL",
    "DEFAULT_MAX_PIXEL_FRAMES",
    "DEFAULT_STAGES",
    "MAX_GPU_INDEX",
    "MAX_GROUP_RANKS",
    "AggregatedConfig",
    "ConnectorKind",
    "DataPlaneConfig",
    "GiB",
    "GroupLayout",
    "KiB",
    "LayoutForm",
    "Limits",
    "MetadataMode",
    "MiB",
    "Mode",
    "PipelineConfig",
    "Retention",
    "Security",
    "Settings",
    "StageConfig",
    "Streaming",
    "Strict",
    "Timeouts",
]
