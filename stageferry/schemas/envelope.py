"""The stage-to-stage envelope: the only thing besides small fields that a stage stream entry holds.

Wire format of a stage stream entry (all fields are bytes on the wire):

* ``request_id`` — the request id (also inside the envelope, must match);
* ``job`` — JSON :class:`~stageferry.schemas.job.JobRequest` (entries written by clients), *or*
* ``envelope`` — JSON :class:`Envelope` (entries written by a stage), plus
* ``blob`` — only for an inline payload: the payload's regions, concatenated;
* ``lease`` — only for a NIXL payload: its lease token (the envelope's ``payload.token``), which the next
  stage's stream read claims as it delivers the entry (:class:`~stageferry.broker.control.streams.LeaseClaim`).
  A reader uses that claim only for the token its envelope names; otherwise it claims the lease itself;
* ``ticket``, ``tenant`` — only beside a ``job`` moved from a client's intake list by the first stage
  (:mod:`stageferry.broker.control.intake`: the mover writes them; a moved entry holds the item as
  ``submission`` — or only its size, ``oversized`` — and the stage unpacks it into these fields).

No other field is allowed (:data:`ENTRY_FIELDS`): an entry with an unknown field, or with both ``job``
and ``envelope``, a ``blob`` or ``lease`` beside a ``job``, a ``blob`` beside a payload that is not
inline or a ``lease`` that is not its NIXL payload's token, is refused as ``invalid_envelope`` — never
read past.

Schema version history:
  1 — first version.  Entry field ``lease`` added later (written by stages since issue 20's third round;
  a stage of an earlier release refuses such an entry, so upgrade the consuming stages first).
  2 — the payload may be :class:`~stageferry.schemas.payload.ChunkedPayload` (issue 40: chunked
  streaming), and only in version 2; every other envelope is still written as version 1, so a reader of
  version 1 keeps reading them and refuses a chunked one as ``invalid_envelope`` (typed, dead-lettered).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field, model_validator

from stageferry.schemas.job import Frozen, JobRequest, RequestId
from stageferry.schemas.payload import ChunkedPayload, NixlPayload, NoPayload, PayloadRef
from stageferry.schemas.status import StageTiming

ENVELOPE_VERSION = 2
#: The version an envelope without chunks is written as (readers of version 1 keep working).
ENVELOPE_BASE_VERSION = 1
#: The fields a stage stream entry may have (see the module docstring).
ENTRY_FIELDS = frozenset({"request_id", "job", "envelope", "blob", "lease", "ticket", "tenant"})
StageName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]


def request_key(request_id: str, from_stage_index: int, chunk: int = 0) -> str:
    """The data-plane key of a hop, e.g. ``video_sync-9e35132f9fa268e8-816c22ca_0_0``."""
    return f"{request_id}_{from_stage_index}_{chunk}"


class TraceContext(Frozen):
    """What follows a request across hops so that its trace can be stitched together."""

    submitted_at: float = Field(default_factory=time.time)
    hop_started_at: float = Field(default_factory=time.time)
    recomputes: Annotated[int, Field(ge=0, le=100)] = 0
    force_inline: bool = False
    timings: Annotated[list[StageTiming], Field(max_length=64)] = Field(default_factory=list)


class Envelope(Frozen):
    """A request handed from one stage to the next."""

    schema_version: Literal[1, 2] = 1
    request_id: RequestId
    key: Annotated[str, Field(max_length=200)]
    from_stage: StageName
    to_stage: StageName
    job: JobRequest
    payload: PayloadRef = NoPayload()
    attempt: Annotated[int, Field(ge=0, le=100)] = 0
    deadline: float | None = None
    trace: TraceContext = Field(default_factory=TraceContext)

    @model_validator(mode="after")
    def _agent_is_the_producer(self) -> Envelope:
        """A NIXL payload must name the producing stage's own agent (``<from_stage>-<replica>-<incarnation>``):
        an envelope cannot send a consumer to read from another stage's pool."""
        payload = self.payload
        if isinstance(payload, NixlPayload) and not (
            payload.agent.startswith(f"{self.from_stage}-") and payload.agent.endswith(f"-{payload.incarnation[:8]}")
        ):
            raise ValueError(f"NIXL agent {payload.agent!r} is not an agent of stage {self.from_stage!r}")
        return self

    @model_validator(mode="after")
    def _chunks_need_version_2(self) -> Envelope:
        """A chunked payload is version 2's, and version 2 is a chunked payload's: a version-1 reader
        must never take a stream for a whole payload."""
        if isinstance(self.payload, ChunkedPayload) != (self.schema_version == 2):
            raise ValueError("a chunked payload travels in an envelope of schema_version 2, and only it")
        return self
