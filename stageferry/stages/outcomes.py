"""Where an entry's error becomes its request's state: the worker's one boundary onto the outcome table.

Every way an entry can end badly reaches the worker as a typed :class:`StageferryError` (a rejection,
a cancel, a passed deadline, an entry delivered too often, a model failure, a lost payload, ...).  The
worker hands it to :meth:`Outcomes.settle`, which looks the class up in
:data:`stageferry.errors.OUTCOMES` and does what the row says — write the terminal state once with the
error's code, then acknowledge or dead-letter the entry, or hand the request back upstream — and
nothing else decides a request's state from an error.  Later fixes (poison entries, request records)
add a class and, if its default is wrong, a row; they do not add branches here.

Status writes for the normal path (``running``, ``queued`` on the next stage, ``done``) live here too,
so that every write of a request record by a stage goes through :meth:`Outcomes.set_status`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.broker.data import metrics
from stageferry.errors import DataPlaneError, EntryAction, StageferryError, outcome_of
from stageferry.schemas import Envelope, ErrorInfo, Progress, RequestState, RequestStatus

log = structlog.get_logger(__name__)

#: The event, and how loudly it is logged, for each state an error can end a request in.
_LOGGED = {
    RequestState.REJECTED: ("warning", "request.rejected"),
    RequestState.FAILED: ("error", "request.failed"),
    RequestState.CANCELLED: ("info", "request.cancelled"),
}

#: Sends a request back to be computed again; False when it may not (past ``limits.max_recomputes``).
Recompute = Callable[[Entry, Envelope, DataPlaneError], Awaitable[bool]]


class Outcomes:
    """Writes a stage's request states and disposes of its entries, as the outcome table says."""

    def __init__(self, *, stage: str, stream: StageStream, store: RequestStore) -> None:
        self.stage = stage
        self.stream = stream
        self.store = store

    async def settle(
        self,
        entry: Entry,
        rid: str | None,
        error: StageferryError,
        *,
        envelope: Envelope | None = None,
        recompute: Recompute | None = None,
    ) -> None:
        """End ``entry`` as ``error``'s row of the outcome table says.

        ``rid`` is ``None`` when the entry names no valid request (nothing is written then, the entry is
        only disposed of); ``recompute`` is tried first for errors whose row is
        :attr:`EntryAction.RECOMPUTE`, and the request fails only if it declines.
        :class:`~stageferry.errors.GroupBrokenError` (:attr:`EntryAction.KEEP`) is re-raised: the entry
        stays pending and the replica stops."""
        outcome = outcome_of(error)
        if outcome.entry is EntryAction.KEEP:
            raise error
        if (
            outcome.entry is EntryAction.RECOMPUTE
            and isinstance(error, DataPlaneError)
            and envelope is not None
            and recompute is not None
            and await recompute(entry, envelope, error)
        ):
            return
        if rid is not None and outcome.state is not None:
            level, event = _LOGGED.get(outcome.state, ("error", "request.failed"))
            getattr(log, level)(event, code=error.code, error=error.message)
            await self.finish(rid, outcome.state, error=ErrorInfo(**error.to_dict()))
        label = outcome.label if rid is not None else "dead_lettered"
        metrics.ENTRIES.labels(self.stage, label if outcome.entry is not EntryAction.RECOMPUTE else "failed").inc()
        if outcome.entry is EntryAction.DEAD_LETTER:
            await self.stream.dead_letter(entry, reason=error.message, error_code=error.code)
        else:
            await self.stream.ack(entry.id)

    async def running(self, envelope: Envelope, progress: Progress | None) -> None:
        await self.set_status(
            envelope.request_id,
            RequestState.RUNNING,
            stage=self.stage,
            progress=progress,
            attempt=envelope.attempt,
            timings=envelope.trace.timings,
        )

    async def finish(self, rid: str, state: RequestState, **fields: Any) -> bool:
        """Write a terminal status (once: a second writer finds it terminal and changes nothing)."""
        return await self.set_status(rid, state, stage=self.stage, **fields)

    async def set_status(self, rid: str, state: RequestState, **fields: Any) -> bool:
        status = RequestStatus(request_id=rid, state=state, **fields)
        return await self.store.set_status(status)
