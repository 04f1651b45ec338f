"""The ``[timeouts]``, ``[limits]``, ``[retention]`` and ``[security]`` sections: the bounds a deployment holds to."""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
    model_validator,
)

from stageferry.config.base import GiB, KiB, MiB, Strict
from stageferry.cpus import default_hot_wait
from stageferry.schemas.job import TENANT_PATTERN, Task


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


#: The default cost budget: 1344×768 for 10 s at 24 fps (241 frames).  Measured on the reference models
#: (``benchmarks/job_cost.py``), this is about what one CPU host serves without the OOM killer's help;
#: deployments with more memory (or GPUs) raise it in ``[limits]``.
DEFAULT_MAX_PIXEL_FRAMES = 1344 * 768 * 241


class Streaming(Strict):
    """Chunked streaming between stages (docs/streaming.md); values in seconds and chunks."""

    max_chunks_in_flight: Annotated[int, Field(ge=1, le=1024)] = 4
    """Chunks a producer may announce ahead of what its consumer applied (per request; the pool bounds the stage)."""
    chunk_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """A consumer waits this long for the next chunk (from the last one), then fails the request ``chunk_timeout``."""
    producer_wait_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    """A producer held by back-pressure waits this long for its consumer to apply a chunk, then fails."""


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
    max_submission_bytes: Annotated[int, Field(ge=4 * KiB, le=64 * MiB)] = MiB
    """A client's submission (its job as JSON; media go as uploads) above this, or above `max_entry_bytes`,
    is refused inside Redis, without being read: what one item costs a stage to parse stays small."""
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

    @property
    def submission_cap(self) -> tuple[str, int]:
        """The bound an intake item is held to, and the setting it comes from: the smaller of
        ``max_submission_bytes`` and ``max_entry_bytes`` (an item becomes an entry)."""
        if self.max_submission_bytes <= self.max_entry_bytes:
            return "max_submission_bytes", self.max_submission_bytes
        return "max_entry_bytes", self.max_entry_bytes

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
