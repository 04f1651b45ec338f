"""broker.control.video_records: the gateway's video records and previews on a real Redis, typed replies."""

from __future__ import annotations

import pytest

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.video_records import RecordRead, VideoRecords, VideoView
from stageferry.errors import ControlPlaneError
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.video_record import VideoMeta

pytestmark = pytest.mark.anyio


async def test_a_record_reads_back_with_its_ttl(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        records = VideoRecords(redis, Keys(prefix), ttl_s=60)
        meta = VideoMeta(model="m", prompt="a cat", size="64x64", index_entry="1-0")
        assert await records.get("video-a") == RecordRead()
        assert await records.put("video-a", meta)
        assert await records.get("video-a") == RecordRead(meta)
        assert 0 < await redis.ttl(Keys(prefix).video_meta("video-a")) <= 60


async def test_only_new_keeps_the_first_record(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        records = VideoRecords(redis, Keys(prefix), ttl_s=60)
        first, second = VideoMeta(model="m", prompt="first"), VideoMeta(model="m", prompt="second")
        assert await records.put("video-a", first, only_new=True)
        assert not await records.put("video-a", second, only_new=True)
        assert (await records.get("video-a")).record == first


async def test_a_record_written_before_the_version_field_still_reads(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        old = b'{"model":"m","prompt":"old","size":"64x64","seconds":"1","created_at":5,"origin":{},"task":"t2v"}'
        await redis.set(Keys(prefix).video_meta("video-old"), old)
        read = await VideoRecords(redis, Keys(prefix), ttl_s=60).get("video-old")
        assert read.record is not None and read.record.v == 1
        assert (read.record.prompt, read.record.created_at, read.record.task) == ("old", 5, "t2v")
        assert b'"v":1' in VideoMeta(model="m", prompt="p").model_dump_json().encode()


@pytest.mark.parametrize("raw", [b"{not json", b'{"prompt":"no model"}', b'{"v":2,"model":"m","prompt":"p"}'])
async def test_an_unreadable_record_is_said_so(redis_url: str, prefix: str, raw: bytes) -> None:
    async with open_client(redis_url) as redis:
        await redis.set(Keys(prefix).video_meta("video-junk"), raw)
        assert await VideoRecords(redis, Keys(prefix), ttl_s=60).get("video-junk") == RecordRead(unreadable=True)


async def test_views_read_statuses_records_and_markers_in_order(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        records = VideoRecords(redis, keys, ttl_s=60)
        status = RequestStatus(request_id="video-a", state=RequestState.DONE, stage="s")
        meta = VideoMeta(model="m", prompt="a")
        await redis.hset(keys.request("video-a"), "status", status.model_dump_json())
        await records.put("video-a", meta)
        await redis.set(keys.submitted("video-b"), b"1")
        await redis.hset(keys.request("video-c"), "status", b"{broken")
        await records.put("video-c", meta)
        views = await records.views(["video-a", "video-b", "video-c", "video-d"], submitted=True)
        assert views == [
            VideoView("video-a", status, meta),
            VideoView("video-b", None, None, submitted=True),
            VideoView("video-c", None, None, unreadable=True),
            VideoView("video-d", None, None),
        ]
        assert [v.submitted for v in await records.views(["video-b"])] == [False]
        assert await records.views([]) == []


async def test_previews_and_the_tombstone(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        records = VideoRecords(redis, keys, ttl_s=60)
        assert await records.preview("video-a", "thumbnail") is None
        await records.put_previews("video-a", {"thumbnail": b"jpg", "spritesheet": b"sheet"})
        assert await records.preview("video-a", "thumbnail") == b"jpg"
        assert 0 < await redis.ttl(keys.video_preview("video-a", "spritesheet")) <= 60
        await redis.set(keys.result("video-a"), b"mp4")
        tomb = VideoMeta(model="m", prompt="a", deleted_at=7)
        await records.tombstone("video-a", tomb, previews=("thumbnail", "spritesheet"))
        assert await records.preview("video-a", "thumbnail") is None
        assert await records.preview("video-a", "spritesheet") is None
        assert not await redis.exists(keys.result("video-a"))
        assert (await records.get("video-a")).record == tomb


async def test_redis_away_is_a_control_plane_error(prefix: str) -> None:
    async with open_client("redis://127.0.0.1:1/0") as redis:
        records = VideoRecords(redis, Keys(prefix), ttl_s=60)
        with pytest.raises(ControlPlaneError):
            await records.get("video-a")
        with pytest.raises(ControlPlaneError):
            await records.put("video-a", VideoMeta(model="m", prompt="p"))
        with pytest.raises(ControlPlaneError):
            await records.views(["video-a"])
        with pytest.raises(ControlPlaneError):
            await records.tombstone("video-a", VideoMeta(model="m", prompt="p"), previews=("thumbnail",))
