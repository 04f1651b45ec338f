"""The control plane of a streamed payload: chunk announcements and the stream's progress, on Redis.

Written by stages only, both with the request's TTL (the announcements are deleted sooner, when the
consumer is done with them: :meth:`ChunkChannel.drop`):

* ``Keys.chunks`` — a stream: one entry per announced chunk (:mod:`stageferry.schemas.chunks`), in the
  order the producer announced them;
* ``Keys.chunk_state`` — a hash: ``applied`` (the highest index the consumer applied; the producer's
  back-pressure reads it), ``taken`` (the first index a consumer began to fetch: a consumer that finds
  one there on a redelivery knows a dead consumer took chunks that are gone), ``opened`` (the
  producer handed the stream's envelope on, in the same script: a recomputing producer does not hand it
  on twice),
  ``abandoned`` (the consumer restarted the request under a later attempt: the producer stops) and
  ``stopped`` (the consumer gave up on a chunk that did not come: the request failed, the producer stops).

Indices only grow: ``applied`` and ``taken`` are raised by a script that never lowers them, so a chunk
index is applied at most once whatever is redelivered.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import NoScriptError

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.broker.control.stream_scripts import WAKE_LUA
from stageferry.errors import EnvelopeError
from stageferry.schemas.chunks import CHUNK_FIELDS, MAX_CHUNKS, ChunkAnnouncement

#: KEYS: state hash. ARGV: field, index, ttl. Raises the field to index (never lowers it); the value after.
_RAISE = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local new = tonumber(ARGV[2])
if new > cur then
  redis.call('HSET', KEYS[1], ARGV[1], new)
  cur = new
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
return cur
"""

#: KEYS: state hash, the next stage's stream, its wake list.  ARGV: ttl, then the envelope's fields (name,
#: value, ...).  Hands the stream on unless it was: sets ``opened`` and adds the envelope in one step (they
#: were two round trips: a producer that died, or lost Redis, between them left ``opened`` set and no
#: envelope, and the request stalled).  1 for the first caller, else 0.  Commands the stage ACL user holds.
_HAND_ON_ONCE = (
    """
if redis.call('HGET', KEYS[1], 'opened') then
  return 0
end
redis.call('HSET', KEYS[1], 'opened', '1')
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
redis.call('XADD', KEYS[2], '*', unpack(ARGV, 2))
"""
    + WAKE_LUA
    + "return 1\n"
)


@dataclass(frozen=True, slots=True)
class StreamId:
    """One streamed payload: the request, the producing stage's index, the attempt."""

    request_id: str
    stage_index: int
    attempt: int


@dataclass(frozen=True, slots=True)
class ChunkState:
    """What the state hash says (indices are -1 before the first)."""

    applied: int
    taken: int
    opened: bool
    abandoned: bool
    stopped: bool = False

    @property
    def ended_by_consumer(self) -> bool:
        """The consumer will take no more chunks of this stream (restarted, or gave up)."""
        return self.abandoned or self.stopped


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One announcement as read back: its stream entry id, the announcement, the inline bytes if any."""

    entry_id: str
    announcement: ChunkAnnouncement
    blob: bytes | None


class ChunkChannel:
    """Chunk announcements and progress of streamed payloads (see the module docstring)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._raise = redis.register_script(_RAISE)
        self._raise_loaded = False  #: the raise script is known to the server (it ran once)
        self._hand_on_once = redis.register_script(_HAND_ON_ONCE)

    def _keys(self, sid: StreamId) -> tuple[str, str]:
        return (
            self.keys.chunks(sid.request_id, sid.stage_index, sid.attempt),
            self.keys.chunk_state(sid.request_id, sid.stage_index, sid.attempt),
        )

    async def hand_on_once(self, sid: StreamId, next_stage: str, fields: dict[str, str]) -> bool:
        """Hand the stream on: add its envelope (``fields``) to ``next_stage``'s stream and wake it, and mark
        it ``opened``, in one script, unless it was (a recomputing producer's attempt); True when this call
        handed it on."""
        _, state = self._keys(sid)
        flat = [part for item in fields.items() for part in item]
        keys = [state, self.keys.stage_stream(next_stage), self.keys.wake(next_stage)]
        with translated():
            return bool(int(await self._hand_on_once(keys=keys, args=[self.ttl_s, *flat])))

    async def announce(self, sid: StreamId, announcement: ChunkAnnouncement, blob: bytes | None) -> str:
        """Append ``announcement`` (and its inline ``blob``) to the stream; its entry id."""
        stream, _ = self._keys(sid)
        fields: dict[str, bytes | str] = {"chunk": announcement.model_dump_json()}
        if blob is not None:
            fields["blob"] = blob
        with translated():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xadd(stream, fields, maxlen=MAX_CHUNKS * 2, approximate=True)  # type: ignore[arg-type]
                pipe.expire(stream, self.ttl_s)
                entry_id, _ = await pipe.execute()
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    async def read(self, sid: StreamId, after: str, *, block_ms: int, applied: int | None = None) -> list[ChunkRecord]:
        """Announcements after entry id ``after`` (``"0"``: from the start), waiting up to ``block_ms`` for
        the first; an entry that does not parse is an :class:`EnvelopeError` (only stages write here).
        ``applied``: raise ``applied`` to it first, in the same round trip (the consumer's hot path)."""
        stream, state = self._keys(sid)
        if applied is not None and not self._raise_loaded:  # the first one loads the script (EVALSHA only)
            await self.raise_to(sid, "applied", applied)
            applied = None
        with translated():
            if applied is None:
                reply = await self.redis.xread({stream: after}, count=64, block=max(1, block_ms))
            else:
                try:  # by its digest (the stage ACL user may not EVAL, nor ask SCRIPT EXISTS)
                    async with self.redis.pipeline(transaction=False) as pipe:
                        pipe.evalsha(self._raise.sha, 1, state, "applied", applied, self.ttl_s)
                        pipe.xread({stream: after}, count=64, block=max(1, block_ms))
                        _, reply = await pipe.execute()
                except NoScriptError:  # the server lost its scripts (a restart): load it again
                    self._raise_loaded = False
                    return await self.read(sid, after, block_ms=block_ms, applied=applied)
        records: list[ChunkRecord] = []
        for _name, rows in reply or []:
            for raw_id, fields in rows:
                records.append(_record(raw_id, fields, sid))
        return records

    async def state(self, sid: StreamId) -> ChunkState:
        _, state = self._keys(sid)
        with translated():
            raw = await self.redis.hgetall(state)
        values = {k.decode(): v.decode() for k, v in raw.items()}
        return ChunkState(
            applied=int(values.get("applied", -1)),
            taken=int(values.get("taken", -1)),
            opened="opened" in values,
            abandoned="abandoned" in values,
            stopped="stopped" in values,
        )

    async def raise_to(self, sid: StreamId, field: str, index: int) -> int:
        """Raise ``applied`` or ``taken`` to ``index`` (never lowers it); the value after."""
        if field not in ("applied", "taken"):
            raise ValueError(f"not a chunk index field: {field!r}")
        _, state = self._keys(sid)
        with translated():
            value = int(await self._raise(keys=[state], args=[field, index, self.ttl_s]))
        self._raise_loaded = True
        return value

    async def drop(self, sid: StreamId) -> None:
        """The consumer is done with the stream (its last chunk applied, or it stopped): its announcements,
        inline chunk bytes among them, go now rather than at the request's TTL.  Nobody reads them again: a
        consumer that takes the request over finds ``taken`` set and starts a later attempt.  The state hash
        stays (the producer reads ``applied``, ``stopped`` there)."""
        stream, _ = self._keys(sid)
        with translated():
            await self.redis.delete(stream)

    async def abandon(self, sid: StreamId, *, why: str = "abandoned") -> None:
        """The consumer restarts the request under a later attempt (``abandoned``), or gave up on it
        (``stopped``): this stream's producer stops."""
        if why not in ("abandoned", "stopped"):
            raise ValueError(f"not a way a stream ends: {why!r}")
        _, state = self._keys(sid)
        with translated():
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(state, why, "1")
                pipe.expire(state, self.ttl_s)
                await pipe.execute()


def _record(raw_id: bytes | str, fields: dict[bytes, bytes], sid: StreamId) -> ChunkRecord:
    entry_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
    names = {k.decode(errors="replace") for k in fields}
    if not names <= CHUNK_FIELDS or "chunk" not in names:
        raise EnvelopeError("a chunk entry with unknown or missing fields", entry=entry_id, fields=sorted(names))
    try:
        announcement = ChunkAnnouncement.model_validate_json(fields[b"chunk"])
    except ValidationError as exc:
        why = exc.errors()[0]["msg"]
        raise EnvelopeError(f"a chunk announcement that does not parse: {why}", entry=entry_id) from exc
    if announcement.request_id != sid.request_id or announcement.attempt != sid.attempt:
        raise EnvelopeError("a chunk announcement of another request or attempt", entry=entry_id)
    blob = fields.get(b"blob")
    if (blob is not None) != (announcement.payload.kind == "inline"):
        raise EnvelopeError("a blob field beside a chunk that is not inline (or none beside one)", entry=entry_id)
    return ChunkRecord(entry_id=entry_id, announcement=announcement, blob=blob)
