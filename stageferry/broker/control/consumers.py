"""A stage's consumer group: made when a replica starts (:func:`make_group`), its gone consumers pruned.

Every replica reads its stage's group as a consumer of its own name (its replica id,
:func:`~stageferry.broker.control.liveness.replica_id`), and Redis keeps a consumer once made until it is
told otherwise.  Replicas named after their pods come and go — a Deployment's pods on every restart and
roll-out, KEDA scaling up and down — so without pruning the group's consumer list grows with every one of
them, for as long as the stream lives (``XINFO CONSUMERS``, and every script that scans the group).

So a replica, when it makes sure of its group at start (and after a Redis that lost it,
:meth:`~stageferry.broker.control.streams.StageStream.ensure_group`), deletes the consumers that hold no
entry, did nothing for :data:`STALE_S` and are not live replicas (no fresh heartbeat,
:mod:`~stageferry.broker.control.liveness`: before Redis 7.2 a read that finds nothing does not count as
doing something, so an idle stage's live replicas look as stale as dead ones).  One script checks and
deletes in one atomic step, because ``XGROUP DELCONSUMER`` drops the consumer's pending entries with it
and an entry dropped so is never delivered again: a consumer that holds an entry is never deleted, however
idle.  A dead replica's entries are reclaimed by the live ones (``XAUTOCLAIM`` after the visibility
timeout), after which it holds none and goes at the next start.  A replica deleted while it lives after
all (its heartbeat late: stalled) loses nothing: it held no entry, and the next read that delivers it
one makes its consumer again.

The stage user's ACL has ``XINFO CONSUMERS`` and ``XGROUP DELCONSUMER`` for this (:mod:`stageferry.acl`);
a Redis whose ACL predates them refuses, which is logged (``stream.consumers_prune_refused``; any other
failure ``stream.consumers_prune_failed``) and is no reason not to start.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import live_by_stage
from stageferry.broker.control.redis_conn import translated
from stageferry.errors import AccessDeniedError, ControlPlaneError

log = structlog.get_logger(__name__)

#: A consumer idle this long with no entry and no fresh heartbeat is gone.
STALE_S = 300.0
#: Most consumers one prune deletes (the rest go at the next replica's start).
MAX_PRUNED = 1000

#: KEYS: the group's streams. ARGV: group, idle ms, most to delete, then the consumers never deleted (this
#: replica's own, the live replicas').  Returns the names deleted.  ``XINFO CONSUMERS`` replies, per
#: consumer, name/pending/idle pairs (and more in later Redis versions, which are skipped); a stream
#: without the group is skipped, any other error (a refusal) is the script's.
PRUNE_LUA = """
local gone = {}
local idle_ms, most = tonumber(ARGV[2]), tonumber(ARGV[3])
local keep = {}
for i = 4, #ARGV do keep[ARGV[i]] = true end
for k = 1, #KEYS do
  local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[k], ARGV[1])
  if type(consumers) == 'table' and consumers.err ~= nil and string.sub(consumers.err, 1, 7) ~= 'NOGROUP' then
    return redis.error_reply(consumers.err)
  end
  if type(consumers) == 'table' and consumers.err == nil then
    for _, c in ipairs(consumers) do
      if #gone >= most then break end
      local f = {}
      for i = 1, #c - 1, 2 do f[c[i]] = c[i + 1] end
      if not keep[f['name']] and f['pending'] == 0 and (f['idle'] or 0) >= idle_ms then
        redis.call('XGROUP', 'DELCONSUMER', KEYS[k], ARGV[1], f['name'])
        gone[#gone + 1] = f['name']
      end
    end
  end
end
return gone
"""


def _refused(exc: ControlPlaneError) -> bool:
    """An ACL refusal: NOPERM outside a script, and inside one (Redis 7.0) an ``ERR`` that says so."""
    return isinstance(exc, AccessDeniedError) or _SCRIPT_REFUSAL in str(exc)


#: What Redis says when a script calls a command its user may not run.
_SCRIPT_REFUSAL = "can't run this command"


async def make_group(redis: aioredis.Redis, streams: Sequence[str], group: str) -> None:
    """Create the streams and the group if missing (also after a Redis restart that lost them)."""
    for key in streams:
        try:
            with translated():
                await redis.xgroup_create(key, group, id="0", mkstream=True)
            log.info("stream.group_created", stream=key, group=group)
        except ControlPlaneError as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise


class ConsumerPruner:
    """Deletes the stale consumers of one stage's group (see the module docstring)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, stage: str, streams: Sequence[str], consumer: str) -> None:
        self._redis = redis
        self._keys = keys
        self._stage = stage
        self._group = stage
        self._streams = list(streams)
        self._consumer = consumer
        self._script = redis.register_script(PRUNE_LUA)

    async def prune(self, *, stale_s: float = STALE_S, most: int = MAX_PRUNED) -> tuple[str, ...]:
        """Delete the consumers idle ``stale_s`` or longer that hold nothing and are not live replicas
        (never this replica's own); their names.  A refusal (an ACL without the commands) or another
        failure is logged and deletes nothing."""
        try:
            live = (await live_by_stage(self._redis, self._keys, [self._stage]))[self._stage]
            with translated():
                gone = await self._script(
                    keys=self._streams, args=[self._group, int(stale_s * 1000), most, self._consumer, *live]
                )
        except ControlPlaneError as exc:
            event = "stream.consumers_prune_refused" if _refused(exc) else "stream.consumers_prune_failed"
            log.warning(event, group=self._group, error=str(exc))
            return ()
        names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in gone)
        if names:
            log.info("stream.consumers_pruned", group=self._group, count=len(names), consumers=list(names[:20]))
        return names


__all__ = ["MAX_PRUNED", "PRUNE_LUA", "STALE_S", "ConsumerPruner", "make_group"]
