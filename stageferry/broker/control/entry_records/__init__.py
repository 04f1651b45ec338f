"""Every write of an entry's life to its request's record, as whole Lua scripts with typed replies.

An entry a stage takes changes its request's record ``<p>:req:<id>`` (and events stream
``<p>:req-events:<id>``) at a few points: its admission (whose job the id is; :class:`Admission`), its
crash mark, what the stage must know before it runs it (:class:`Look`: the record's status, the cancel
flag, which entry owns the run), the status writes (:class:`StatusWrite`), and the step that settles it — the
hand-off to the next stage or the last stage's finish.  This package owns those scripts (:mod:`.scripts`:
one Redis Functions library, each step a function of it);
stages hold the policy (what to write when) and call :class:`EntryRecords` with named parameters, getting
frozen dataclasses back.  :class:`~stageferry.broker.control.requests.RequestStore` and
:class:`~stageferry.broker.control.streams.StageStream` register the status write, the hand-off and the
finish from here.

Each script is one atomic step, so that each costs one round trip and the fewest commands: every script
reads the record once (``HMGET``, the library's ``record``), its steps share that read and their
writes reach the record in one ``HSET`` at the end (``save``).  A request's record and events stream
live at least ``ttl`` after its terminal status: a write sets their TTLs to ``ttl`` and a margin (a
tenth of it, a minute at most: :func:`refreshed_ttl_ms`), and sets them again only once less than ``ttl``
is left (``refresh_due``: the record keeps when they expire, ``ttl_at``, by the server's clock as a status
event's id tells it), so that after every write they live at least ``ttl``, and neither a request's quick
succession of writes nor its end within the margin pays two ``PEXPIRE`` each.  Every
script that writes on a stage's behalf first checks, in the same script, that the stage still holds the
entry (:mod:`.held`: an owned write).  Scripts use only the commands of the stage ACL user
(:data:`stageferry.acl.STAGE_COMMANDS`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import redis.asyncio as aioredis

from stageferry.broker.control.entry_records.scripts import (
    ADMIT,
    ADMIT_AND_MARK,
    ADMIT_MARK_AND_LOOK,
    END_IF_LOST,
    FINISH,
    HAND_OFF,
    LIBRARY,
    LOOK,
    MARK,
    SET_STATUS,
)
from stageferry.broker.control.held import Held
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.control.resp_link import RespLink, run_script

#: How a status write treats a missing record (see :meth:`RequestStore.set_status`).
WriteMode = Literal["any", "create", "update", "unowned"]


class Admission(enum.Enum):
    """Whose a request id is, as a stage finds it when an entry arrives."""

    NEW = 2  #: no job's: the record now belongs to this entry's job
    SAME_JOB = 1  #: this same job's (its submission, or a duplicate of it)
    TAKEN = -1  #: a different job's: the entry must not touch the record
    UNHELD = 0  #: the stage no longer holds the entry (reclaimed elsewhere, or lost with Redis): nothing written


@dataclass(frozen=True, slots=True)
class StatusOrder:
    """Where a status sits in a request's progress: compared field by field by the writing script, as
    :meth:`key` (fixed-width fields, so that Lua compares two orders as strings)."""

    attempt: int
    stage_index: int
    rank: int  #: queued 0, running 1, terminal 2
    step: int  #: the progress step (0 without progress)

    #: Each field's digits in :meth:`key` (19 characters in all: the scripts' ``before`` knows the form by it).
    WIDTHS: ClassVar[tuple[int, int, int, int]] = (5, 3, 1, 7)

    def key(self) -> str:
        """The order as its four fields, space-separated, each zero-padded to its width (:data:`WIDTHS`; a
        larger value is cut to the width's largest, which no pipeline reaches: 99,999 attempts, 999 stages,
        9,999,999 steps).  Two keys compare as strings the way their fields compare as numbers, and a stage
        of the version before, which parses the numbers, reads the same order."""
        values = (self.attempt, self.stage_index, self.rank, self.step)
        return " ".join(f"{min(max(v, 0), 10**w - 1):0{w}d}" for v, w in zip(values, self.WIDTHS, strict=True))


@dataclass(frozen=True, slots=True)
class StatusWrite:
    """One status write, as a script makes it (:meth:`RequestStore.status_write` builds it)."""

    record: str  #: the request hash
    events: str  #: the request's events stream
    state: str
    status_json: str
    mode: WriteMode
    order: StatusOrder
    ttl_s: int
    events_maxlen: int

    def args(self) -> list[Any]:
        """The six arguments the scripts' ``set_status`` and ``emit`` read from ``ARGV``, in their order."""
        return [self.state, self.status_json, self.ttl_s, self.events_maxlen, self.mode, self.order.key()]


@dataclass(frozen=True, slots=True)
class Look:
    """What a stage reads before it runs an entry (``Admission.settled`` decides on it)."""

    status: bytes | None  #: the record's status JSON as it was before this entry's start (None: none)
    cancelled: bool  #: the request's cancel flag is set
    claimed: bool  #: the run was taken now, by this entry
    owner: str | None  #: the entry that owns this run (request, stage, attempt)
    started: bool = False  #: the start statuses were written (the entry will run)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A first delivery's start (:meth:`EntryRecords.admit_mark_and_look`)."""

    admission: Admission
    look: Look | None  #: None when the id is taken or the entry not held (nothing looked at)


@dataclass(frozen=True, slots=True)
class EntryKeys:
    """The keys of one entry's run at one stage."""

    record: str
    events: str
    cancel: str
    crash_field: str  #: the record's field counting the deliveries of this entry its stage died with
    run_field: str  #: the record's field naming the entry that owns this run (request, stage, attempt)

    @classmethod
    def of(cls, keys: Keys, request_id: str, stage: str, attempt: int, entry_id: str) -> EntryKeys:
        return cls(
            record=keys.request(request_id),
            events=keys.events(request_id),
            cancel=keys.cancel(request_id),
            crash_field=crash_field(stage, entry_id),
            run_field=run_field(stage, attempt),
        )


def crash_field(stage: str, entry_id: str) -> str:
    """The record's field counting the deliveries of an entry that ended with its stage dying (set before
    the work, cleared after: '' or absent is no mark)."""
    return f"crash:{stage}:{entry_id}"


def run_field(stage: str, attempt: int) -> str:
    """The record's field that binds one stream entry to each run (stage, attempt) of a request."""
    return f"run:{stage}:{attempt}"


def refreshed_ttl_ms(ttl_s: int) -> int:
    """What a refresh sets a request's record and events TTLs to (ms): ``ttl_s`` and a tenth of it, a
    minute at most (the scripts' ``margin_ms``); a writer of the events stream outside the scripts (a log
    sink) sets the same, so that it never cuts short what the last refresh promised."""
    ttl_ms = ttl_s * 1000
    return ttl_ms + min(ttl_ms // 10, 60_000)


def _held(held: Held | None, entry_id: str = "") -> tuple[list[str], list[Any]]:
    """The held check's key and its three arguments (empty ones, and no key, without a holder)."""
    if held is None:
        return [], ["", "", entry_id]
    return [held.stream], held.args()


def _text(raw: Any) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else raw


class EntryRecords:
    """The entry-life scripts of one stage (or of a tool, without ``stage``), over ``link`` when given."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int, link: RespLink | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s  #: the record's TTL
        self.link = link
        self._admit = ADMIT.bind(redis)
        self._admit_and_mark = ADMIT_AND_MARK.bind(redis)
        self._admit_mark_and_look = ADMIT_MARK_AND_LOOK.bind(redis)
        self._look = LOOK.bind(redis)
        self._mark = MARK.bind(redis)

    async def admit(self, request_id: str, digest: str, *, held: Held | None = None) -> Admission:
        """Bind ``request_id`` to the job with ``digest`` unless it is bound already; with ``held`` an owned
        write (:attr:`Admission.UNHELD`, nothing written, when the entry is not held any more)."""
        held_keys, held_args = _held(held)
        keys, args = [self.keys.request(request_id), *held_keys], [digest, self.ttl_s, *held_args]
        with translated():
            return Admission(int(await run_script(self.link, self._admit, keys, args)))

    async def admit_and_mark(self, run: EntryKeys, digest: str, *, held: Held | None = None) -> Admission:
        """:meth:`admit` and, unless the id is taken, the entry's first crash mark, in one script."""
        held_keys, held_args = _held(held)
        keys, args = [run.record, *held_keys], [digest, self.ttl_s, *held_args, run.crash_field]
        with translated():
            return Admission(int(await run_script(self.link, self._admit_and_mark, keys, args)))

    async def admit_mark_and_look(
        self, run: EntryKeys, digest: str, entry_id: str, *, held: Held | None, starts: tuple[StatusWrite, ...] = ()
    ) -> Admitted:
        """A first delivery's admission, crash mark and :class:`Look` in one script, writing ``starts`` (in
        order) when the entry will run (not cancelled, and it owns its run)."""
        held_keys, held_args = _held(held, entry_id)
        keys = [run.record, run.cancel, run.events, *held_keys]
        args: list[Any] = [digest, self.ttl_s, *held_args, run.run_field, run.crash_field, len(starts)]
        for start in starts:
            args += start.args()
        with translated():
            reply = await run_script(self.link, self._admit_mark_and_look, keys, args)
        admission = Admission(int(reply[0]))
        if len(reply) == 1:
            return Admitted(admission, None)
        _, status, cancelled, claimed, owner, started = reply
        look = Look(status, bool(int(cancelled)), bool(int(claimed)), _text(owner), bool(int(started)))
        return Admitted(admission, look)

    async def look(self, run: EntryKeys, entry_id: str) -> Look:
        """What a stage reads before it runs an entry it admitted alone (a redelivery), in one script."""
        keys, args = [run.record, run.cancel], [entry_id, run.run_field, self.ttl_s]
        with translated():
            status, cancelled, claimed, owner = await run_script(self.link, self._look, keys, args)
        return Look(status, bool(int(cancelled)), bool(int(claimed)), _text(owner))

    async def crashes(self, record: str, field: str) -> int:
        """How many times the stage died running an entry (its crash mark: ``field`` of ``record``)."""
        with translated():
            raw = await self.redis.hget(record, field)
        count = raw.split(b":", 1)[0] if raw else b""  # ``<count>`` or ``<count>:<delivery>`` (MARK's)
        return int(count) if count else 0

    async def mark(self, record: str, field: str, delivery: int) -> int:
        """Count this delivery of an entry (``delivery``: the stream's delivery count, which no other
        delivery of it has) as a crash until :meth:`clear_mark`; the count so far.  Idempotent for one
        delivery: a retry after a lost reply does not count it twice."""
        with translated():
            return int(await run_script(self.link, self._mark, [record], [field, delivery]))

    async def clear_mark(self, record: str, field: str) -> None:
        """The entry's work returned or raised: it did not kill the stage."""
        with translated():
            await self.redis.hdel(record, field)


__all__ = [
    "ADMIT",
    "ADMIT_AND_MARK",
    "ADMIT_MARK_AND_LOOK",
    "END_IF_LOST",
    "FINISH",
    "HAND_OFF",
    "LIBRARY",
    "LOOK",
    "MARK",
    "SET_STATUS",
    "Admission",
    "Admitted",
    "EntryKeys",
    "EntryRecords",
    "Look",
    "StatusOrder",
    "StatusWrite",
    "WriteMode",
    "crash_field",
    "refreshed_ttl_ms",
    "run_field",
]
