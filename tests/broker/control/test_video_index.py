"""broker.control.video_index: the video index and the console's recent list on a real Redis."""

from __future__ import annotations

import pytest

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.video_index import RECENT_MAX, IndexEntry, VideoIndex
from stageferry.errors import ControlPlaneError

pytestmark = pytest.mark.anyio


async def test_pages_go_both_ways_from_an_exclusive_cursor(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        index = VideoIndex(redis, Keys(prefix), tenant=None, ttl_s=3600)
        entries = [await index.append(f"video-{i}") for i in range(5)]
        asc = await index.read(order="asc", after=None, count=3)
        assert asc == [IndexEntry(entries[i], f"video-{i}") for i in range(3)]
        assert [e.request_id for e in await index.read(order="asc", after=entries[2], count=10)] == [
            "video-3",
            "video-4",
        ]
        desc = await index.read(order="desc", after=entries[3], count=2)
        assert [e.request_id for e in desc] == ["video-2", "video-1"]
        assert await index.any_after(order="asc", after=entries[3])
        assert not await index.any_after(order="asc", after=entries[4])
        assert not await index.any_after(order="desc", after=entries[0])


async def test_tenants_have_their_own_index_and_remove_drops_one_entry(redis_url: str, prefix: str) -> None:
    async with open_client(redis_url) as redis:
        acme = VideoIndex(redis, Keys(prefix), tenant="acme", ttl_s=3600)
        other = VideoIndex(redis, Keys(prefix), tenant="other", ttl_s=3600)
        kept, gone = await acme.append("acme.video-1"), await acme.append("acme.video-2")
        await other.append("other.video-1")
        await acme.remove(gone)
        assert await acme.read(order="asc", after=None, count=10) == [IndexEntry(kept, "acme.video-1")]
        assert [e.request_id for e in await other.read(order="asc", after=None, count=10)] == ["other.video-1"]


async def test_recent_is_newest_first_distinct_and_capped(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        index = VideoIndex(redis, keys, tenant=None, ttl_s=3600)
        for rid in ("video-a", "video-b", "video-a", "video-c"):
            await index.append(rid)
        assert await index.recent(limit=10) == ["video-c", "video-a", "video-b"]
        assert await index.recent(limit=2) == ["video-c", "video-a"]
        for i in range(RECENT_MAX + 5):
            await index.append(f"video-{i}")
        assert await redis.xlen(keys.recent_videos()) == RECENT_MAX


async def test_an_entry_naming_no_job_is_kept_as_such(redis_url: str, prefix: str) -> None:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        entry = (await redis.xadd(keys.video_index(None), {"other": "x"})).decode()
        await redis.xadd(keys.recent_videos(), {"other": "x"})
        index = VideoIndex(redis, keys, tenant=None, ttl_s=3600)
        assert await index.read(order="asc", after=None, count=5) == [IndexEntry(entry, "")]
        assert await index.recent(limit=5) == []


async def test_redis_away_is_a_control_plane_error(prefix: str) -> None:
    async with open_client("redis://127.0.0.1:1/0") as redis:
        index = VideoIndex(redis, Keys(prefix), tenant=None, ttl_s=60)
        with pytest.raises(ControlPlaneError):
            await index.append("video-a")
        with pytest.raises(ControlPlaneError):
            await index.read(order="desc", after=None, count=1)
        with pytest.raises(ControlPlaneError):
            await index.recent(limit=1)
