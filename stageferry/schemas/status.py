"""Request status and result, as stored under ``<prefix>:req:<id>`` and shown to clients."""

from __future__ import annotations

import enum
import time
from typing import Annotated, Any

from pydantic import Field

from stageferry.schemas.job import Frozen, RequestId


class RequestState(enum.StrEnum):
    """Lifecycle of a request; the last four are terminal and written once."""

    QUEUED = "queued"  #: accepted, waiting in a stage stream
    RUNNING = "running"  #: a stage is working on it (see ``stage`` and ``progress``)
    DONE = "done"  #: the result is stored
    FAILED = "failed"  #: gave up, with a typed error
    REJECTED = "rejected"  #: the request is invalid, with field errors
    CANCELLED = "cancelled"  #: the client cancelled it

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RequestState.DONE, RequestState.FAILED, RequestState.REJECTED, RequestState.CANCELLED})


class Transport(enum.StrEnum):
    """How a payload crossed a hop."""

    NIXL = "nixl"
    INLINE = "inline"
    NONE = "none"
    IN_PROCESS = "in_process"


class Progress(Frozen):
    stage: str
    step: Annotated[int, Field(ge=0)]
    total: Annotated[int, Field(ge=0)]
    phase: Annotated[str, Field(max_length=64)] | None = None
    """What the stage does once its steps are done (the reference diffusion stage: `decode`, then `mux`);
    absent while it steps."""


class StageTiming(Frozen):
    """How long one stage took for this request, and how its input payload arrived.  ``route``: per
    region of the payload, the memory it left and landed in and the transport underneath (e.g.
    ``"VRAM:0→VRAM:1 cuda_ipc, DRAM→DRAM cma"``), when the connector knows."""

    stage: str
    seconds: float
    transport: Transport = Transport.NONE
    payload_bytes: int = 0
    transfer_seconds: float = 0.0
    route: Annotated[str, Field(max_length=512)] | None = None


class ErrorInfo(Frozen):
    """A typed error: ``code`` is one of the ``StageferryError.code`` values."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class OutputInfo(Frozen):
    """Where the result is and what it is."""

    location: str
    redis_key: str | None = None
    bytes: int = 0
    sha256: str = ""
    media: dict[str, Any] = Field(default_factory=dict)
    data: dict[str, Any] = Field(default_factory=dict)


class RequestStatus(Frozen):
    request_id: RequestId
    state: RequestState
    stage: str | None = None
    progress: Progress | None = None
    result: OutputInfo | None = None
    error: ErrorInfo | None = None
    timings: list[StageTiming] = Field(default_factory=list)
    attempt: int = 0
    updated_at: float = Field(default_factory=time.time)
