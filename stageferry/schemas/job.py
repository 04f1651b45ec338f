"""The job request: what a client enqueues, validated before any work is done.

Bounds here are the hard, schema-level ones that any deployment shares; deployment-specific checks
(configured LoRA adapters, the step cap, upload prefix and sizes) live in
:func:`stageferry.schemas.validation.check_job_limits`.
"""

from __future__ import annotations

import enum
import hashlib
import re
from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

#: The one request-id rule.  No ``:`` (the key separator), no glob characters (``*?[]\\``, ACL key
#: patterns), no whitespace: so a request's keys (see ``broker/control/keys.py``) can never alias another
#: request's, nor match a pattern meant for someone else.  Check with :func:`is_request_id` (a full match;
#: Python's ``$`` would also accept a trailing newline).
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
#: A tenant's name.  A tenant's request ids are ``<tenant>.<rest>``; a name has no ``.`` so that one
#: tenant's prefix is never a prefix of another's (``acme.`` vs ``acmecorp.``).
TENANT_PATTERN = r"^[a-z][a-z0-9]{0,31}$"
TENANT_SEPARATOR = "."
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
MAX_PROMPT_CHARS = 8192
MAX_FRAMES = 1024  #: frames a job may ask for, however it asks (``num_frames`` or ``duration`` × ``fps``)
SIZE_MULTIPLE = 16

RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
_TENANT = re.compile(TENANT_PATTERN)


def is_request_id(value: object) -> bool:
    """True if ``value`` is a string that satisfies the request-id rule (the whole string)."""
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value) is not None


def is_tenant(value: object) -> bool:
    """True if ``value`` is a valid tenant name."""
    return isinstance(value, str) and _TENANT.fullmatch(value) is not None


def tenant_of(request_id: str) -> str | None:
    """The tenant an id names by its prefix (``acme.job-1`` → ``acme``), or None.  Whether that tenant
    exists is the deployment's business (``[security] tenants``)."""
    head, sep, _rest = request_id.partition(TENANT_SEPARATOR)
    return head if sep and is_tenant(head) else None


def _field_error(field: str, message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_combination", message, {"field": field})


class Task(enum.StrEnum):
    """Which conditioning the job carries."""

    T2VA = "t2va"  #: text → video + audio
    FL2VA = "fl2va"  #: first/last frame (+ text) → video + audio
    REF2VA = "ref2va"  #: reference video and/or audio (+ text) → video + audio
    I2VA = "i2va"  #: a first frame (+ text) → video + audio (models that can: the diffusers LTX-2 pair)


class Frozen(BaseModel):
    """Base of every wire model: unknown fields are an error, values are immutable, floats are finite
    (a NaN would slip past every ``ge``/``le`` bound and be reported as if it were out of range)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, str_max_length=65_536, use_attribute_docstrings=True, allow_inf_nan=False
    )


class MediaRef(Frozen):
    """A media input: a path the encoder stage can read, or bytes a client uploaded to a Redis key.

    Media bytes never ride inside the stream entry; an upload key lives under the deployment's prefix
    (checked against the configuration) and has a TTL set by the uploader.
    """

    path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    upload_key: Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[\x21-\x7e]+$")] | None = None

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if (self.path is None) == (self.upload_key is None):
            raise ValueError("give exactly one of 'path' or 'upload_key'")
        return self


class MediaInputs(Frozen):
    """Media a task needs; which are required depends on the task."""

    first_frame: MediaRef | None = None
    last_frame: MediaRef | None = None
    reference_video: MediaRef | None = None
    reference_audio: MediaRef | None = None


class JobRequest(Frozen):
    """One generation job. Every field is bounded; see ``stageferry schema`` for the JSON Schema."""

    task: Task = Task.T2VA
    """t2va: text → video + audio; fl2va: first/last frame; ref2va: reference video and/or audio; i2va: first frame."""
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    """What to generate (the deployment may allow fewer characters: `limits.max_prompt_chars`)."""
    negative_prompt: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] = ""
    """What to steer away from."""
    width: Annotated[int, Field(ge=64, le=2048)] = 1344
    """Frame width in pixels, a multiple of 16; aspect ratio at most 4:1."""
    height: Annotated[int, Field(ge=64, le=2048)] = 768
    """Frame height in pixels, a multiple of 16."""
    fps: Annotated[int, Field(ge=1, le=60)] = 24
    """Frames per second of the output."""
    duration: Annotated[float, Field(gt=0.0, le=30.0)] | None = None
    """Seconds of video (default 2 s); not together with `num_frames`."""
    num_frames: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Frames to generate, instead of `duration`."""
    num_inference_steps: Annotated[int, Field(ge=1, le=200)] = 8
    """Diffusion steps (the deployment may allow fewer: `limits.max_steps`)."""
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0
    """The same seed gives the same output."""
    flow_shift: Annotated[float, Field(ge=0.1, le=32.0)] = 5.0
    """Flow-matching time shift of the video sampler."""
    audio_flow_shift: Annotated[float, Field(ge=0.1, le=32.0)] = 3.0
    """Flow-matching time shift of the audio sampler."""
    guidance: Annotated[float, Field(ge=0.0, le=30.0)] = 5.0
    """Classifier-free guidance scale."""
    lora: Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN)] | None = None
    """A LoRA adapter by name, one of the deployment's `limits.lora_adapters`."""
    media: MediaInputs = MediaInputs()
    """Media inputs: fl2va needs first_frame and last_frame, i2va first_frame, ref2va reference_video and/or audio."""

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """Cross-field rules; each error names its field (``ctx.field``) for the rejection."""
        if self.duration is not None and self.num_frames is not None:
            raise _field_error("num_frames", "give 'duration' or 'num_frames', not both")
        if self.frame_count > MAX_FRAMES:
            message = f"duration × fps = {self.frame_count} frames; at most {MAX_FRAMES} frames"
            raise _field_error("duration", message)
        for name, value in (("width", self.width), ("height", self.height)):
            if value % SIZE_MULTIPLE:
                raise _field_error(name, f"{name} must be a multiple of {SIZE_MULTIPLE}, got {value}")
        if max(self.width, self.height) > 4 * min(self.width, self.height):
            raise _field_error("width", "aspect ratio beyond 4:1 is not supported")
        media = self.media
        if self.task is Task.FL2VA:
            for name in ("first_frame", "last_frame"):
                if getattr(media, name) is None:
                    raise _field_error(f"media.{name}", f"fl2va needs media.{name}")
        if self.task is Task.I2VA:
            if media.first_frame is None:
                raise _field_error("media.first_frame", "i2va needs media.first_frame")
            for name in ("last_frame", "reference_video", "reference_audio"):
                if getattr(media, name) is not None:
                    raise _field_error(f"media.{name}", "i2va takes media.first_frame only")
        if self.task is Task.REF2VA and media.reference_video is None and media.reference_audio is None:
            raise _field_error("media.reference_video", "ref2va needs media.reference_video and/or reference_audio")
        if self.task is Task.T2VA:
            for name in MediaInputs.model_fields:
                if getattr(media, name) is not None:
                    raise _field_error(f"media.{name}", "t2va takes no media inputs")
        return self

    def digest(self) -> str:
        """sha256 of the job's canonical JSON: which job a request id belongs to (its first submission's)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    @property
    def frame_count(self) -> int:
        """Frames to generate: ``num_frames`` if given, else ``duration × fps`` (default 2 s)."""
        if self.num_frames is not None:
            return self.num_frames
        return max(1, round((self.duration if self.duration is not None else 2.0) * self.fps))
