"""What the gateway's web console reads: the JSON of its endpoints and the server-sent event frames.

The console page (``stageferry/gateway/static/``) is the first reader, but these are plain API answers
that scripts may read too, so they are versioned like every other wire format: a reader checks
``schema_version`` and a change that breaks readers bumps it.

Schema version history:
  1 — first version.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CONSOLE_VERSION = 1


class _Answer(BaseModel):
    """Base of the console's answers: built by the gateway only, so unknown fields are a bug."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class EventFrame(_Answer):
    """One ``data:`` line of ``GET /v1/videos/{id}/events``: a status change or a logged event."""

    schema_version: Literal[1] = 1
    id: str = Field(description="The events-stream entry id (also the SSE `id:`).")
    kind: Literal["status", "log"]
    event: str = Field(description="`status.<state>` or the logged event name, e.g. `payload.put`.")
    timestamp: float = Field(description="Unix seconds.")
    state: str | None = Field(None, description="The request's state (status frames).")
    stage: str | None = None
    service: str | None = None
    rank: int | None = None
    step: int | None = None
    total: int | None = None
    transport: str | None = None
    bytes: int | None = None
    seconds: float | None = None
    detail: str = ""
    terminal: bool = Field(False, description="The last frame: the request ended; the stream closes.")


class TraceRow(_Answer):
    """One event of a trace, with its offset from the first event."""

    offset_s: float
    kind: str
    event: str
    service: str | None = None
    stage: str | None = None
    rank: int | None = None
    transport: str | None = None
    memory: str | None = Field(None, description="Memory kind(s) the event names (cpu, cuda), when it does.")
    bytes: int | None = None
    seconds: float | None = None
    detail: str = ""


class TraceHop(_Answer):
    """Time between two status changes (a queue wait or a stage at work), with the transports seen in it."""

    state: str
    stage: str | None = None
    offset_s: float
    seconds: float | None = Field(None, description="None while it lasts.")
    transports: list[str] = Field(default_factory=list)


class StageSpan(_Answer):
    """One stage's share of a request: queue wait, model time, and how its input arrived."""

    stage: str
    queue_wait_s: float | None = None
    model_s: float | None = None
    transport: str | None = None
    payload_bytes: int | None = None
    transfer_s: float | None = None
    fan_out: int = Field(1, description="Ranks that received the stage's input (the group's size).")
    ranks_seen: list[int] = Field(default_factory=list)


class TraceReport(_Answer):
    """``GET /v1/videos/{id}/trace``: the request's events, hops, per-stage spans, fallbacks and retries."""

    schema_version: Literal[1] = 1
    request_id: str
    state: str
    started_at: float | None = None
    total_s: float | None = None
    stages: list[StageSpan] = Field(default_factory=list)
    hops: list[TraceHop] = Field(default_factory=list)
    events: list[TraceRow] = Field(default_factory=list)
    fallbacks: list[TraceRow] = Field(default_factory=list)
    retries: list[TraceRow] = Field(default_factory=list)
    memory_kinds: list[str] = Field(default_factory=list)


class RecentRequest(_Answer):
    state: str
    id: str
    stage: str | None = None
    progress: int = 0
    prompt: str | None = None
    created_at: int | None = None
    error_code: str | None = None


class RecentReport(_Answer):
    """``GET /console/api/requests``: the newest requests this deployment's gateways accepted."""

    schema_version: Literal[1] = 1
    requests: list[RecentRequest] = Field(default_factory=list)


class Replica(_Answer):
    id: str
    heartbeat_age_s: float | None = None
    live: bool


class RankPlacement(_Answer):
    rank: int
    device: str = Field(description="cpu, cuda:<i> or auto:<i>; a rank uses GPU <rank> modulo its host's GPU count.")


class Pool(_Answer):
    """A registered memory pool of the stage's data plane, as configured (bytes in use are a per-process
    gauge: the counters show it, by source)."""

    kind: str
    capacity_bytes: int


class StageHealth(_Answer):
    name: str
    layout: str
    device: str
    ranks: list[RankPlacement] = Field(default_factory=list)
    replicas: list[Replica] = Field(default_factory=list)
    queue_length: int | None = None
    pending: int | None = None
    dead_letters: int | None = None
    pools: list[Pool] = Field(default_factory=list)


class StagesReport(_Answer):
    """``GET /console/api/stages``: replicas and heartbeats, placement, queues and pools per stage."""

    schema_version: Literal[1] = 1
    redis: bool
    stages: list[StageHealth] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)


class MetricsSource(_Answer):
    source: str
    ok: bool
    error: str | None = None


class CountersReport(_Answer):
    """``GET /console/api/counters``: the counters that matter, summed over the sources, by label set."""

    schema_version: Literal[1] = 1
    sources: list[MetricsSource] = Field(default_factory=list)
    counters: dict[str, dict[str, float]] = Field(default_factory=dict)


class ConsoleLimits(_Answer):
    max_steps: int
    max_prompt_chars: int
    max_upload_bytes: int
    lora_adapters: list[str] = Field(default_factory=list)


class ConsoleInfo(_Answer):
    """``GET /console/api/info`` (no token needed): whether to ask for a token, and the limits to show."""

    schema_version: Literal[1] = 1
    auth_required: bool
    tasks: list[str]
    stages: list[str]
    limits: ConsoleLimits
    max_event_streams: int


__all__ = [
    "CONSOLE_VERSION",
    "ConsoleInfo",
    "ConsoleLimits",
    "CountersReport",
    "EventFrame",
    "MetricsSource",
    "Pool",
    "RankPlacement",
    "RecentReport",
    "RecentRequest",
    "Replica",
    "StageHealth",
    "StageSpan",
    "StagesReport",
    "TraceHop",
    "TraceReport",
    "TraceRow",
]
