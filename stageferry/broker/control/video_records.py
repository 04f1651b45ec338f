"""The gateway's records of the video jobs it accepted, and their previews: typed replies.

One :class:`~stageferry.schemas.video_record.VideoMeta` per job at ``<p>:req-video:<id>``
(:meth:`Keys.video_meta`) and the previews made from its output at ``<p>:req-preview:<id>:<variant>``
(:meth:`Keys.video_preview`), all with the request's TTL (``ttl_s``).  :meth:`VideoRecords.views` reads many
jobs' statuses and records in one round trip, for the lists.  A record that does not parse is said so
(``unreadable``), never raised; Redis errors come out as :class:`~stageferry.errors.ControlPlaneError`
(translated here).  What a record means for an HTTP answer is the gateway's (``stageferry/gateway``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import ValidationError

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import translated
from stageferry.schemas import RequestStatus
from stageferry.schemas.video_record import VideoMeta


@dataclass(frozen=True, slots=True)
class RecordRead:
    """The reply of :meth:`VideoRecords.get`: the record (``None`` when there is none, or with
    ``unreadable`` when what is stored does not parse)."""

    record: VideoMeta | None = None
    unreadable: bool = False


@dataclass(frozen=True, slots=True)
class VideoView:
    """One job as a list reads it: its status (``None`` when absent), whether only its "submitted" marker
    shows it yet (``submitted``, when asked for), its record, and ``unreadable`` when the status or the
    record does not parse (then neither is given)."""

    request_id: str
    status: RequestStatus | None
    record: VideoMeta | None
    submitted: bool = False
    unreadable: bool = False


def _parse_record(raw: bytes | None) -> RecordRead:
    if not raw:
        return RecordRead()
    try:
        return RecordRead(VideoMeta.model_validate_json(raw))
    except ValidationError:
        return RecordRead(unreadable=True)


class VideoRecords:
    """Reads and writes the records and previews of one deployment's video jobs."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int) -> None:
        self._redis = redis
        self._keys = keys
        self._ttl_s = ttl_s

    async def put(self, request_id: str, record: VideoMeta, *, only_new: bool = False) -> bool:
        """Store ``record`` for the job (with ``only_new``, unless it has one); whether it was written."""
        with translated():
            done = await self._redis.set(
                self._keys.video_meta(request_id), record.model_dump_json(), ex=self._ttl_s, nx=only_new
            )
        return bool(done)

    async def get(self, request_id: str) -> RecordRead:
        with translated():
            raw = await self._redis.get(self._keys.video_meta(request_id))
        return _parse_record(raw)

    async def views(self, request_ids: Sequence[str], *, submitted: bool = False) -> list[VideoView]:
        """Each job's status and record, in the order given (one round trip); with ``submitted``, whether
        its "submitted, not yet picked up" marker is there too."""
        if not request_ids:
            return []
        keys, per = self._keys, 3 if submitted else 2
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                for rid in request_ids:
                    pipe.hget(keys.request(rid), "status")
                    pipe.get(keys.video_meta(rid))
                    if submitted:
                        pipe.exists(keys.submitted(rid))
                replies = await pipe.execute()
        out = []
        for i, rid in enumerate(request_ids):
            raw_status, raw_record = replies[per * i], replies[per * i + 1]
            marked = bool(replies[per * i + 2]) if submitted else False
            read = _parse_record(raw_record)
            try:
                status = RequestStatus.model_validate_json(raw_status) if raw_status else None
            except ValidationError:
                out.append(VideoView(rid, None, None, submitted=marked, unreadable=True))
                continue
            if read.unreadable:
                out.append(VideoView(rid, None, None, submitted=marked, unreadable=True))
            else:
                out.append(VideoView(rid, status, read.record, submitted=marked))
        return out

    async def preview(self, request_id: str, variant: str) -> bytes | None:
        """A preview made earlier, or ``None``."""
        with translated():
            stored = await self._redis.get(self._keys.video_preview(request_id, variant))
        return bytes(stored) if stored else None

    async def put_previews(self, request_id: str, variants: Mapping[str, bytes]) -> None:
        """Store the job's previews, by variant (one round trip)."""
        with translated():
            async with self._redis.pipeline(transaction=False) as pipe:
                for name, data in variants.items():
                    pipe.set(self._keys.video_preview(request_id, name), data, ex=self._ttl_s)
                await pipe.execute()

    async def tombstone(self, request_id: str, tomb: VideoMeta, *, previews: Sequence[str]) -> None:
        """Drop the job's output and its ``previews`` and put ``tomb`` in place of its record, at once."""
        keys = self._keys
        with translated():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(keys.result(request_id), *(keys.video_preview(request_id, v) for v in previews))
                pipe.set(keys.video_meta(request_id), tomb.model_dump_json(), ex=self._ttl_s)
                await pipe.execute()


__all__ = ["RecordRead", "VideoRecords", "VideoView"]
