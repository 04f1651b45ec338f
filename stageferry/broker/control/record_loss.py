"""Lost requests: a request whose record and entry Redis no longer has ends ``failed`` / ``request_lost``.

A Redis that restarts without its data (no persistence, or a wiped disk), or a failover to a replica
that had not received the latest writes, can lose a request's record together with the stream entry
that carried it.  A stage may still have that entry in hand — it was computing when Redis went away,
and runs it again once Redis is back.  Its writes are owned (:mod:`.held`), so it writes nothing for
an entry it no longer holds; what it does then is :meth:`RecordLoss.end_if_lost`, one script that ends
the request *visibly* when, and only when, nothing else can settle it:

* the request has a record → :attr:`Loss.RECORDED`: its entry was settled, or another replica holds
  it and settles it (a replica that stalled past the visibility timeout finds this), nothing written;
* the entry is still in its stream → :attr:`Loss.QUEUED`: another consumer holds it or will read it
  (reclaimed), nothing written;
* neither → :attr:`Loss.ENDED`: the record is written ``failed`` with ``request_lost`` (create only,
  terminal, so written once and never changed: no later run can make it ``done``).

A request lost while no stage held it (its entry was waiting in a stream) has nobody to end it: it has
no record, and a waiter that saw it before is told ``request_lost`` (``RequestStore.follow``); a later
submission under its id is a new request.  Either way a waiter told ``request_lost`` is never told
anything else: nothing that held the request survives to write it again.
"""

from __future__ import annotations

import enum

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.entry_records import END_IF_LOST
from stageferry.broker.control.held import Held
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.resp_link import RespLink, run_script
from stageferry.errors import RequestLostError
from stageferry.schemas import ErrorInfo, RequestState, RequestStatus

log = structlog.get_logger(__name__)


class Loss(enum.Enum):
    """What :meth:`RecordLoss.end_if_lost` found (and did) for an entry its stage no longer holds."""

    RECORDED = "recorded"  #: the request has a record: whoever holds (or held) its entry settles it
    QUEUED = "queued"  #: the entry is still in its stream: another consumer holds it, or will
    ENDED = "ended"  #: no record and no entry: the request was lost, and is now ``failed`` ``request_lost``


#: The error a lost request's record carries (its code is what waiters and the gateway show).
LOST_MESSAGE = "the request was lost: Redis lost its record and its queued entry (restarted without its data?)"


class RecordLoss:
    """Ends lost requests visibly (see the module docstring); one per stage worker."""

    def __init__(self, redis: aioredis.Redis, store: RequestStore) -> None:
        self._store = store
        self._script = END_IF_LOST.bind(redis)

    async def end_if_lost(
        self, held: Held, request_id: str, *, stage: str, stage_index: int = 0, link: RespLink | None = None
    ) -> Loss:
        """For an entry this stage ran but no longer holds (``held``: as it held it): end its request
        ``failed`` / ``request_lost`` if it has no record and the entry is gone from its stream."""
        error = RequestLostError(LOST_MESSAGE, entry=held.entry_id, stage=stage)
        status = RequestStatus(
            request_id=request_id, state=RequestState.FAILED, stage=stage, error=ErrorInfo(**error.to_dict())
        )
        write = self._store.status_write(status, mode="create", stage_index=stage_index)
        keys = [write.record, write.events, held.stream]
        with translated():
            reply = await run_script(link, self._script, keys, [held.entry_id, *write.args()])
        loss = Loss(reply.decode() if isinstance(reply, bytes) else str(reply))
        if loss is Loss.ENDED:
            log.warning("request.lost", entry=held.entry_id, stream=held.stream, stage=stage)
        return loss


__all__ = ["LOST_MESSAGE", "Loss", "RecordLoss"]
