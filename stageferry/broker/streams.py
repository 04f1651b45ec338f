"""A stage's input stream and consumer group: read, reclaim, renew, hand on, dead-letter.

Delivery is at-least-once.  An entry stays pending in the group until the stage's output is handed on
(or stored), and then it is acknowledged *and deleted* in the same Lua script that hands it on, after
checking that this consumer still owns it — so a replica that stalled past the visibility timeout and
lost its entry to another replica can never hand the same work on twice.  Because acknowledged entries
are deleted, a stage stream holds only un-acknowledged work and needs no trimming (admission control
at submit time bounds it instead).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from stageferry.broker.keys import Keys
from stageferry.broker.redis_conn import BLOCK_MS, translated
from stageferry.errors import ControlPlaneError

log = structlog.get_logger(__name__)

_OWNED = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
"""

# KEYS: src stream, dst stream. ARGV: group, consumer, entry id, field, value, field, value, ...
_HANDOFF = (
    _OWNED
    + """
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('XADD', KEYS[2], '*', unpack(fields))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: src stream. ARGV: group, consumer, entry id.
_ACK = (
    _OWNED
    + """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: src stream. ARGV: group, consumer, entry id. Resets the idle time, only while still the owner.
_RENEW = (
    _OWNED
    + """
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""
)


@dataclass(frozen=True, slots=True)
class Entry:
    """One delivered stream entry."""

    id: str
    fields: Mapping[str, bytes]
    deliveries: int

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
        dlq_maxlen: int = 100_000,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self.stage = stage
        self.group = stage
        self.consumer = consumer
        self.key = keys.stage_stream(stage)
        self._visibility_ms = visibility_ms
        self._dlq_maxlen = dlq_maxlen
        self._handoff = redis.register_script(_HANDOFF)
        self._ack = redis.register_script(_ACK)
        self._renew = redis.register_script(_RENEW)

    async def ensure_group(self) -> None:
        """Create the stream and group if missing (also after a Redis restart that lost them)."""
        try:
            with translated():
                await self._redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
            log.info("stream.group_created", stream=self.key, group=self.group)
        except ControlPlaneError as exc:  # BUSYGROUP: it exists already
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int = 1, *, block_ms: int = BLOCK_MS) -> list[Entry]:
        """Entries to work on: first this consumer's own un-acked ones (after a restart), then entries
        idle past the visibility timeout (reclaimed from dead replicas), then new ones."""
        entries = await self._read_group("0", count, block_ms=None)
        if entries:
            return entries
        entries = await self._reclaim(count)
        if entries:
            return entries
        return await self._read_group(">", count, block_ms=block_ms)

    async def _read_group(self, start: str, count: int, *, block_ms: int | None) -> list[Entry]:
        try:
            with translated():
                reply = await self._redis.xreadgroup(
                    self.group, self.consumer, {self.key: start}, count=count, block=block_ms
                )
        except ControlPlaneError as exc:
            if _group_lost(exc):
                await self.ensure_group()
                return []
            raise
        rows = [row for _stream, batch in (reply or []) for row in batch]
        # Entries deleted while pending come back with no fields: drop them from the PEL.
        live = [(eid, fields) for eid, fields in rows if fields]
        for eid, fields in rows:
            if not fields:
                await self._drop_dangling(eid.decode())
        if not live:
            return []
        counts = await self._delivery_counts([eid.decode() for eid, _ in live])
        return [Entry(eid.decode(), _decode_fields(f), counts.get(eid.decode(), 1)) for eid, f in live]

    async def _reclaim(self, count: int) -> list[Entry]:
        try:
            with translated():
                reply = await self._redis.xautoclaim(
                    self.key, self.group, self.consumer, self._visibility_ms, start_id="0-0", count=count
                )
        except ControlPlaneError as exc:
            if _group_lost(exc):
                await self.ensure_group()
                return []
            raise
        claimed = [(eid, fields) for eid, fields in reply[1] if fields]
        if not claimed:
            return []
        counts = await self._delivery_counts([eid.decode() for eid, _ in claimed])
        out = [Entry(eid.decode(), _decode_fields(f), counts.get(eid.decode(), 1)) for eid, f in claimed]
        for entry in out:
            log.warning("stream.reclaimed", stream=self.key, entry=entry.id, deliveries=entry.deliveries)
        return out

    async def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                for eid in ids:
                    pipe.xpending_range(self.key, self.group, min=eid, max=eid, count=1)
                replies = await pipe.execute()
        return {r[0]["message_id"].decode(): int(r[0]["times_delivered"]) for r in replies if r}

    async def _drop_dangling(self, entry_id: str) -> None:
        with translated():
            await self._redis.xack(self.key, self.group, entry_id)

    async def renew(self, entry_id: str) -> bool:
        """Keep a long job's entry from being reclaimed; False if another replica took it."""
        with translated():
            return bool(await self._renew(keys=[self.key], args=[self.group, self.consumer, entry_id]))

    async def hand_off(self, entry_id: str, next_stage: str, fields: Mapping[str, bytes | str]) -> bool:
        """Atomically XADD ``fields`` to ``next_stage``'s stream and ack+delete this entry.

        False if this consumer no longer owns the entry (nothing was written)."""
        flat: list[bytes | str] = []
        for name, value in fields.items():
            flat += [name, value]
        with translated():
            done = await self._handoff(
                keys=[self.key, self._keys.stage_stream(next_stage)],
                args=[self.group, self.consumer, entry_id, *flat],
            )
        return bool(done)

    async def ack(self, entry_id: str) -> bool:
        """Ack and delete an entry this consumer owns (its result is stored, or it was refused)."""
        with translated():
            return bool(await self._ack(keys=[self.key], args=[self.group, self.consumer, entry_id]))

    async def dead_letter(self, entry: Entry, *, reason: str, error_code: str) -> bool:
        """Move an entry to the stage's dead-letter stream with the reason, then ack it."""
        fields: dict[str, bytes | str] = {
            "reason": reason[:2000],
            "error_code": error_code,
            "source_entry": entry.id,
            "deliveries": str(entry.deliveries),
        }
        for name in ("request_id", "job", "envelope"):
            if name in entry.fields:
                fields[name] = entry.fields[name]
        with translated():
            await self._redis.xadd(
                self._keys.dead_letter(self.stage), fields, maxlen=self._dlq_maxlen, approximate=True
            )
        log.warning("stream.dead_lettered", stream=self.key, entry=entry.id, reason=reason, code=error_code)
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


def _decode_fields(fields: Mapping[bytes, bytes]) -> dict[str, bytes]:
    return {k.decode("utf-8", errors="replace"): v for k, v in fields.items()}


__all__ = ["Entry", "StageStream"]
