"""A stage group's consumers that are gone, pruned when a replica (re)makes its group.

Every replica reads its stage's group as a consumer of its own name (its replica id,
:func:`~stageferry.broker.control.liveness.replica_id`), and Redis keeps a consumer once made until it is
told otherwise.  Replicas named after their pods come and go — a Deployment's pods on every restart and
roll-out, KEDA scaling up and down — so without pruning the group's consumer list grows with every one of
them, for as long as the stream lives (``XINFO CONSUMERS``, and every script that scans the group).

So a replica, when it makes sure of its group at start (and after a Redis that lost it,
:meth:`~stageferry.broker.control.streams.StageStream.ensure_group`), deletes the consumers that hold no
entry and did nothing for :data:`STALE_S`.  One script checks and deletes in one atomic step, because
``XGROUP DELCONSUMER`` drops the consumer's pending entries with it and an entry dropped so is never
delivered again: a consumer that holds an entry is never deleted, however idle.  A dead replica's entries
are reclaimed by the live ones (``XAUTOCLAIM`` after the visibility timeout), after which it holds none
and goes at the next start.  A live replica's consumer that is deleted all the same (idle that long: a
first stage whose clients sent nothing) loses nothing: its next read makes it again, as every
``XREADGROUP`` and ``XAUTOCLAIM`` does.

The stage user's ACL has ``XINFO CONSUMERS`` and ``XGROUP DELCONSUMER`` for this (:mod:`stageferry.acl`);
a Redis whose ACL predates them refuses, which is logged (``stream.consumers_prune_refused``) and is no
reason not to start.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.redis_conn import translated
from stageferry.errors import ControlPlaneError

log = structlog.get_logger(__name__)

#: A consumer idle this long with no entry is gone (a live replica reads every few seconds at most; one
#: deleted all the same is made again by its next read).
STALE_S = 300.0
#: Most consumers one prune deletes (the rest go at the next replica's start).
MAX_PRUNED = 1000

#: KEYS: the group's streams. ARGV: group, this replica's consumer (never deleted), idle ms, most to delete.
#: Returns the names deleted.  ``XINFO CONSUMERS`` replies, per consumer, name/pending/idle pairs (and more
#: in later Redis versions, which are skipped); a stream without the group is skipped, any other error
#: (a refusal) is the script's.
PRUNE_LUA = """
local gone = {}
local idle_ms, most = tonumber(ARGV[3]), tonumber(ARGV[4])
for k = 1, #KEYS do
  local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[k], ARGV[1])
  if type(consumers) == 'table' and consumers.err ~= nil and string.sub(consumers.err, 1, 7) ~= 'NOGROUP' then
    return redis.error_reply(consumers.err)
  end
  if type(consumers) == 'table' and consumers.err == nil then
    for _, c in ipairs(consumers) do
      local f = {}
      for i = 1, #c - 1, 2 do f[c[i]] = c[i + 1] end
      if #gone < most and f['name'] ~= ARGV[2] and f['pending'] == 0 and (f['idle'] or 0) >= idle_ms then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[k], ARGV[1], f['name'])
        gone[#gone + 1] = f['name']
      end
    end
  end
end
return gone
"""


class ConsumerPruner:
    """Deletes the stale consumers of one stage's group (see the module docstring)."""

    def __init__(self, redis: aioredis.Redis, streams: Sequence[str], group: str, consumer: str) -> None:
        self._streams = list(streams)
        self._group = group
        self._consumer = consumer
        self._script = redis.register_script(PRUNE_LUA)

    async def prune(self, *, stale_s: float = STALE_S, most: int = MAX_PRUNED) -> tuple[str, ...]:
        """Delete the consumers idle ``stale_s`` or longer that hold nothing (never this replica's own);
        their names.  A refusal (an ACL without the commands) is logged and deletes nothing."""
        try:
            with translated():
                gone = await self._script(
                    keys=self._streams, args=[self._group, self._consumer, int(stale_s * 1000), most]
                )
        except ControlPlaneError as exc:
            log.warning("stream.consumers_prune_refused", group=self._group, error=str(exc))
            return ()
        names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in gone)
        if names:
            log.info("stream.consumers_pruned", group=self._group, count=len(names), consumers=list(names[:20]))
        return names


__all__ = ["MAX_PRUNED", "PRUNE_LUA", "STALE_S", "ConsumerPruner"]
