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
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StrictInt,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from stageferry.broker.data.nixl.address import parse_address
from stageferry.config_errors import describe
from stageferry.cpus import default_hot_wait
from stageferry.errors import ConfigError
from stageferry.schemas.job import TENANT_PATTERN, Task

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class Strict(BaseModel):
    """Base of the pipeline file's sections; each field's docstring is its documentation (docs/configuration.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ConnectorKind(enum.StrEnum):
    """Which data plane carries the payload across an edge."""

    NIXL = "nixl"  #: bulk bytes over NIXL, inline below ``inline_max_bytes`` and on failure
    INLINE = "inline"  #: always inline in the stream entry (small payloads, no NIXL available)


class MetadataMode(enum.StrEnum):
    """How a consumer obtains the producer's NIXL agent metadata."""

    QUERIED = "queried"  #: from Redis, ``<prefix>:nixl:agent:<name>``, kept fresh by a TTL heartbeat
    DIRECT = "direct"  #: carried in the envelope as well


MAX_GROUP_RANKS = 64
#: The highest GPU index a ``devices`` list may name (as the host numbers its GPUs).
MAX_GPU_INDEX = 1023
#: The model of an aggregated stage: it runs its ``parts`` one after the other in one group.
AGGREGATED_MODEL = "stageferry.stages.aggregated:factory"
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
    the placement planner (:mod:`stageferry.stages.placement`) picks them; whether the host has those
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


class DataPlaneConfig(Strict):
    """Connector choice, thresholds and pool sizes."""

    connector: ConnectorKind = ConnectorKind.NIXL
    """nixl: bulk bytes over NIXL (inline when small or on failure); inline: always in the stream entry."""
    metadata_mode: MetadataMode = MetadataMode.QUERIED
    """queried: agent metadata from Redis; direct: also carried in the envelope (checked against Redis)."""
    inline_max_bytes: Annotated[int, Field(ge=0, le=64 * MiB)] = 64 * KiB
    """Payloads up to this size ride inline in the stream entry."""
    inline_fallback_max_bytes: Annotated[int, Field(ge=0, le=256 * MiB)] = 16 * MiB
    """Cap of the inline fallback when NIXL fails; above it the request is recomputed upstream."""
    cpu_pool_bytes: Annotated[int, Field(ge=MiB, le=64 * GiB)] = 256 * MiB
    """The producer leader's registered DRAM pool."""
    gpu_pool_bytes: Annotated[int, Field(ge=0, le=64 * GiB)] = 512 * MiB
    """The producer leader's registered VRAM pool (GPU stages)."""
    max_payload_bytes: Annotated[int, Field(ge=KiB, le=16 * GiB)] = 1 * GiB
    """Largest payload a stage may hand on."""
    nixl_backends: tuple[Annotated[str, Field(pattern=r"^[A-Z_0-9]{1,32}$")], ...] = ("UCX",)
    """NIXL backends of each agent."""
    read_lanes: Annotated[int, Field(ge=1, le=64)] = 1
    """A DRAM region of at least ``read_lane_min_bytes`` is READ as this many descriptors in one transfer.
    1 by measurement: 2-8, with or without ``ucx_threads``, never beat one (``benchmarks/read_lanes.py``)."""
    read_lane_min_bytes: Annotated[int, Field(ge=64 * KiB, le=16 * GiB)] = 8 * MiB
    """Smallest DRAM region split into ``read_lanes`` descriptors."""
    ucx_threads: Annotated[int, Field(ge=0, le=64)] = 0
    """Threads of NIXL's UCX backend (its ``num_threads``); above 0 a transfer's descriptors are spread over
    them.  0 (NIXL's default engine) by measurement: 4 or 8 threads made no DRAM READ faster."""
    ready_slots: bool = True
    """A consumer leader keeps the slots and views of one more payload of its last shape ready, made while
    idle, so a get of that shape skips taking slots and unpacking (:mod:`stageferry.broker.data.nixl.ready`)."""
    agent_heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    """Seconds between refreshes of the agent record in Redis."""
    agent_ttl_s: Annotated[float, Field(gt=0, le=600)] = 6.0
    """TTL of the agent record: a producer silent this long is gone."""


class Timeouts(Strict):
    """Every wait has a bound; values in seconds."""

    visibility: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """An entry idle this long is reclaimed by another replica."""
    claim_renew_every: Annotated[float, Field(gt=0, le=600)] = 5.0
    """Long jobs renew their claim on the entry this often."""
    handshake: Annotated[float, Field(gt=0, le=120)] = 5.0
    """Loading the producer's agent metadata."""
    claim: Annotated[float, Field(gt=0, le=600)] = 30.0
    """A consumer's claim on a payload lives this long (it expires if the consumer dies)."""
    transfer: Annotated[float, Field(gt=0, le=600)] = 30.0
    """One NIXL READ."""
    lease: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """An unclaimed payload is freed after this."""
    pool_wait: Annotated[float, Field(ge=0, le=600)] = 10.0
    """Back-pressure: how long a put waits for a free pool slot."""
    resend: Annotated[float, Field(gt=0, le=120)] = 5.0
    """Waiting for a producer's inline resend."""
    redis_unreachable: Annotated[float, Field(gt=0, le=3600)] = 60.0
    """A worker exits non-zero after Redis has been gone this long."""
    request: Annotated[float, Field(gt=0, le=86_400)] = 3600.0
    """A request's deadline; also the default wait of the gateway's sync endpoint."""
    hot_wait: Annotated[float, Field(ge=0, le=0.1)] | None = None
    """After a stage's leader takes or settles an entry, how long its stream's lean Redis links poll for
    replies instead of sleeping (0: never), so a next entry finds it awake (woken Python runs slowly at
    first).  Unset: 0.002 on 8 usable CPUs or more, else 0 (fewer: the spin takes others' CPU)."""

    def hot_wait_s(self) -> float:  # ``hot_wait`` as this process uses it (unset: by its usable CPUs)
        return default_hot_wait() if self.hot_wait is None else self.hot_wait


class Streaming(Strict):
    """Chunked streaming between stages (docs/streaming.md); values in seconds and chunks."""

    max_chunks_in_flight: Annotated[int, Field(ge=1, le=1024)] = 4
    """Chunks a producer may announce ahead of what its consumer applied (per request; the pool bounds the stage)."""
    chunk_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A consumer waits this long for the next chunk (from the last one), then fails the request ``chunk_timeout``."""
    producer_wait_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    """A producer held by back-pressure waits this long for its consumer to apply a chunk, then fails."""


#: The default cost budget: 1344×768 for 10 s at 24 fps (241 frames).  Measured on the reference models
#: (``benchmarks/job_cost.py``), this is about what one CPU host serves without the OOM killer's help;
#: deployments with more memory (or GPUs) raise it in ``[limits]``.
DEFAULT_MAX_PIXEL_FRAMES = 1344 * 768 * 241


class Limits(Strict):
    """Deployment limits checked on every job, beyond the schema's hard bounds.

    The schema bounds each field alone; these bound what a job *costs* — what the models allocate for it
    — so that one schema-valid job cannot take a stage down.  They are checked where a job enters (the
    Python client, the gateway, the first stage) and again by every stage before it allocates."""

    max_pixel_frames: Annotated[int, Field(ge=64 * 64, le=2048 * 2048 * 1800)] = DEFAULT_MAX_PIXEL_FRAMES
    """Cost budget: width × height × (frames + reference-video frames) a job may ask for."""
    max_duration_s: Annotated[float, Field(gt=0, le=1024)] = 30.0
    """Longest generated video and audio in seconds (frames / fps)."""
    max_reference_frames: Annotated[int, Field(ge=1, le=1024)] = 81
    """Reference-video frames the encoder decodes (at the job's size and fps)."""
    max_reference_audio_s: Annotated[float, Field(gt=0, le=600)] = 30.0
    """Seconds of reference audio the encoder decodes."""
    max_media_pixels: Annotated[int, Field(ge=64 * 64, le=1 << 28)] = 4096 * 4096
    """Largest decoded media frame (an image, a reference-video frame) in pixels, at its own size."""
    media_roots: Annotated[tuple[str, ...], Field(max_length=32)] = ()
    """Directories a job's `media.*.path` may point into; none: clients send uploads only."""
    max_crashes: Annotated[int, Field(ge=1, le=20)] = 2
    """A request its stage died with this many times in a row is dead-lettered (`stage_crashed`)."""
    max_steps: Annotated[int, Field(ge=1, le=200)] = 100
    """Most `num_inference_steps` a job may ask for."""
    max_prompt_chars: Annotated[int, Field(ge=1, le=8192)] = 4096
    """Longest prompt (and negative prompt) in characters."""
    max_upload_bytes: Annotated[int, Field(ge=KiB, le=1 * GiB)] = 64 * MiB
    """Largest media upload."""
    max_entry_bytes: Annotated[int, Field(ge=KiB, le=512 * MiB)] = 32 * MiB
    """A stream entry above this is refused inside Redis, without being read."""
    min_reference_audio_s: Annotated[float, Field(ge=0, le=60)] = 1.0
    """Shortest reference audio the encoder takes."""
    max_deliveries: Annotated[int, Field(ge=1, le=100)] = 5
    """Then the entry goes to the dead-letter stream."""
    max_recomputes: Annotated[int, Field(ge=0, le=20)] = 3
    """A lost payload is recomputed upstream at most this often."""
    lora_adapters: tuple[Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")], ...] = ()
    """Names a job's `lora` may use."""
    tasks: Annotated[tuple[Task, ...], Field(min_length=1)] = (Task.T2VA, Task.FL2VA, Task.REF2VA)
    """Tasks this deployment serves (a text-only encoder: `["t2va"]`); others are refused on submission."""

    @model_validator(mode="after")
    def _absolute_roots(self) -> Limits:
        """Roots are absolute and normalised (``realpath`` happens when a file is opened)."""
        for root in self.media_roots:
            if not root.startswith("/") or "\x00" in root:
                raise ValueError(f"media_roots must be absolute paths, got {root!r}")
        return self


class Retention(Strict):
    """How long per-request keys live, and how long streams may grow."""

    request_ttl_s: Annotated[int, Field(ge=60, le=30 * 86_400)] = 86_400
    """How long a request's keys (status, events, result) live."""
    result_inline_max_bytes: Annotated[int, Field(ge=0, le=512 * MiB)] = 64 * MiB
    """Results up to this size are also stored in Redis (`<p>:req-result:<id>`)."""
    events_maxlen: Annotated[int, Field(ge=10, le=100_000)] = 2000
    """Most events kept per request trace."""
    dlq_maxlen: Annotated[int, Field(ge=10, le=10_000_000)] = 100_000
    """Most entries kept per dead-letter stream."""
    dlq_body_max_bytes: Annotated[int, Field(ge=0, le=1 * MiB)] = 4 * KiB
    """Dead letters keep bodies up to this size whole, larger ones as size + sha256 (`dead_letter.py`)."""
    dlq_max_bytes: Annotated[int, Field(ge=64 * KiB, le=16 * GiB)] = 256 * MiB
    """A dead-letter stream holds at most about this many bytes (fewer entries than `dlq_maxlen` if so)."""
    dlq_max_age_s: Annotated[int, Field(ge=1, le=365 * 86_400)] = 7 * 86_400
    """Dead letters older than this are trimmed; an idle dead-letter stream expires after it."""
    stream_maxlen: Annotated[int, Field(ge=100, le=100_000_000)] = 1_000_000
    """Admission control: submit fails with `queue_full` beyond this many queued entries."""


class Security(Strict):
    """Tenants: each has its own intake list to the first stage (``<p>:stage:<first>:submit:<tenant>``),
    which only its ACL user may push to, and its own request ids (``<tenant>.<rest>``), which only it may
    read or cancel.  With tenants configured, the first stage takes client jobs only from intakes, each
    only for its tenant's ids (see ``docs/security.md``; ``stageferry acl`` prints the ACL users)."""

    tenants: Annotated[tuple[Annotated[str, Field(pattern=TENANT_PATTERN)], ...], Field(max_length=256)] = ()
    """Tenant names (each with its own intake list, request-id prefix `<tenant>.` and ACL user)."""

    @model_validator(mode="after")
    def _unique(self) -> Security:
        if len(set(self.tenants)) != len(self.tenants):
            raise ValueError("tenant names must be unique")
        return self


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
    """Default: placed by the planner (see :mod:`stageferry.stages.placement`)."""


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


class Settings(BaseSettings):
    """Per-process settings (``STAGEFERRY_*``)."""

    model_config = SettingsConfigDict(env_prefix="STAGEFERRY_", extra="ignore", use_attribute_docstrings=True)

    redis_url: str | None = None
    """`redis://` or `rediss://` URL (see docs/security.md for TLS and ACL users). Client commands fall back
    to redis://127.0.0.1:6379/0; `up` starts a private server; `serve` requires it."""
    prefix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.{}-]{1,64}$")] = "sf"
    """Key prefix: every key lives under `<prefix>:`."""
    pipeline: Path | None = None
    """Pipeline TOML file; unset means the built-in default (docs/configuration.md)."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """json lines, console, or auto (console on a TTY)."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged."""
    replica: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] = Field(
        default_factory=lambda: socket.gethostname()[:48] or "replica"
    )
    """This replica's consumer name, stable across restarts (un-acked entries are re-read first)."""
    metrics_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """Prometheus metrics port (0: off)."""
    tenant: Annotated[str | None, Field(pattern=TENANT_PATTERN)] = None
    """The tenant a client process submits as (``STAGEFERRY_TENANT``); None: single-tenant."""
    gateway_token: Annotated[str, Field(min_length=8, max_length=512)] | None = None
    """The HTTP gateway's bearer token (``STAGEFERRY_GATEWAY_TOKEN``); unset: no token needed."""
    advertise_address: Annotated[str, AfterValidator(parse_address)] | None = None
    """The IP address NIXL peers reach this stage at (Kubernetes: the pod IP, `status.podIP` from the downward
    API). UCX is held to the interface that has it (`UCX_NET_DEVICES`, unless set) and the agent record
    carries it, so a hop's trace names both ends. Unset: UCX advertises every interface it opens."""

    def load_pipeline(self) -> PipelineConfig:
        return PipelineConfig.load(self.pipeline)
