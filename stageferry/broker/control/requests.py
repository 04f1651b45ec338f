"""Request records in Redis: submit once, status transitions, terminal results written once (waits: request_waits).

A request's record is the hash ``<p>:req:<id>`` (``state`` and ``status`` JSON); every status change is
also appended to ``<p>:req-events:<id>``, so a waiter blocks on that stream instead of polling — through
the store's one shared reader (:class:`~stageferry.broker.control.fanin.EventFanIn`), so that a thousand
waiters hold one connection, not a thousand.  Waits ride through a Redis outage within their timeout.
Stages write records, in Lua scripts, so that a terminal state is written exactly once even when two
replicas race after a crash.  Clients run no scripts (their ACL user may not): a submission is one
pipeline (its push, then its marker), and until the first stage picks it up the request is known by its
"submitted" marker.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.entry_records import (
    ADMIT,
    SET_STATUS,
    Admission,
    StatusOrder,
    StatusWrite,
    WriteMode,
    refreshed_ttl_ms,
)
from stageferry.broker.control.fanin import EventFanIn, FieldReads
from stageferry.broker.control.held import Held
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import (
    durability_of,
    translated,
)
from stageferry.broker.control.replication import (
    check_submission,
    exchange,
    replicated_script,
    replicated_transaction,
    wait_command,
)
from stageferry.broker.control.request_waits import TERMINAL_NAMES, RequestWaits
from stageferry.broker.control.resp_link import RespLink, run_pipeline, run_script
from stageferry.errors import (
    QueueFullError,
    RequestIdTakenError,
)
from stageferry.schemas import JobRequest, RequestState, RequestStatus
from stageferry.schemas.submission import new_ticket, submission_item
from stageferry.schemas.validation import parse_status

log = structlog.get_logger(__name__)
#: A submission whose uploads add up to more than this goes through redis-py's pool, not a client's lean
#: link: a link is one socket, so a large write would queue every other caller's commands behind it, and
#: its reply timer starts at the write.
LINK_MAX_UPLOAD_BYTES = 64 * 1024
#: Where a state sits in a request's progress through one stage (terminal states are written once anyway).
#: Scripts use only the commands of the stage ACL user (``stageferry.acl``): HGET, not HMGET.
STATE_RANK = {RequestState.QUEUED: 0, RequestState.RUNNING: 1}


def _raised(replies: list[Any]) -> list[Any]:
    """A pipeline's replies, its first error reply raised (as redis-py's ``execute()`` does)."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def taken(request_id: str) -> RequestIdTakenError:
    """The conflict a second, different submission under a used id gets."""
    return RequestIdTakenError(
        f"request id {request_id!r} is already used by a different job; submit under a new id",
        request_id=request_id,
    )


class RequestStore(RequestWaits):
    """Reads and writes request records under one key prefix."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int, events_maxlen: int) -> None:
        self._redis = redis
        self.redis = redis  #: the client this store's scripts are registered on
        self._keys = keys
        self._ttl = ttl_s
        self._maxlen = events_maxlen
        self._set_status = SET_STATUS.bind(redis)
        self._admit = ADMIT.bind(redis)
        #: How many replicas a submission and a terminal status must reach (the URL's ``wait_replicas``).
        self.durability = durability_of(redis)
        #: The one blocking reader every wait and follow of this store shares.
        self.fanin = EventFanIn(redis)
        #: Status reads asked for at once (a thousand waits starting) share round trips.
        self.status_reads = FieldReads(redis, "status")
        #: Owner reads likewise (a client checks ``job_sha`` after each wait of its own submissions).
        self.owner_reads = FieldReads(redis, "job_sha")
        #: Each intake list's length as this store last saw it (its ``LLEN``, or the reply of its own
        #: push): a submission reads the length only when it is unknown or was half way to the bound.
        self._intake_seen: dict[str, int] = {}

    async def submit(
        self,
        request_id: str,
        job: JobRequest,
        first_stage: str,
        *,
        stream_maxlen: int,
        tenant: str | None = None,
        uploads: Mapping[str, bytes] | None = None,
        upload_ttl_s: int = 3600,
        link: RespLink | None = None,
        ticket: str | None = None,
    ) -> str | None:
        """Enqueue a job once, without scripts (a client's ACL user may not run any): the submission's
        ticket (:mod:`stageferry.schemas.submission`: where a refusal of it is recorded), or None if
        ``request_id`` is already known (nothing is enqueued, nothing uploaded);
        :class:`RequestIdTakenError` if a stage admitted the id for a *different* job (nothing enqueued).

        One pipeline writes, in this order, the uploads, the submission, pushed onto the first stage's
        intake list (``tenant``'s when given; the stage moves it into its stream), and the "submitted"
        marker (``SET NX``); when its push fails the uploads and the marker it wrote are withdrawn
        (:meth:`_withdraw`) and the push's error raised.  No ``MULTI`` (two commands of a submission's
        six): Redis runs one client's pipelined commands in order, and a connection lost part-way can
        only leave uploads that expire, or a queued submission without its marker — which runs as any
        submission does; its marker only makes a resubmission before the stage's record exists an
        acknowledgement instead of a second push, and a second push runs once (the stage's admission).
        The order is what makes that so: a marker before its push could be left alone, an id known
        with nothing queued.  Which submission of an id wins is decided by the first stage (duplicates are
        acknowledged there), not by this client: two clients racing on one id both enqueue, and the stage
        runs it once.  :class:`QueueFullError` when the intake holds ``stream_maxlen`` submissions
        (checked just before, in the same round trip as whether the id is known; whose it is, only for a
        known id) — read only while the length this store last saw (its last check, or its own push's
        reply) is unknown or at least half the bound: far from full, a submission pays no ``LLEN``.
        Concurrent submissions may pass the bound by as many as are in flight, checked or not, as they
        always could; the bound is the cooperating clients' back-pressure (a hostile client's user may
        push at will: the stage's move and ``maxmemory`` bound what it can do).  The
        round trips go over ``link`` (the client's lean connection) when given and the uploads are small
        (:data:`LINK_MAX_UPLOAD_BYTES`): redis-py's pipelines were most of a client's CPU per submission
        (``benchmarks/throughput.py``).  A connection lost after the writes were sent repeats them through
        redis-py, as redis-py's own retries would: the submission may then be queued twice, and the first
        stage runs it once.

        With ``wait_replicas`` (:mod:`.replication`) the writes are one MULTI, followed by ``WAIT`` on its connection,
        and fewer replicas than asked is :class:`NotReplicatedError`; a known id then proves its earlier
        write the same way (its marker rewritten as it is, ``SET XX KEEPTTL``, then ``WAIT``) before it is
        acknowledged, so a resubmission never acknowledges a write that a failover could still lose."""
        intake = self._keys.intake(first_stage, tenant)
        rkey = self._keys.request(request_id)
        checks: list[tuple[Any, ...]] = [("EXISTS", rkey, self._keys.submitted(request_id))]
        seen = self._intake_seen.get(intake)
        if seen is None or seen >= stream_maxlen // 2:  # else the backlog is far from full: no LLEN
            checks.append(("LLEN", intake))
        uploads = uploads or {}
        if sum(len(blob) for blob in uploads.values()) > LINK_MAX_UPLOAD_BYTES:
            link = None
        ticket = ticket or new_ticket()
        with translated():  # the two checks: one round trip
            known, *length = _raised(await run_pipeline(link, self._redis, checks, block_s=0.0))
            queued = int(length[0]) if length else 0
            if length:
                self._intake_seen[intake] = queued
            # Whose the id is matters only for a known one (no record, no owner): read then, one round
            # trip more for a resubmission, one command fewer for every new submission.
            owner = None
            if known:
                (owner,) = _raised(await run_pipeline(link, self._redis, [("HGET", rkey, "job_sha")], block_s=0.0))
            if owner is not None and owner.decode() != job.digest():
                raise taken(request_id)
            if known:
                if self.durability.on:
                    await self._prove_replicated(request_id, first_stage, link)
                return None
            if queued >= stream_maxlen:
                raise QueueFullError("the first stage's queue is full; retry later", stage=first_stage)
            marker = self._keys.submitted(request_id)
            writes: list[tuple[Any, ...]] = [
                *(("SET", key, blob, "EX", upload_ttl_s) for key, blob in uploads.items()),
                ("RPUSH", intake, submission_item(ticket, request_id, job.model_dump_json())),
                ("SET", marker, first_stage, "NX", "EX", self._ttl),
            ]
            if self.durability.on:
                replies = await replicated_transaction(
                    link, self._redis, writes, self.durability, what=f"submission {request_id}", raise_errors=False
                )
            else:  # in order, in one write: see the docstring for why no MULTI
                replies = await run_pipeline(link, self._redis, writes, block_s=0.0)
            pushed = replies[len(uploads)]
            if isinstance(pushed, Exception):  # nothing rolls back: undo what was written, then fail
                written = [*replies[: len(uploads)], replies[-1]]
                await self._withdraw(link, [*uploads, marker], written, request_id)
                raise pushed
            _raised(replies)
            self._intake_seen[intake] = int(pushed)  # RPUSH's reply: the list's length with this one
        return ticket

    async def _prove_replicated(self, request_id: str, first_stage: str, link: RespLink | None) -> None:
        """An id submitted before is on enough replicas (:class:`NotReplicatedError` if not): its marker is
        rewritten as it is (a write, so ``WAIT`` on this connection covers every earlier one), then
        ``WAIT``.  A marker already gone means a stage took the request: its own writes waited."""
        marker = ("SET", self._keys.submitted(request_id), first_stage, "XX", "KEEPTTL")
        _, acked = await exchange(
            link, self._redis, [marker, wait_command(self.durability)], block_s=self.durability.timeout_ms / 1000
        )
        if isinstance(acked, Exception):
            raise acked
        check_submission(int(acked), self.durability, what=f"submission {request_id}")

    async def _withdraw(self, link: RespLink | None, keys: Sequence[str], replies: Sequence[Any], rid: str) -> None:
        """A submission whose push failed: its uploads and its "submitted" marker, where this submission
        wrote them (a marker another submission holds stays), are deleted — with the client user's own
        command (``SET ... XX PXAT 1``, a time long past: Redis deletes the key; it may not ``DEL``), so
        that no ``queued`` request is left that no entry holds (issue 34: the gateway's 503 named an id
        whose status said ``queued`` for 24 h).  A failure here is logged; the submission's own error is
        what the caller gets."""
        undo = [
            ("SET", key, b"", "XX", "PXAT", 1)
            for key, reply in zip(keys, replies, strict=True)
            if reply is not None and not isinstance(reply, Exception)
        ]
        try:
            _raised(await run_pipeline(link, self._redis, undo, block_s=0.0))
        except Exception as exc:  # noqa: BLE001 - the push's error is raised by the caller
            log.warning("request.submit_not_withdrawn", request_id=rid, error=str(exc))
        else:
            log.warning("request.submit_withdrawn", request_id=rid, keys=len(undo))

    async def result(self, request_id: str) -> bytes | None:
        """The stored result (e.g. the MP4), if the last stage stored it in Redis."""
        with translated():
            value = await self._redis.get(self._keys.result(request_id))
        return value if value is None or isinstance(value, bytes) else str(value).encode()

    async def known(self, request_id: str) -> bool:
        """True if the request has a record, or a client marked it submitted (not yet picked up)."""
        with translated():
            return bool(await self._redis.exists(self._keys.request(request_id), self._keys.submitted(request_id)))

    async def admit(self, request_id: str, job_digest: str) -> Admission:
        """Bind ``request_id`` to the job with ``job_digest`` unless it is bound already (one script,
        :data:`~stageferry.broker.control.entry_records.ADMIT`): a request's record belongs to its first
        valid submission."""
        with translated():
            result = int(await self._admit(keys=[self._keys.request(request_id)], args=[job_digest, self._ttl]))
        return Admission(result)

    async def owner(self, request_id: str) -> str | None:
        """The digest of the job ``request_id`` belongs to, once a stage admitted it."""
        digest = await self.owner_reads.get(self._keys.request(request_id))
        return digest.decode() if isinstance(digest, bytes) else None

    async def set_status(
        self,
        status: RequestStatus,
        *,
        mode: WriteMode = "any",
        stage_index: int = 0,
        link: RespLink | None = None,
        held: Held | None = None,
    ) -> bool:
        """Write a status unless the request is already terminal; True if written; over ``link`` (a stage's
        lean connection, :func:`~stageferry.broker.control.resp_link.run_script`) when given.  ``mode`` "create"
        writes only a first record; "update" only over an existing one — a progress or hand-on write after
        Redis lost the record must not bring back a request whose entry is gone (it would look running
        for ever; lost, its waiters are told instead); "unowned" only if no job owns the request.
        ``held``: an owned write (a stage's, on behalf of the entry it holds, :mod:`.held`): written only
        while that entry is still held, in the same script.

        ``stage_index`` is where ``status.stage`` sits in the pipeline: non-terminal statuses are ordered
        by attempt, stage index, state (queued < running) and progress step, compared inside the writing
        script, so a late write never moves a request back."""
        write = self.status_write(status, mode=mode, stage_index=stage_index)
        keys, args = [write.record, write.events], write.args()
        if held is not None:
            keys, args = [*keys, held.stream], [*args, *held.args()]
        with translated():
            if status.state.terminal and self.durability.on:  # nobody repeats the work after it
                what = f"status {status.state.value} of {status.request_id}"
                written = await replicated_script(
                    link, self._redis, self._set_status, keys, args, self.durability, what=what
                )
            else:
                written = await run_script(link, self._set_status, keys, args)
        return int(written) == 1

    def status_write(self, status: RequestStatus, *, mode: WriteMode = "any", stage_index: int = 0) -> StatusWrite:
        """This write (see :meth:`set_status`) as a script makes it, for a script that writes the status as
        part of its own step (an admission's start, a hand-off, a finish: one round trip, not two)."""
        rid = status.request_id
        step = status.progress.step if status.progress is not None else 0
        return StatusWrite(
            record=self._keys.request(rid),
            events=self._keys.events(rid),
            state=status.state.value,
            status_json=status.model_dump_json(),
            mode=mode,
            order=StatusOrder(status.attempt, stage_index, STATE_RANK.get(status.state, 2), step),
            ttl_s=self._ttl,
            events_maxlen=self._maxlen,
        )

    async def get(self, request_id: str) -> RequestStatus | None:
        """The request's status (None: no record); reads asked for at once share a round trip.
        :class:`StatusCorruptError` when the record's status does not parse or names another request."""
        raw = await self.status_reads.get(self._keys.request(request_id))
        return None if raw is None else parse_status(raw, request_id)

    async def request_cancel(self, request_id: str) -> bool:
        """Flag the request; stages stop it at their next boundary. False if it is unknown or finished."""
        status = await self.get(request_id)
        if status is None and not await self.known(request_id):
            return False  # unknown (a submitted one not yet picked up is known by its marker)
        if status is not None and status.state.terminal:
            return False
        with translated():
            await self._redis.set(self._keys.cancel(request_id), b"1", ex=self._ttl)
        return True

    async def ended(self, request_id: str) -> bool:
        """Whether the request's record says it is terminal (one HGET of its ``state``): a stage that waits
        on another for it (a streamed payload's next chunk) stops once it has ended elsewhere."""
        with translated():
            state = await self._redis.hget(self._keys.request(request_id), "state")
        return state is not None and state.decode(errors="replace") in TERMINAL_NAMES

    async def is_cancelled(self, request_id: str) -> bool:
        with translated():
            return bool(await self._redis.exists(self._keys.cancel(request_id)))

    async def append_event(self, request_id: str, event: dict[str, Any]) -> None:
        """Add one trace event (a structured log line) to the request's events stream."""
        await self.append_events([(request_id, event)])

    async def append_events(self, events: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Add trace events of any requests, in order, in one round trip: one XADD per event, made with
        ``NOMKSTREAM`` — an events stream that exists has its TTL (every writer that makes one sets it), so
        an event added to it needs no PEXPIRE (one per stream and batch before).  The events whose stream
        did not exist yet are added again in a second round trip, which makes each such stream and sets
        its TTL as long as the entry-life scripts' refresh (never shorter than it).  (A stream another writer
        makes between two events of one batch may get the later one first: log events of one batch only.)"""
        if not events:
            return
        rows = [
            (self._keys.events(rid), {"kind": "log", "event": json.dumps(event, default=str, separators=(",", ":"))})
            for rid, event in events
        ]
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                for key, fields in rows:
                    pipe.xadd(key, fields, maxlen=self._maxlen, approximate=True, nomkstream=True)  # type: ignore[arg-type]
                added = await pipe.execute()
            missed = [row for row, entry_id in zip(rows, added, strict=True) if entry_id is None]
            if not missed:
                return
            async with self._redis.pipeline(transaction=False) as pipe:
                streams: dict[str, None] = {}
                for key, fields in missed:
                    pipe.xadd(key, fields, maxlen=self._maxlen, approximate=True)  # type: ignore[arg-type]
                    streams[key] = None
                for key in streams:
                    pipe.pexpire(key, refreshed_ttl_ms(self._ttl))
                await pipe.execute()

    async def events(self, request_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The request's whole trace, oldest first, as (entry id, fields) with JSON bodies decoded."""
        with translated():
            rows = await self._redis.xrange(self._keys.events(request_id))
        return [(eid.decode(), _decode_event(fields)) for eid, fields in rows]


def _decode_event(fields: dict[bytes, bytes]) -> dict[str, Any]:
    out: dict[str, Any] = {k.decode(): v.decode(errors="replace") for k, v in fields.items()}
    for name in ("event", "status", "folded"):
        if name in out:
            try:
                out[name] = json.loads(out[name])
            except ValueError:
                pass
    return out
