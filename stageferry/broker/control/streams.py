"""A stage's input stream and consumer group: read, reclaim, renew, hand on, dead-letter.

Delivery is at-least-once.  An entry stays pending in the group until the stage's output is handed on
(or stored), and then it is acknowledged *and deleted* in the same Lua script that hands it on, after
checking that this consumer still owns it — so a replica that stalled past the visibility timeout and
lost its entry to another replica can never hand the same work on twice.  Because acknowledged entries
are deleted, a stage stream holds only un-acknowledged work and needs no trimming (admission control
at submit time bounds it instead).

Entries are read through a Lua script that measures them inside Redis: an entry whose field values add
up to more than ``max_entry_bytes`` comes back as its id, its request id and its size only, so an
oversized entry is refused (dead-lettered by the worker) without ever being pulled whole.  Scripts
cannot block, and a blocking XREADGROUP would hand over whatever arrives, however large; so an idle
replica blocks on the stage's *wake list* instead (``BLPOP``), which every writer of ours (the hand-offs)
pushes to in the same script as its XADD: work is picked up at once.  An entry XADDed by someone else
is picked up within :data:`WAKE_POLL_S`, the BLPOP's timeout.  The BLPOP and the read script go to Redis
in one pipeline: Redis keeps a blocked client's next command until the block ends and runs it then, so a
woken replica gets its entries with the wake-up instead of one round trip later.

The first stage also has an :class:`~stageferry.broker.control.intake.Intake`: clients push submissions
onto lists, never onto the stream, and a read whose stream holds fewer than ``count`` new entries moves
up to that many more, and :data:`MOVE_SURPLUS` besides, into the stream (the read script does the move
itself: one call, no extra round trip nor script).  Clients cannot push the wake
list (a client's item there would be popped whole), so an idle first stage polls its intake every
:data:`INTAKE_POLL_S`.

The wait and the scripts (read, hand-off, finish, ack, renew) go over two lean connections of this stream's
own (:mod:`~stageferry.broker.control.resp_link`: one blocks in the wait, one carries the scripts), which
cost a fraction of redis-py's Python per round trip; where they cannot be used, or their connection fails,
the same commands go through redis-py and its retries.  For ``hot_wait_s`` after an entry is delivered or
settled, those links poll for their replies instead of letting the process sleep
(:meth:`~stageferry.broker.control.resp_link.RespLink.keep_hot`), so an entry that follows closely finds
the stage awake.

The read can also take a *lease claim* for the entry (:class:`LeaseClaim`): a stage whose input comes over
NIXL must claim the payload's lease (``SET NX`` on its claim key, :mod:`stageferry.broker.data.nixl.leases`)
before it may use the bytes it READ.  The entry names its lease in the ``lease`` field, and the read script
claims it for every *new* entry it hands over (phase ``>``), in the same round trip: the hop from the
producer's put to the consumer holding the payload loses one round trip.  Only new entries: a reclaimed or
re-read one was delivered before, to a consumer that may have claimed it and may still be READing, so its
claim is left to the connector (which finds it taken and has the request recomputed, as before).  The key
is the configured prefix plus the field's value, so a writer cannot aim the claim at any other key.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.consumers import ConsumerPruner, make_group
from stageferry.broker.control.dead_letter import DEAD_LETTER_LUA, DeadLetterPolicy
from stageferry.broker.control.entry_records import FINISH, HAND_OFF, StatusWrite
from stageferry.broker.control.held import Held
from stageferry.broker.control.intake import Intake
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import BLOCK_MS, durability_of, translated
from stageferry.broker.control.replication import replicated_script
from stageferry.broker.control.resp_link import RespLink, open_link, run_pipeline, run_script
from stageferry.broker.control.stream_scripts import ACK, HANDOFF, READ_CAPPED, READ_CAPPED_MOVING, RENEW
from stageferry.broker.control.tally import pass_through
from stageferry.errors import CancelledRequestError, ControlPlaneError

log = structlog.get_logger(__name__)

#: Longest an idle replica waits on its wake list before looking at the stream anyway.
WAKE_POLL_S = 0.05
#: The same for a first stage, which polls its clients' intake lists (clients cannot wake it).
INTAKE_POLL_S = 0.01
#: How many submissions more than a read takes its move may put into a first stage's stream, for the next
#: reads of any replica: a busy first stage moves once every this many entries (``READ_CAPPED``).
MOVE_SURPLUS = 16
DEFAULT_MAX_ENTRY_BYTES = 32 * 1024 * 1024


#: How often, at most, a busy replica's reads reclaim entries idle past the visibility timeout (an idle
#: one's come back from their wait every ``block_ms``, and reclaim then).
CLAIM_EVERY_S = 0.25

#: The entry field that names the lease a reader claims on delivery (:class:`LeaseClaim`).
LEASE_FIELD = "lease"


@dataclass(frozen=True, slots=True)
class LeaseClaim:
    """What the read script claims for each new entry naming a lease (see the module docstring): the key
    ``prefix + <the entry's lease field>``, set to ``holder`` for ``ttl_ms`` if nobody holds it."""

    prefix: str
    holder: str
    ttl_ms: int


@dataclass(frozen=True, slots=True)
class Entry:
    """One delivered stream entry."""

    id: str
    fields: Mapping[str, bytes]
    deliveries: int
    too_large: int | None = None
    """The entry's size when it is above the cap: then ``fields`` holds only its ``request_id``."""
    stream: str = ""
    """The stream it came from."""
    tenant: str | None = None
    """The tenant whose intake list the entry was moved from (its ``tenant`` field, which only the mover
    writes: clients write no stream)."""
    lease_claimed: bool | None = None
    """Whether the read claimed the lease its ``lease`` field names (:class:`LeaseClaim`): None when it
    did not try (no claim configured, no such field, or not a new entry)."""

    def claimed(self, lease: str) -> bool | None:
        """The read's claim of ``lease``: None unless the read tried to claim exactly that lease."""
        return self.lease_claimed if self.fields.get(LEASE_FIELD) == lease.encode() else None

    def text(self, name: str) -> str | None:
        raw = self.fields.get(name)
        return None if raw is None else raw.decode("utf-8", errors="strict")


class StageStream:
    """The consumer-group view of one stage's input stream, for one replica (``consumer``)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stage: str,
        consumer: str,
        *,
        visibility_ms: int,
        dead_letters: DeadLetterPolicy | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        intake: Intake | None = None,
        lease_claim: LeaseClaim | None = None,
        hot_wait_s: float = 0.0,
    ) -> None:
        self._redis = redis
        #: How long the links stay hot after an entry is delivered or settled (:meth:`_keep_hot`).
        self.hot_wait_s = hot_wait_s
        self._lease_claim = lease_claim
        self._keys = keys
        self.stage = stage
        self.group = stage
        self.consumer = consumer
        self.key = keys.stage_stream(stage)
        #: Streams read (the read script takes several; a stage reads its own).
        self.streams: tuple[str, ...] = (self.key,)
        #: The first stage's clients' intake, moved into the stream by every read (None elsewhere).
        self.intake = intake
        self._poll_s = WAKE_POLL_S if intake is None else INTAKE_POLL_S
        #: When a first stage's poll next reads its stream even if its intake was empty (:meth:`_wait_and_read`).
        self._next_stream_look = 0.0
        self._source: dict[str, str] = {}  # entry id → its stream, for the entries in hand
        self._visibility_ms = visibility_ms
        #: Whether a read must look at this consumer's own pending entries first (after a start, a lost
        #: group, or while entries read before are still in hand): each look is a command in Redis.
        self._own_pending = True
        #: When the next read reclaims idle entries (XAUTOCLAIM): at most every :data:`CLAIM_EVERY_S`
        #: (a quarter of the visibility timeout when that is shorter), not on every read.
        self._claim_every_s = min(CLAIM_EVERY_S, visibility_ms / 4000)
        self._next_claim = 0.0
        self._dead_letters = dead_letters or DeadLetterPolicy()
        self._dead_letter = redis.register_script(DEAD_LETTER_LUA)
        self._handoff = redis.register_script(HANDOFF)
        self._handoff_with_status = HAND_OFF.bind(redis)
        self._finish = FINISH.bind(redis)
        self._ack = redis.register_script(ACK)
        self._renew = redis.register_script(RENEW)
        self._read_capped = redis.register_script(READ_CAPPED if intake is None else READ_CAPPED_MOVING)
        #: Deletes the group's consumers that are gone, when this replica makes sure of the group.
        self.pruner = ConsumerPruner(redis, keys, stage, self.streams, consumer)
        self._max_entry_bytes = max_entry_bytes
        #: How many replicas a hand-off and a last stage's ending must reach (the URL's ``wait_replicas``).
        self.durability = durability_of(redis)
        # The hot path's own connections (resp_link.py): one that blocks in the wake-up wait, one for the
        # scripts (reads, hand-offs, acks); None where the link cannot follow the client (then redis-py).
        self._wait_link = open_link(redis)
        self._link = open_link(redis)

    def _keep_hot(self) -> None:
        """An entry was delivered or settled: for ``hot_wait_s`` the links poll for their replies instead
        of sleeping (:meth:`RespLink.keep_hot`), so the next read, and an entry that follows closely, find
        this process awake."""
        if self.hot_wait_s > 0:
            for link in self.links:
                link.keep_hot(self.hot_wait_s)

    @property
    def script_link(self) -> RespLink | None:
        """The link this stream's scripts take, for other scripts on the same entry's path (the admission)."""
        return self._link

    @property
    def links(self) -> tuple[RespLink, ...]:
        """The hot path's own connections (none where redis-py carries everything)."""
        return tuple(link for link in (self._wait_link, self._link) if link is not None)

    async def aclose(self) -> None:
        """Close the hot path's own connections (the client, and its pool, are the caller's)."""
        for link in self.links:
            await link.aclose()

    async def ensure_group(self) -> None:
        """Create the streams and group if missing (also after a Redis restart that lost them), and delete
        the group's consumers that are gone (:mod:`.consumers`)."""
        self._own_pending = True
        await make_group(self._redis, self.streams, self.group)
        await self.pruner.prune()

    def held(self, entry: Entry) -> Held:
        """``entry`` as this consumer holds it, for an owned write on its behalf (:mod:`.held`)."""
        return Held(entry.stream or self.key, self.group, self.consumer, entry.id)

    def _key_of(self, entry_id: str) -> str:
        return self._source.get(entry_id, self.key)

    def _settled(self, entry_id: str) -> None:
        self._source.pop(entry_id, None)
        self._keep_hot()

    async def _owned_call(self, script: Any, keys: list[str], args: list[Any]) -> bool:
        """Run an ownership-checked script; a stream or group lost with Redis (NOGROUP) means the entry is
        gone too: re-create the group and report "not owned" instead of failing the worker."""
        try:
            with translated():
                return bool(await run_script(self._link, script, keys, args))
        except ControlPlaneError as exc:
            if not _group_lost(exc):
                raise
            log.warning("stream.group_lost", stream=keys[0], error=exc.message)
            await self.ensure_group()
            return False

    async def read(
        self, count: int = 1, *, block_ms: int = BLOCK_MS, new_only: bool = False, in_hand: bool = False
    ) -> list[Entry]:
        """Entries to work on: first this consumer's own un-acked ones (after a restart, a lost group, or
        while entries read before are in hand), then entries idle past the visibility timeout (reclaimed
        from dead replicas; at most every :data:`CLAIM_EVERY_S`), then new ones — in one script, one round
        trip.  With nothing there, wait on the wake list (up to ``block_ms``) and read
        new ones whenever woken (or every :data:`WAKE_POLL_S`).

        ``new_only``: new entries alone, for a reader that keeps entries in hand while it reads more (its
        own un-acked ones would otherwise come back first, and as redeliveries).  It skips the reclaim of
        dead replicas' entries too: such a reader takes its own and reclaimed ones with plain reads, when
        it starts and whenever it has nothing in hand.

        ``in_hand``: entries read before are still being worked on (``entries_in_flight`` > 1): skip own
        pending ones as ``new_only`` does, but still reclaim idle ones when due (the caller skips ids it holds)."""
        entries = await self._read_via_script(">" if new_only else self._phases(in_hand=in_hand), count)
        deadline = time.monotonic() + block_ms / 1000
        while not entries:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return entries
            entries = await self._wait_and_read(min(remaining, self._poll_s), count)
        self._keep_hot()
        return entries

    def _phases(self, *, in_hand: bool = False) -> str:
        """A full read's phases: own pending entries while there may be some (never while entries are in
        hand), the reclaim when it is due, then new entries."""
        phases = []
        if not in_hand and (self._own_pending or self._source):
            phases.append("0")
        now = time.monotonic()
        if now >= self._next_claim:
            phases.append("claim")
            self._next_claim = now + self._claim_every_s
        return ",".join([*phases, ">"])

    async def _wait_and_read(self, timeout: float, count: int) -> list[Entry]:
        """Wait on the wake list, then read new entries: one pipeline, so the read reaches Redis with the
        wait and runs the moment the wait ends (Redis holds a blocked client's later commands and runs them
        as soon as it is unblocked), and the entries come back with the wake-up, not one round trip after
        it.  A script Redis has forgotten (a restart, ``SCRIPT FLUSH``) or any other failure of the read is
        retried alone, where :meth:`_read_via_script` loads the script and handles a lost group."""
        wake = ("BLPOP", self._keys.wake(self.stage), timeout)
        # A first stage polls its intake every INTAKE_POLL_S but looks at its stream only when the move
        # moved something, when it was woken, or every WAKE_POLL_S (for entries others XADDed), as any stage.
        now = time.monotonic()
        lazy = self.intake is not None and now < self._next_stream_look
        if not lazy:
            self._next_stream_look = now + WAKE_POLL_S
        commands = [wake, self._read_command("ifmoved,>" if lazy else ">", count)]
        with translated():
            replies = await run_pipeline(self._wait_link, self._redis, commands, block_s=timeout)
        if isinstance(replies[-1], Exception):
            return await self._read_via_script(">", count)
        entries = await self._entries(replies[-1])
        if lazy and not entries and replies[0] is not None:  # woken, and the lazy read did not look
            return await self._read_via_script(">", count)
        return entries

    def _read_keys(self) -> list[str]:
        """The read script's keys: the streams, then a first stage's intake lists (its move's)."""
        return [*self.streams, *(self.intake.list_keys if self.intake is not None else ())]

    def _read_command(self, start: str, count: int) -> tuple[Any, ...]:
        keys = self._read_keys()
        return ("EVALSHA", self._read_capped.sha, len(keys), *keys, *self._read_args(start, count))

    def _read_args(self, start: str, count: int) -> list[Any]:
        """The read script's arguments; a first stage's go on with its intake's move (the script moves up to
        ``count`` submissions into the stream before it reads)."""
        lc = self._lease_claim
        args = [self.group, self.consumer, count, self._max_entry_bytes, start, self._visibility_ms]
        args += [lc.prefix, lc.holder, lc.ttl_ms] if lc is not None else ["", "", 0]
        return args if self.intake is None else [*args, len(self.streams), MOVE_SURPLUS, *self.intake.read_args()]

    async def _read_via_script(self, start: str, count: int) -> list[Entry]:
        try:
            with translated():  # a first stage's move and the read: one script
                rows = await run_script(self._link, self._read_capped, self._read_keys(), self._read_args(start, count))
        except ControlPlaneError as exc:
            if _group_lost(exc):
                await self.ensure_group()
                return []
            raise
        if "0" in start.split(","):  # own pending entries left only if this read took some (maybe more)
            self._own_pending = any(row[5] == b"0" for row in rows)
        return await self._entries(rows)

    async def _entries(self, rows: list[Any]) -> list[Entry]:
        # Entries deleted while pending come back with no fields: drop them from the PEL.
        entries = []
        for eid, fields, size, k, deliveries, phase, claimed in rows:
            stream = self.streams[int(k) - 1]
            if not fields:
                await self._drop_dangling(stream, eid.decode())
                continue
            entry = Entry(
                eid.decode(),
                _decode_pairs(fields),
                int(deliveries),
                too_large=int(size) or None,
                stream=stream,
                tenant=_text(fields, "tenant") if self.intake is not None else None,
                lease_claimed=None if int(claimed) < 0 else bool(int(claimed)),
            )
            self._source[entry.id] = stream
            if phase == b"claim":
                log.warning("stream.reclaimed", stream=stream, entry=entry.id, deliveries=entry.deliveries)
            entries.append(entry)
        return entries

    async def _drop_dangling(self, key: str, entry_id: str) -> None:
        with translated():
            await self._redis.xack(key, self.group, entry_id)

    async def renew(self, entry_id: str) -> bool:
        """Keep a long job's entry from being reclaimed; False if another replica took it (or Redis lost it)."""
        return await self._owned_call(self._renew, [self._key_of(entry_id)], [self.group, self.consumer, entry_id])

    async def hand_off(
        self,
        entry_id: str,
        next_stage: str,
        fields: Mapping[str, bytes | str],
        *,
        status: StatusWrite | None = None,
        crash_field: str | None = None,
    ) -> bool:
        """Atomically XADD ``fields`` to ``next_stage``'s stream and ack+delete this entry — and, given
        ``status`` (:meth:`RequestStore.status_write`: the next stage's ``queued``), write that status into
        the request's record in the same script (no event of its own: the next stage's admission writes
        its event with its ``running``) and clear the entry's crash mark (``crash_field`` of the record)
        once the entry is handed on or found not ours.  The cancel flag is the next stage's admission's to read.

        False if this consumer no longer owns the entry (nothing was written, the status neither).  A
        stream or group that went with Redis (``NOGROUP``) is made again (so that the stage reads on), and
        the hand-off is not retried: the entry went with the group, so the new group does not hold it."""
        flat: list[Any] = []
        for name, value in fields.items():
            flat += [name, value]
        src, dst, wake = self._key_of(entry_id), self._keys.stage_stream(next_stage), self._keys.wake(next_stage)
        if status is None:
            script, keys, args = self._handoff, [src, dst, wake], [self.group, self.consumer, entry_id, *flat]
        else:
            if crash_field is None:
                raise ValueError("a hand-off with a status needs the entry's crash mark")
            script, keys = self._handoff_with_status, [src, dst, status.record, status.events, wake]
            args = [self.group, self.consumer, entry_id, crash_field, *status.args(), *flat]
        try:
            with translated():
                done = int(await self._durable(script, keys, args, what=f"hand-off of {entry_id} to {next_stage}"))
        except ControlPlaneError as exc:
            if not _group_lost(exc):
                raise
            log.warning("stream.group_lost", stream=src, error=exc.message)
            await self.ensure_group()
            done = 0
        self._settled(entry_id)
        return done == 1

    async def finish(
        self,
        entry_id: str,
        *,
        status: StatusWrite,
        cancel: str,
        crash_field: str,
        result_key: str,
        result: tuple[bytes, int] | None = None,
    ) -> tuple[bool, bool]:
        """The last stage's ending in one script: unless the request's ``cancel`` flag is set (then
        :class:`CancelledRequestError`, nothing done), store the ``result``,
        write the terminal ``status`` and ack+delete the entry — only while this consumer still holds it
        (an owned write, :mod:`.held`) — and clear the entry's crash mark (``crash_field`` of the record)
        either way.  ``result`` is (bytes, ttl) to store under ``result_key`` (``SET NX``), or None.
        Returns (acked, status written): not acked, nothing was written."""
        data, ttl = result if result is not None else (b"", 0)
        keys = [self._key_of(entry_id), status.record, status.events, cancel, result_key]
        args = [self.group, self.consumer, entry_id, crash_field, *status.args()]
        args += ["1" if result is not None else "0", ttl, data]
        with translated():
            owned, written = (
                int(x) for x in await self._durable(self._finish, keys, args, what=f"result of {entry_id}")
            )
        if owned == -2:
            raise CancelledRequestError("cancelled by the client")
        if owned == -1:  # its stream or group went with Redis: the entry is gone too
            log.warning("stream.group_lost", stream=keys[0])
            await self.ensure_group()
        self._settled(entry_id)
        return owned == 1, written == 1

    @pass_through
    async def _durable(self, script: Any, keys: list[str], args: list[Any], *, what: str) -> Any:
        """A write after which this stage cannot repeat its work: on ``wait_replicas`` replicas
        (:func:`~stageferry.broker.control.replication.replicated_script`) when asked, else as any script."""
        if self.durability.on:
            return await replicated_script(self._link, self._redis, script, keys, args, self.durability, what=what)
        return await run_script(self._link, script, keys, args)

    async def ack(self, entry_id: str) -> bool:
        """Ack and delete an entry this consumer owns (its result is stored, or it was refused)."""
        done = await self._owned_call(self._ack, [self._key_of(entry_id)], [self.group, self.consumer, entry_id])
        self._settled(entry_id)
        return done

    async def dead_letter(self, entry: Entry, *, reason: str, error_code: str) -> bool:
        """Move an entry to the stage's dead-letter stream with the reason, then ack it.

        Bounded (:mod:`.dead_letter`): large bodies are kept as size and digest only, and the stream is
        trimmed by length, bytes and age in the same script."""
        policy = self._dead_letters
        fields = policy.fields(
            entry.id,
            entry.fields,
            reason=reason,
            error_code=error_code,
            deliveries=entry.deliveries,
            entry_bytes=entry.too_large,
        )
        with translated():
            await self._dead_letter(keys=[self._keys.dead_letter(self.stage)], args=policy.script_args(fields))
        log.warning("stream.dead_lettered", stream=entry.stream, entry=entry.id, reason=reason, code=error_code)
        return await self.ack(entry.id)

    async def pending_count(self) -> int:
        """Entries delivered but not yet acknowledged, across all consumers."""
        try:
            with translated():
                info = await self._redis.xpending(self.key, self.group)
        except ControlPlaneError as exc:
            if _group_lost(exc):
                return 0
            raise
        return int(info["pending"])


def _group_lost(exc: ControlPlaneError) -> bool:
    """The stream or group vanished (deleted, or Redis restarted without persistence): make it again."""
    text = str(exc)
    return "NOGROUP" in text or "UNBLOCKED" in text


def _text(flat: list[bytes], name: str) -> str | None:
    """The value of field ``name`` in a script's flat reply, as text (None: absent)."""
    for i in range(0, len(flat) - 1, 2):
        if flat[i] == name.encode():
            return flat[i + 1].decode("utf-8", errors="replace")
    return None


def _decode_pairs(flat: list[bytes]) -> dict[str, bytes]:
    """A script's flat ``[name, value, ...]`` reply as a dict (field names decoded leniently)."""
    return {flat[i].decode("utf-8", errors="replace"): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


__all__ = ["LEASE_FIELD", "Entry", "LeaseClaim", "StageStream"]
