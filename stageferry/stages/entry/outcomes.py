"""Where an entry's error becomes its request's state: the worker's one boundary onto the outcome table.

Every way an entry can end badly reaches the worker as a typed :class:`StageferryError` (a rejection,
a cancel, a passed deadline, an entry delivered too often, a model failure, a lost payload, ...).  The
worker hands it to :meth:`Outcomes.settle`, which looks the class up in
:data:`stageferry.errors.OUTCOMES` and does what the row says — write the terminal state once with the
error's code, then acknowledge or dead-letter the entry, or hand the request back upstream — and
nothing else decides a request's state from an error.  Later fixes (poison entries, request records)
add a class and, if its default is wrong, a row; they do not add branches here.

Status writes for the normal path (``queued`` when the first stage takes a client's entry, ``running``,
``queued`` on the next stage, ``done``) live here too, so that every write of a request record by a stage
goes through :meth:`Outcomes.set_status`.  They are owned writes (:mod:`stageferry.broker.control.held`):
made only while the stage holds the entry.  An entry it no longer holds (:attr:`EntryAction.DROP`: the
guard's :class:`~stageferry.errors.RequestLostError`, a hand-off or finish that found it gone) is left
alone, and its request ended ``request_lost`` only when nothing else can settle it (:meth:`Outcomes.lost`).

Nothing a client writes may stop a stage: when the terminal status itself cannot be written (the
request's key is of another type, its status no longer parses), the entry is dead-lettered with both
reasons logged; when even the dead-letter stream refuses it, it is acknowledged (logged) rather than
delivered again and again.  A client's submission that is refused — without a request id
(:class:`~stageferry.errors.SubmissionRefusedError`), under another job's id (``request_id_taken``), or
rejected — gets a refusal record under its ticket (:mod:`stageferry.broker.control.refusals`), the one
handle its submitter holds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from stageferry.broker.control.entry_records import StatusWrite, WriteMode
from stageferry.broker.control.held import Held
from stageferry.broker.control.record_loss import Loss, RecordLoss
from stageferry.broker.control.redis_conn import is_transient_error
from stageferry.broker.control.refusals import Refusals
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.broker.data import metrics
from stageferry.errors import (
    ControlPlaneError,
    DataPlaneError,
    EntryAction,
    RejectedError,
    StageferryError,
    outcome_of,
)
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

    def __init__(
        self,
        *,
        stage: str,
        stream: StageStream,
        store: RequestStore,
        refusals: Refusals | None = None,
        stages: tuple[str, ...] = (),
    ) -> None:
        self.stage = stage
        self.stream = stream
        self.store = store
        self.refusals = refusals  #: the first stage's: where clients learn why an entry was refused
        self.stages = stages  #: the pipeline's stage names in order: statuses are ordered by stage index
        self.loss = RecordLoss(store.redis, store)

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
        if outcome.entry is EntryAction.DROP:
            if rid is not None:
                await self.lost(entry, rid)
            metrics.ENTRIES.labels(self.stage, outcome.label).inc()
            return
        if (
            outcome.entry is EntryAction.RECOMPUTE
            and isinstance(error, DataPlaneError)
            and envelope is not None
            and recompute is not None
            and await recompute(entry, envelope, error)
        ):
            return
        if isinstance(error, RejectedError):
            await self._record_refusal(entry, error)
        if rid is not None and outcome.state is not None:
            level, event = _LOGGED.get(outcome.state, ("error", "request.failed"))
            getattr(log, level)(event, code=error.code, error=error.message)
            try:
                await self.finish(rid, outcome.state, error=ErrorInfo(**error.to_dict()), held=self.stream.held(entry))
            except Exception as write_error:  # what a client wrote under its id must not stop the stage
                if isinstance(write_error, ControlPlaneError) and is_transient_error(write_error):
                    raise
                log.error("worker.status_write_failed", entry=entry.id, cause=error.code, error=str(write_error))
                metrics.ENTRIES.labels(self.stage, "dead_lettered").inc()
                reason = f"{error.code}: {error.message}; and its status could not be written: {write_error}"
                await self._dead_letter(entry, reason=reason, error_code=error.code)
                return
        label = outcome.label if rid is not None else "dead_lettered"
        metrics.ENTRIES.labels(self.stage, label if outcome.entry is not EntryAction.RECOMPUTE else "failed").inc()
        if outcome.entry is EntryAction.DEAD_LETTER:
            await self._dead_letter(entry, reason=error.message, error_code=error.code)
        else:
            await self.stream.ack(entry.id)

    async def _dead_letter(self, entry: Entry, *, reason: str, error_code: str) -> None:
        """Dead-letter ``entry``; if the dead-letter stream refuses it, acknowledge it anyway (logged)."""
        try:
            await self.stream.dead_letter(entry, reason=reason, error_code=error_code)
        except ControlPlaneError as exc:
            if is_transient_error(exc):
                raise
            log.error("worker.dead_letter_failed", entry=entry.id, error=exc.message, reason=reason)
            await self.stream.ack(entry.id)

    async def _record_refusal(self, entry: Entry, error: RejectedError) -> None:
        """Tell a client why its submission was refused, under its ticket (first stage only): every refusal
        of a client's submission, whether or not its request's status says it too (a ``request_id_taken``
        entry writes nothing under the id, which is another job's).  An entry without a ticket (written by
        a services' user) gets none."""
        ticket = entry.text("ticket")
        if self.refusals is None or not ticket:
            return
        try:
            await self.refusals.record(
                ticket,
                entry_id=entry.id,
                tenant=entry.tenant,
                stream=entry.stream,
                error=error,
                request_id=entry.fields.get("request_id"),
            )
        except ControlPlaneError as exc:
            if is_transient_error(exc):
                raise
            log.error("worker.refusal_write_failed", entry=entry.id, error=exc.message)

    async def submitted(self, entry: Entry, envelope: Envelope) -> None:
        """Start a client's request's record (if it has none): ``queued`` at this stage as of its XADD (the
        entry id's milliseconds), so that a trace shows the time it waited.  Clients cannot write records
        (their ACL user may not), so the first stage writes it when it takes the entry."""
        await self.set_status(
            envelope.request_id,
            RequestState.QUEUED,
            mode="create",
            held=self.stream.held(entry),
            **self._submitted(entry),
        )

    def _submitted(self, entry: Entry) -> dict[str, Any]:
        try:
            submitted_at = min(int(entry.id.split("-", 1)[0]) / 1000, time.time())
        except ValueError:
            submitted_at = time.time()
        return {"stage": self.stage, "updated_at": submitted_at}

    def _handed_on(self, entry: Entry, envelope: Envelope) -> dict[str, Any]:
        """A later stage's ``queued``, dated by the hand-off: the producer's own instant of it
        (``trace.hop_started_at``, taken after its ``running``, so that a trace never shows this stage
        queued before the last one ran, as the entry id's whole milliseconds could), unless it is more than
        a second from the entry id's (another clock, or none): then the entry id's."""
        dated = self._submitted(entry)
        hop = envelope.trace.hop_started_at
        if abs(hop - dated["updated_at"]) < 1.0:
            dated["updated_at"] = min(hop, time.time())
        return dated

    def start_writes(self, entry: Entry, envelope: Envelope, *, media_free: bool) -> tuple[StatusWrite, ...]:
        """The status writes that start ``entry``'s work here, in order, for the admission's script to make
        (``EntryGuard.admit_and_look``): a client's entry's :meth:`submitted`, and its :meth:`running` when
        the job has no media to load (``media_free``: a first stage writes ``running`` after loading the
        job's media, which may refuse it, so then that stays a write of its own); on a later stage its
        ``queued`` again (the hand-off wrote it into the record without an event) and :meth:`running`;
        none for an entry of another kind.  The script writes both into the record and one status event
        for them, the ``running`` one, carrying the ``queued`` status (``folded``), dated by the entry's
        id (when it was queued; a later stage's by the hand-off's own instant, :meth:`_handed_on`), so that
        a trace still shows the time the entry waited."""
        if envelope.from_stage == "client":
            queued = self.status_write(
                envelope.request_id, RequestState.QUEUED, mode="create", **self._submitted(entry)
            )
            return (queued, self._running_write(envelope, None)) if media_free else (queued,)
        if self.stages and self.stages[0] != self.stage:
            queued = self.status_write(
                envelope.request_id,
                RequestState.QUEUED,
                mode="update",
                attempt=envelope.attempt,
                timings=envelope.trace.timings,
                **self._handed_on(entry, envelope),
            )
            return (queued, self._running_write(envelope, None))
        return ()

    def _running_write(self, envelope: Envelope, progress: Progress | None) -> StatusWrite:
        return self.status_write(
            envelope.request_id, RequestState.RUNNING, mode="update", **self._running(envelope, progress)
        )

    def _running(self, envelope: Envelope, progress: Progress | None) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "progress": progress,
            "attempt": envelope.attempt,
            "timings": envelope.trace.timings,
        }

    async def running(self, entry: Entry, envelope: Envelope, progress: Progress | None) -> None:
        """Only over an existing record, and only while ``entry`` is held: a request lost with Redis must
        not come back as running."""
        await self.set_status(
            envelope.request_id,
            RequestState.RUNNING,
            mode="update",
            held=self.stream.held(entry),
            **self._running(envelope, progress),
        )

    async def finish(self, rid: str, state: RequestState, *, held: Held | None = None, **fields: Any) -> bool:
        """Write a terminal status (once: a second writer finds it terminal and changes nothing)."""
        return await self.set_status(rid, state, stage=self.stage, held=held, **fields)

    async def lost(self, entry: Entry, rid: str) -> Loss:
        """``entry`` is not held any more: end its request ``request_lost`` if nothing else can settle it
        (:class:`~stageferry.broker.control.record_loss.RecordLoss`).  Never raises but for Redis trouble."""
        index = self.stages.index(self.stage) if self.stage in self.stages else 0
        loss = await self.loss.end_if_lost(
            self.stream.held(entry), rid, stage=self.stage, stage_index=index, link=self.stream.script_link
        )
        log.warning("worker.entry_unheld", entry=entry.id, stream=entry.stream, loss=loss.value)
        return loss

    async def set_status(
        self, rid: str, state: RequestState, *, mode: WriteMode = "any", held: Held | None = None, **fields: Any
    ) -> bool:
        """Write a status; a late one (an earlier attempt, stage or state than the record's) is dropped, and
        with ``held`` (an owned write) one for an entry this stage no longer holds.  Over the stream's script
        link, as the hot path's other scripts."""
        status = RequestStatus(request_id=rid, state=state, **fields)
        index = self.stages.index(status.stage) if status.stage in self.stages else 0
        return await self.store.set_status(
            status, mode=mode, stage_index=index, link=self.stream.script_link, held=held
        )

    def status_write(self, rid: str, state: RequestState, *, mode: WriteMode = "any", **fields: Any) -> StatusWrite:
        """The status write that :meth:`set_status` would make, for a script that makes it part of its own
        step (the admission's start, the hand-off: ``StageStream.hand_off(status=...)``)."""
        status = RequestStatus(request_id=rid, state=state, **fields)
        index = self.stages.index(status.stage) if status.stage in self.stages else 0
        return self.store.status_write(status, mode=mode, stage_index=index)
