"""Owned writes: a stage writes a request's record only while it holds an entry of that request.

A stage holds an entry while the entry is in its stream's consumer group's pending list under the
stage's consumer name.  It stops holding it when it settles the entry (ack and delete), when another
replica reclaims it (the holder stalled past the visibility timeout), or when Redis loses the stream —
a Redis restarted without its data has no streams, no groups and no records, and the entry a stage
had in hand then exists only in that stage's memory.

Every script that creates or changes a request's record on a stage's behalf — the admission, the
start, progress and terminal status writes, the hand-off, the last stage's finish — first checks, in
the same script, that the stage still holds the entry (:data:`HELD_FN`).  So a stage that runs an
entry again after an empty restart (its worker retries an entry whose Redis went away mid-way) finds
it no longer held and writes nothing: no ``running`` record without an entry behind it, which nothing
would ever end (issue 34), and no ``done`` for a request its waiters were already told was lost.  What
it does instead is :mod:`~stageferry.broker.control.record_loss`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``held(stream, group, consumer, entry_id)``: whether ``consumer`` holds ``entry_id`` in ``group`` of
#: ``stream`` (a missing stream or group — ``NOGROUP`` — holds nothing).  XPENDING only: a command the
#: stage ACL user has.
HELD_FN = """
local function held(stream, group, consumer, id)
  local p = redis.pcall('XPENDING', stream, group, id, id, '1')
  if type(p) ~= 'table' or p.err then return false end
  return #p > 0 and p[1][2] == consumer
end
"""


@dataclass(frozen=True, slots=True)
class Held:
    """An entry as a consumer holds it: the script arguments of :data:`HELD_FN`'s check."""

    stream: str  #: the stream it came from (a stage's own, or a tenant's intake)
    group: str  #: the stage's consumer group
    consumer: str  #: the replica's consumer name
    entry_id: str

    def args(self) -> list[str]:
        """The group, consumer and entry id, in :data:`HELD_FN`'s order after the stream (a key)."""
        return [self.group, self.consumer, self.entry_id]


__all__ = ["HELD_FN", "Held"]
