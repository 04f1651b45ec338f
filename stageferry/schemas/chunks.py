"""One chunk of a streamed payload, as announced on the request's chunk stream.

A producer whose model emits its output in chunks (``StageContext.emit_chunk``) puts each chunk through
its output connector like a whole payload — NIXL, or inline when small or when its transfer fails — under
the hop key ``<request>_<stage>_<index>``, and announces it with one ``XADD`` to
``<p>:req-chunks:<id>:<stage index>:<attempt>`` (``Keys.chunks``).  Entry fields of that stream:

* ``chunk`` — JSON :class:`ChunkAnnouncement`;
* ``blob`` — only for an inline chunk: its regions, concatenated (as a stage entry's ``blob``).

No other field is read.  A chunk index is announced again only by a producer that computes the stream
again (its process died); the consumer applies each index once, in order, and skips repeats.

Schema version history:
  1 — first version (issue 40).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import Field, model_validator

from stageferry.schemas.job import Frozen, RequestId
from stageferry.schemas.payload import InlinePayload, NixlPayload, NoPayload

CHUNK_VERSION = 1
#: The most chunks one stream may have (a bound on the consumer's bookkeeping and the stream's length).
MAX_CHUNKS = 65_536
#: The fields a chunk stream entry may have.
CHUNK_FIELDS = frozenset({"chunk", "blob"})

ChunkRef = Annotated[NoPayload | InlinePayload | NixlPayload, Field(discriminator="kind")]
"""A chunk's own payload: never a stream of its own; ``none`` only for an end marker."""


class ChunkAnnouncement(Frozen):
    """Chunk ``index`` of the payload ``request_id`` has ready at ``from_stage`` (attempt ``attempt``)."""

    v: Literal[1] = 1
    request_id: RequestId
    from_stage: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")]
    attempt: Annotated[int, Field(ge=0, le=100)]
    index: Annotated[int, Field(ge=0, lt=MAX_CHUNKS)]
    #: The last chunk: no index above it follows.  A final chunk with no payload is an end marker (the
    #: model returned nothing after its last ``emit_chunk``); consumers do not see it as a chunk.
    final: bool = False
    key: Annotated[str, Field(max_length=200)]
    payload: ChunkRef = NoPayload()
    announced_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _checked(self) -> ChunkAnnouncement:
        """Only an end marker has no payload, and a NIXL chunk names an agent of the announcing stage."""
        if isinstance(self.payload, NoPayload) and not self.final:
            raise ValueError("a chunk without a payload must be the final one (an end marker)")
        payload = self.payload
        if isinstance(payload, NixlPayload) and not (
            payload.agent.startswith(f"{self.from_stage}-") and payload.agent.endswith(f"-{payload.incarnation[:8]}")
        ):
            raise ValueError(f"NIXL agent {payload.agent!r} is not an agent of stage {self.from_stage!r}")
        return self

    @property
    def is_end_marker(self) -> bool:
        return isinstance(self.payload, NoPayload)
