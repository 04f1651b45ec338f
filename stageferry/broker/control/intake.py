"""The first stage's intake: client submissions move from lists clients push to into the stage's stream.

Why not let clients ``XADD`` to the stream: ``XADD`` takes the entry id and ``MAXLEN`` from its caller, so
one client could add the last possible id (every later ``XADD`` fails: all submissions stop) or trim
everyone's queued jobs away, and Redis ACLs cannot forbid arguments.  Nor can a script or a Redis
Function grant a client an ``XADD`` it lacks: commands inside ``EVAL``/``FCALL`` are checked against the
*calling* user's ACL (checked on Redis 7.0).  So a client's user may only ``RPUSH`` (and ``LLEN``) its
intake list — no ids, no trimming, no pops — and the first stage's leader moves the items into its own
stream with ids Redis picks (``*``), in one script (:data:`MOVE`): an item is popped and added in the
same atomic step, so a mover that dies, or a connection lost mid-call, loses nothing and moves nothing
twice.  The entry then meets the stage's checks as any entry does; a request id submitted twice runs
once (admission by request id, :mod:`stageferry.stages.entry.entry_guard`).

Bounded at every step: a move takes at most ``count`` items, round-robin over the intakes (a tenant
that floods its own list does not starve the others); an item longer than ``max_item_bytes`` is not
copied into the stream — the entry gets its size and its ticket only (``oversized``, ``ticket``), and the
stage refuses it under that ticket.  The mover writes the entry's ``tenant`` field from the list the
item came from (only that tenant's user can push there), so the stage knows who sent it.

Entry fields written here (see :mod:`stageferry.schemas.envelope`): ``submission`` (the item, verbatim),
``ticket`` (from the item's first :data:`~stageferry.schemas.submission.TICKET_WINDOW` bytes, or empty),
``tenant`` (a tenant's intake only), or ``oversized`` (the item's size) in place of ``submission``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.control.resp_link import RespLink, run_script
from stageferry.schemas.submission import TICKET_WINDOW

#: The move as a Lua function, for :data:`MOVE` and for the stage's read script (which moves and reads in one
#: call, :data:`~stageferry.broker.control.stream_scripts.READ_CAPPED`): moves up to ``want`` items from the
#: lists ``KEYS[first..]`` into ``stream``, items longer than ``cap`` as their size and ticket only; the
#: tenant of list ``KEYS[first + i]`` is ``ARGV[tenant_at + i]`` ('' for the single-tenant list).  Returns
#: moved, oversized: items added whole, and items added as their size and ticket only.
MOVE_FN = f"""
local function move_item(stream, item, cap, tenant)
  local ticket = string.match(string.sub(item, 1, {TICKET_WINDOW}), '"ticket"%s*:%s*"([0-9a-f]+)"') or ''
  if #ticket ~= 32 then ticket = '' end
  local fields, whole
  if #item > cap then
    fields, whole = {{'oversized', tostring(#item), 'ticket', ticket}}, false
  else
    fields, whole = {{'submission', item, 'ticket', ticket}}, true
  end
  if tenant ~= '' then
    fields[#fields + 1] = 'tenant'
    fields[#fields + 1] = tenant
  end
  redis.call('XADD', stream, '*', unpack(fields))
  return whole
end

local function move_intake(stream, first, want, cap, tenant_at)
  local moved, oversized = 0, 0
  local open, left = {{}}, 0
  for k = first, #KEYS do open[k] = true; left = left + 1 end
  while left > 0 and moved + oversized < want do
    -- one LPOP per open list and round, an equal share of what is still wanted each (one at least)
    local share = math.max(1, math.floor((want - moved - oversized) / left))
    local popped, most, taken = {{}}, 0, 0
    for k = first, #KEYS do
      local n = math.min(share, want - moved - oversized - taken)
      if open[k] and n > 0 then
        local items = redis.call('LPOP', KEYS[k], n) or {{}}
        if #items < n then open[k] = false; left = left - 1 end
        popped[k] = items
        taken = taken + #items
        if #items > most then most = #items end
      end
    end
    for i = 1, most do  -- round-robin over the lists, item by item, as if popped one at a time
      for k = first, #KEYS do
        local item = popped[k] and popped[k][i]
        if item then
          if move_item(stream, item, cap, ARGV[tenant_at + k - first]) then moved = moved + 1
          else oversized = oversized + 1 end
        end
      end
    end
    if most == 0 then break end
  end
  return moved, oversized
end
"""

# KEYS: the stage stream, then the intake lists.  ARGV: most items to move, most bytes an item may have,
# then one tenant name per intake list ('' for the single-tenant list).
# Returns {moved, oversized}: items added whole, and items added as their size and ticket only.
MOVE = (
    MOVE_FN
    + """
local moved, oversized = move_intake(KEYS[1], 2, tonumber(ARGV[1]), tonumber(ARGV[2]), 3)
return {moved, oversized}
"""
)


@dataclass(frozen=True, slots=True)
class Moved:
    """What one move did (:meth:`Intake.move`)."""

    moved: int  #: items added to the stream whole
    oversized: int  #: items added as their size and ticket only (refused by the stage)

    @property
    def total(self) -> int:
        return self.moved + self.oversized

    @classmethod
    def from_reply(cls, reply: Sequence[Any]) -> Moved:
        moved, oversized = (int(x) for x in reply)
        return cls(moved, oversized)


class Intake:
    """The first stage's intake lists (the single-tenant one, or one per tenant) and their mover."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, stage: str, *, tenants: Sequence[str] = (), max_item_bytes: int
    ) -> None:
        self._redis = redis
        self.stream = keys.stage_stream(stage)
        #: (list key, tenant or '') of each intake.  The untenanted one is read in a deployment with tenants
        #: too (no client user may push there then: what a services' user pushes is refused, readably).
        self.lists: tuple[tuple[str, str], ...] = (
            (keys.intake(stage), ""),
            *((keys.intake(stage, t), t) for t in tenants),
        )
        self.max_item_bytes = max_item_bytes
        self._script = redis.register_script(MOVE)

    def _keys_args(self, count: int) -> tuple[list[str], list[Any]]:
        keys = [self.stream, *(key for key, _ in self.lists)]
        return keys, [count, *self.read_args()]

    @property
    def list_keys(self) -> list[str]:
        """The intake lists, in the order the read script's move takes them (after the streams it reads)."""
        return [key for key, _ in self.lists]

    def read_args(self) -> list[Any]:
        """What the move takes after its count, in the read script's arguments: the most bytes an item may
        have, then one tenant per list."""
        return [self.max_item_bytes, *(tenant for _, tenant in self.lists)]

    async def move(self, count: int, *, link: RespLink | None = None) -> Moved:
        """Move up to ``count`` items into the stream (one script)."""
        keys, args = self._keys_args(count)
        with translated():
            return Moved.from_reply(await run_script(link, self._script, keys, args))


__all__ = ["MOVE", "MOVE_FN", "Intake", "Moved"]
