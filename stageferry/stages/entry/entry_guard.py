"""Untrusted entries meet a stage: who owns a request id, and entries that keep killing the stage.

A stage stream is written by clients too (the raw protocol), so an entry's request id proves nothing.
:class:`EntryGuard` runs on the leader before any work on an entry; it raises typed errors, and the
outcome table (:data:`stageferry.errors.OUTCOMES`) decides the rest:

* **Ownership.**  A request id belongs to its first valid submission: the record ``<p>:req:<id>`` holds
  the digest of that job (``job_sha``), written by the first stage that admits an entry for it.  A later
  entry under the same id with a *different* job — or one that does not parse at all — raises
  :class:`RequestIdTakenError`: dead-lettered, nothing written, so the owner's state, result and events
  stay as they are.  The same job again is admitted (its record's run-owner field dedupes it downstream).
* **Held.**  Every admission is an owned write (:mod:`stageferry.broker.control.held`): it writes only
  while this stage still holds the entry in its group's pending list.  One it no longer holds (another
  replica reclaimed it, or Redis restarted empty and lost it while the stage ran it) raises
  :class:`RequestLostError`: nothing written, and the outcome decides whether the request is lost for
  good (``broker/control/record_loss``) — an admission that made the record again left a ``running``
  request that nothing held (issue 34).
* **Crash marks.**  Before the work on an entry starts, its crash mark — the field
  ``crash:<stage>:<entry>`` of the request's record — is incremented (a first delivery's in its admission's script);
  when the work returns or raises, it is cleared — by the script that settles the entry (the hand-off,
  the last stage's finish) when the work got that far, else by an ``HDEL`` of its own.
  A mark therefore survives only a process that died (out of memory, a native crash) or a group that
  broke while holding the entry.  An entry found with ``limits.max_crashes`` such marks raises
  :class:`StageCrashedError`: dead-lettered, the request ``failed``, instead of killing every replica;
  the deaths it caused are reported to the replica's supervisor, which stops counting them towards
  giving up (:func:`~stageferry.stages.process.supervisor.report_settled_crashes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.entry_records import (
    Admission,
    EntryKeys,
    EntryRecords,
    Look,
    StatusWrite,
    crash_field,
)
from stageferry.broker.control.held import Held
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.resp_link import RespLink
from stageferry.broker.control.streams import Entry
from stageferry.config import Limits
from stageferry.errors import (
    ControlPlaneError,
    GroupBrokenError,
    RejectedError,
    RequestIdTakenError,
    RequestLostError,
    StageCrashedError,
)
from stageferry.schemas import Envelope
from stageferry.stages.process.supervisor import report_settled_crashes

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class CrashMark:
    """An entry's crash mark while its work runs (:meth:`EntryGuard.crash_mark`): ``field`` of the request's
    ``record``; a script that settles the entry clears it in the same step and sets ``cleared``, so that no
    separate ``HDEL`` follows."""

    record: str
    field: str
    cleared: bool = False


class EntryGuard:
    """One stage's ownership and crash checks (leader only; see the module docstring)."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        store: RequestStore,
        stage: str,
        limits: Limits,
        ttl_s: int,
        link: RespLink | None = None,
        holder: Callable[[Entry], Held] | None = None,
        records: EntryRecords | None = None,
    ) -> None:
        self.redis = redis
        #: How this stage holds an entry (``StageStream.held``); admissions are owned writes.  None (tests of
        #: the guard alone, on entries of no stream): every entry counts as held.
        self._holder = holder
        self.keys = keys
        self.store = store
        self.stage = stage
        self.limits = limits
        self.ttl_s = ttl_s
        #: The entry-life scripts (a leader's, over its stream's script link: a first delivery's admission is
        #: on every hop), or this guard's own.
        self.records = records or EntryRecords(redis, keys, ttl_s=ttl_s, link=link)

    async def unparsed(self, rid: str, exc: RejectedError) -> RejectedError:
        """What an entry that does not parse ends as: its own rejection if no job owns ``rid`` (a raw
        client learns why), else :class:`RequestIdTakenError` (the owner's record is left alone)."""
        if await self.store.owner(rid) is None:
            return exc
        return RequestIdTakenError(f"request id already in use; this entry is invalid: {exc.message}")

    def _held(self, entry: Entry) -> Held | None:
        return None if self._holder is None else self._holder(entry)

    def _run(self, envelope: Envelope, entry: Entry) -> EntryKeys:
        return EntryKeys.of(self.keys, envelope.request_id, self.stage, envelope.attempt, entry.id)

    async def admit(self, envelope: Envelope, entry: Entry) -> bool:
        """Bind the request id to this entry's job (first valid submission wins), or raise
        :class:`RequestIdTakenError` when the id already belongs to a different job, or
        :class:`RequestLostError` when this stage no longer holds the entry (nothing written).

        A first delivery has no crash marks to check, so its mark is set in the same script (one round
        trip): True then, and the caller passes ``marked=True`` to :meth:`crash_mark` (or calls
        :meth:`unmark` if it gives up before).  A redelivery is admitted alone (False): its marks are
        checked first (:meth:`check_crashes`)."""
        digest, held = envelope.job.digest(), self._held(entry)
        if entry.deliveries > 1:
            _refuse(await self.records.admit(envelope.request_id, digest, held=held))
            return False
        _refuse(await self.records.admit_and_mark(self._run(envelope, entry), digest, held=held))
        return True

    async def admit_and_look(
        self, envelope: Envelope, entry: Entry, starts: tuple[StatusWrite, ...] = ()
    ) -> tuple[bool, Look | None]:
        """:meth:`admit`, and for a first delivery also what ``Admission.settled`` reads, in the same script,
        which writes ``starts`` (``Outcomes.start_writes``) when the entry will run: (marked, what it read).
        A redelivery is admitted alone (its crash marks come first): (False, None)."""
        if entry.deliveries > 1:
            return await self.admit(envelope, entry), None
        run = self._run(envelope, entry)
        admitted = await self.records.admit_mark_and_look(
            run, envelope.job.digest(), entry.id, held=self._held(entry), starts=starts
        )
        _refuse(admitted.admission)
        return True, admitted.look

    async def check_crashes(self, entry: Entry, rid: str) -> None:
        """:class:`StageCrashedError` when the stage died with this entry ``limits.max_crashes`` times in a
        row (the mark is cleared: the entry is dead-lettered)."""
        if entry.deliveries <= 1:
            return  # a first delivery: no one ran this entry before, so no mark can exist (no round trip)
        limit = self.limits.max_crashes
        record, field = self.keys.request(rid), crash_field(self.stage, entry.id)
        crashes = await self.records.crashes(record, field)
        if crashes < limit:
            return
        await self._clear(record, field, entry)
        report_settled_crashes(crashes)  # its supervisor takes these deaths off its count of restarts
        reason = f"the {self.stage} stage died {crashes} times in a row running this request (limit {limit})"
        raise StageCrashedError(reason, crashes=crashes, limit=limit)

    @contextlib.asynccontextmanager
    async def crash_mark(self, entry: Entry, rid: str, *, marked: bool = False) -> AsyncIterator[CrashMark]:
        """Count this delivery as a crash until the work in the block returns or raises (``marked``: the
        count was made already, by :meth:`admit`); the block may have it cleared by the script that settles
        the entry (:class:`CrashMark`)."""
        mark = CrashMark(self.keys.request(rid), crash_field(self.stage, entry.id))
        if not marked:
            await self.records.mark(mark.record, mark.field, entry.deliveries)
        try:
            yield mark
        except GroupBrokenError:
            raise  # a rank died, perhaps of this request: the mark stays
        except Exception:
            if not mark.cleared:
                await self._clear(mark.record, mark.field, entry)
            raise
        if not mark.cleared:
            await self._clear(mark.record, mark.field, entry)

    async def unmark(self, entry: Entry, rid: str) -> None:
        """Take back the mark :meth:`admit` made, when the work will not run (a check refused the entry)."""
        await self._clear(self.keys.request(rid), crash_field(self.stage, entry.id), entry)

    async def _clear(self, record: str, field: str, entry: Entry) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.records.clear_mark(record, field)
            except ControlPlaneError as exc:
                log.warning("worker.crash_mark_not_cleared", entry=entry.id, error=exc.message)


def _refuse(outcome: Admission) -> None:
    """Raise what an admission that did not admit means."""
    if outcome is Admission.TAKEN:
        raise RequestIdTakenError("request id already in use by a different job")
    if outcome is Admission.UNHELD:
        raise RequestLostError(
            "this replica no longer holds the entry (another replica reclaimed it, or Redis lost it)", unheld=True
        )


__all__ = ["CrashMark", "EntryGuard"]
