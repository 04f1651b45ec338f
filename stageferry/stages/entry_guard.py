"""Untrusted entries meet a stage: who owns a request id, and entries that keep killing the stage.

A stage stream is written by clients too (the raw protocol), so an entry's request id proves nothing.
:class:`EntryGuard` runs on the leader before any work on an entry; it raises typed errors, and the
outcome table (:data:`stageferry.errors.OUTCOMES`) decides the rest:

* **Ownership.**  A request id belongs to its first valid submission: the record ``<p>:req:<id>`` holds
  the digest of that job (``job_sha``), written by the first stage that admits an entry for it.  A later
  entry under the same id with a *different* job — or one that does not parse at all — raises
  :class:`RequestIdTakenError`: dead-lettered, nothing written, so the owner's state, result and events
  stay as they are.  The same job again is admitted (the run-owner key dedupes it downstream).
* **Held.**  Every admission is an owned write (:mod:`stageferry.broker.control.held`): it writes only
  while this stage still holds the entry in its group's pending list.  One it no longer holds (another
  replica reclaimed it, or Redis restarted empty and lost it while the stage ran it) raises
  :class:`RequestLostError`: nothing written, and the outcome decides whether the request is lost for
  good (``broker/control/record_loss``) — an admission that made the record again left a ``running``
  request that nothing held (issue 34).
* **Crash marks.**  Before the work on an entry starts, its crash mark
  ``<p>:req-crash:<id>:<stage>:<entry>`` is incremented (a first delivery's in its admission's script);
  when the work returns or raises, it is deleted — by the script that settles the entry (the hand-off,
  the last stage's finish) when the work got that far, else by a ``DEL`` of its own.
  A mark therefore survives only a process that died (out of memory, a native crash) or a group that
  broke while holding the entry.  An entry found with ``limits.max_crashes`` such marks raises
  :class:`StageCrashedError`: dead-lettered, the request ``failed``, instead of killing every replica;
  the deaths it caused are reported to the replica's supervisor, which stops counting them towards
  giving up (:func:`~stageferry.stages.supervisor.report_settled_crashes`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.held import HELD_FN, Held
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.control.requests import ADMIT_FN, Admission, RequestStore
from stageferry.broker.control.resp_link import RespLink, run_script
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
from stageferry.stages.admission import LOOK_FN, Look
from stageferry.stages.supervisor import report_settled_crashes

log = structlog.get_logger(__name__)

# KEYS: crash mark.  ARGV: ttl.  GET and SET only: commands the stage ACL user has (no INCR).
_MARK = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0') + 1
redis.call('SET', KEYS[1], n, 'EX', ARGV[1])
return n
"""

# Every admission is an owned write (broker/control/held.py): its last key is the entry's stream and its
# held arguments (group, consumer, entry id) come right after the admission's own; when this consumer no
# longer holds the entry (another replica reclaimed it, or Redis lost it) the script writes nothing and
# returns 0 (Admission.UNHELD) — after an empty restart, admission must not make a record for an entry
# that is gone (it would be ``running`` for ever, held by nothing).  Without that last key (a guard with no
# holder: tests of the guard alone) there is no check.

# A redelivery's admission alone.  KEYS: request hash, entry stream.  ARGV: job digest, record ttl, group,
# consumer, entry id.
_ADMIT_HELD = (
    HELD_FN
    + ADMIT_FN
    + """
if #KEYS > 1 and not held(KEYS[2], ARGV[3], ARGV[4], ARGV[5]) then return 0 end
return admit({KEYS[1]}, {ARGV[1], ARGV[2]})
"""
)

# The first delivery's admission and crash mark in one script (one round trip, was two).  KEYS: request
# hash, crash mark, entry stream.  ARGV: job digest, record ttl, mark ttl, group, consumer, entry id.
# Returns what ADMIT_FN returns (0 when not held); a taken id (-1) gets no mark.  A first delivery's mark is
# set to 1, not counted up: nobody ran this entry before, and a script run twice (a call repeated after a
# lost connection) must not count one crash as two.
_ADMIT_AND_MARK = (
    HELD_FN
    + ADMIT_FN
    + """
if #KEYS > 2 and not held(KEYS[3], ARGV[4], ARGV[5], ARGV[6]) then return 0 end
local owner = admit({KEYS[1]}, {ARGV[1], ARGV[2]})
if owner == -1 then return owner end
redis.call('SET', KEYS[2], 1, 'EX', ARGV[3])
return owner
"""
)

# The same, and then what ``Admission.settled`` reads (LOOK_FN, which also writes the entry's start status
# when it will run) in the same step: one round trip for the admission, the mark, the look and the start
# (was three).  KEYS: request hash, crash mark, then LOOK_FN's four, then the entry stream.  ARGV: job
# digest, record ttl, mark ttl, group, consumer, entry id, then LOOK_FN's.  Returns {owner, look...}; a
# taken id (-1) gets no mark and no look, an entry not held ({0}) nothing at all.
_ADMIT_MARK_AND_LOOK = (
    HELD_FN
    + ADMIT_FN
    + LOOK_FN
    + """
local first = 4
if #KEYS > 6 then
  if not held(KEYS[7], ARGV[4], ARGV[5], ARGV[6]) then return {0} end
  first = 7
end
local owner = admit({KEYS[1]}, {ARGV[1], ARGV[2]})
if owner == -1 then return {owner} end
redis.call('SET', KEYS[2], 1, 'EX', ARGV[3])
local look_args = {}
for i = first, #ARGV do look_args[#look_args + 1] = ARGV[i] end
local seen = look({KEYS[3], KEYS[4], KEYS[5], KEYS[6]}, look_args)
return {owner, seen[1], seen[2], seen[3], seen[4], seen[5]}
"""
)


@dataclass(slots=True)
class CrashMark:
    """An entry's crash mark while its work runs (:meth:`EntryGuard.crash_mark`): a script that settles the
    entry deletes ``key`` in the same step and sets ``cleared``, so that no separate ``DEL`` follows."""

    key: str
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
    ) -> None:
        self.redis = redis
        self._link = link  # the stage stream's script link: a first delivery's admission is on every hop
        #: How this stage holds an entry (``StageStream.held``); admissions are owned writes.  None (tests of
        #: the guard alone, on entries of no stream): every entry counts as held.
        self._holder = holder
        self.keys = keys
        self.store = store
        self.stage = stage
        self.limits = limits
        self.ttl_s = ttl_s
        self._mark = redis.register_script(_MARK)
        self._admit_held = redis.register_script(_ADMIT_HELD)
        self._admit_and_mark = redis.register_script(_ADMIT_AND_MARK)
        self._admit_mark_and_look = redis.register_script(_ADMIT_MARK_AND_LOOK)

    async def unparsed(self, rid: str, exc: RejectedError) -> RejectedError:
        """What an entry that does not parse ends as: its own rejection if no job owns ``rid`` (a raw
        client learns why), else :class:`RequestIdTakenError` (the owner's record is left alone)."""
        if await self.store.owner(rid) is None:
            return exc
        return RequestIdTakenError(f"request id already in use; this entry is invalid: {exc.message}")

    def _held(self, entry: Entry) -> tuple[list[str], list[Any]]:
        """The held check's key and arguments for ``entry``; none without a holder (no check then)."""
        if self._holder is None:
            return [], []
        held = self._holder(entry)
        return [held.stream], held.args()

    async def admit(self, envelope: Envelope, entry: Entry) -> bool:
        """Bind the request id to this entry's job (first valid submission wins), or raise
        :class:`RequestIdTakenError` when the id already belongs to a different job, or
        :class:`RequestLostError` when this stage no longer holds the entry (nothing written).

        A first delivery has no crash marks to check, so its mark is set in the same script (one round
        trip): True then, and the caller passes ``marked=True`` to :meth:`crash_mark` (or calls
        :meth:`unmark` if it gives up before).  A redelivery is admitted alone (False): its marks are
        checked first (:meth:`check_crashes`)."""
        rid, digest = envelope.request_id, envelope.job.digest()
        keys, args = self.store.admit_write(rid, digest)
        held_keys, held_args = self._held(entry)
        if entry.deliveries > 1:
            script, keys, args = self._admit_held, [*keys, *held_keys], [*args, *held_args]
        else:
            mark = self.keys.crash_mark(rid, self.stage, entry.id)
            script, keys, args = self._admit_and_mark, [*keys, mark, *held_keys], [*args, self.ttl_s, *held_args]
        with translated():
            outcome = Admission(int(await run_script(self._link, script, keys, args)))
        _refuse(outcome)
        return entry.deliveries <= 1

    async def admit_and_look(
        self, envelope: Envelope, entry: Entry, look: tuple[list[str], list[Any]]
    ) -> tuple[bool, Look | None]:
        """:meth:`admit`, and for a first delivery also what ``Admission.settled`` reads — ``look``:
        ``Admission.look_write``'s keys and arguments — in the same script: (marked, what it read).  A
        redelivery is admitted alone (its crash marks come first): (False, None)."""
        if entry.deliveries > 1:
            return await self.admit(envelope, entry), None
        rid, digest = envelope.request_id, envelope.job.digest()
        keys, args = self.store.admit_write(rid, digest)
        mark = self.keys.crash_mark(rid, self.stage, entry.id)
        look_keys, look_args = look
        held_keys, held_args = self._held(entry)
        with translated():
            reply = await run_script(
                self._link,
                self._admit_mark_and_look,
                [*keys, mark, *look_keys, *held_keys],
                [*args, self.ttl_s, *held_args, *look_args],
            )
        _refuse(Admission(int(reply[0])))
        _, status, cancelled, claimed, owner, started = reply
        return True, (status, int(cancelled), int(claimed), owner, int(started))

    async def check_crashes(self, entry: Entry, rid: str) -> None:
        """:class:`StageCrashedError` when the stage died with this entry ``limits.max_crashes`` times in a
        row (the mark is cleared: the entry is dead-lettered)."""
        if entry.deliveries <= 1:
            return  # a first delivery: no one ran this entry before, so no mark can exist (no round trip)
        limit = self.limits.max_crashes
        key = self.keys.crash_mark(rid, self.stage, entry.id)
        with translated():
            crashes = int(await self.redis.get(key) or 0)
        if crashes < limit:
            return
        await self._clear(key, entry)
        report_settled_crashes(crashes)  # its supervisor takes these deaths off its count of restarts
        reason = f"the {self.stage} stage died {crashes} times in a row running this request (limit {limit})"
        raise StageCrashedError(reason, crashes=crashes, limit=limit)

    @contextlib.asynccontextmanager
    async def crash_mark(self, entry: Entry, rid: str, *, marked: bool = False) -> AsyncIterator[CrashMark]:
        """Count this delivery as a crash until the work in the block returns or raises (``marked``: the
        count was made already, by :meth:`admit`); the block may have it cleared by the script that settles
        the entry (:class:`CrashMark`)."""
        mark = CrashMark(self.keys.crash_mark(rid, self.stage, entry.id))
        if not marked:
            with translated():
                await self._mark(keys=[mark.key], args=[self.ttl_s])
        try:
            yield mark
        except GroupBrokenError:
            raise  # a rank died, perhaps of this request: the mark stays
        except Exception:
            if not mark.cleared:
                await self._clear(mark.key, entry)
            raise
        if not mark.cleared:
            await self._clear(mark.key, entry)

    async def unmark(self, entry: Entry, rid: str) -> None:
        """Take back the mark :meth:`admit` made, when the work will not run (a check refused the entry)."""
        await self._clear(self.keys.crash_mark(rid, self.stage, entry.id), entry)

    async def _clear(self, key: str, entry: Entry) -> None:
        with anyio.CancelScope(shield=True):
            try:
                with translated():
                    await self.redis.delete(key)
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
