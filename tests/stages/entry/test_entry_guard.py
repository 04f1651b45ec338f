"""The entry guard on real Redis: a first delivery is admitted and crash-marked in one script, a taken
id gets no mark, and a redelivery is admitted alone (its marks are checked before it is marked again)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable

import pytest

from stageferry.broker.control.entry_records import crash_field
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.resp_link import open_link
from stageferry.broker.control.streams import Entry
from stageferry.config import Limits
from stageferry.errors import RequestIdTakenError, StageCrashedError
from stageferry.schemas import Envelope, JobRequest
from stageferry.stages.entry.entry_guard import EntryGuard
from tests.stages.entry.test_admission import crashes

pytestmark = pytest.mark.anyio


def envelope(rid: str, prompt: str = "x") -> Envelope:
    return Envelope(
        request_id=rid, key=f"{rid}_0", from_stage="encoder", to_stage="diffusion", job=JobRequest(prompt=prompt)
    )


@pytest.fixture
async def guard(redis_url: str, prefix: str) -> AsyncIterator[EntryGuard]:
    async with open_client(redis_url) as redis:
        keys = Keys(prefix)
        store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        yield EntryGuard(redis=redis, keys=keys, store=store, stage="diffusion", limits=Limits(), ttl_s=600)


async def test_first_delivery_is_admitted_and_marked_at_once(guard: EntryGuard) -> None:
    first = Entry("1-0", {}, deliveries=1)

    def mark() -> Awaitable[int]:
        return crashes(guard.redis, guard.keys, "r1", "diffusion", first.id)

    assert await guard.admit(envelope("r1"), first) is True
    assert await mark() == 1
    assert await guard.store.owner("r1") == envelope("r1").job.digest()
    async with guard.crash_mark(first, "r1", marked=True):
        assert await mark() == 1  # not counted twice
    assert await mark() == 0

    other = Entry("2-0", {}, deliveries=1)
    with pytest.raises(RequestIdTakenError):
        await guard.admit(envelope("r1", prompt="another job"), other)
    assert await crashes(guard.redis, guard.keys, "r1", "diffusion", other.id) == 0

    again = Entry("1-0", {}, deliveries=2)  # redelivered: admitted alone, marked by crash_mark
    assert await guard.admit(envelope("r1"), again) is False
    assert await mark() == 0
    await guard.check_crashes(again, "r1")
    async with guard.crash_mark(again, "r1"):
        assert await mark() == 1


async def test_unmark_takes_back_the_admissions_mark(guard: EntryGuard) -> None:
    first = Entry("3-0", {}, deliveries=1)
    assert await guard.admit(envelope("r2"), first) is True
    await guard.unmark(first, "r2")
    assert await crashes(guard.redis, guard.keys, "r2", "diffusion", first.id) == 0


async def test_a_first_delivery_s_admission_run_twice_counts_one_crash_mark_and_rides_the_link(
    redis_url: str, prefix: str
) -> None:
    """A call repeated after a lost connection runs the script again: the mark must stay at 1 (with the
    default limit of 2, a mark of 2 would dead-letter the request at its first real crash)."""
    async with open_client(redis_url) as redis:
        keys, link = Keys(prefix), open_link(redis)
        store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        guard = EntryGuard(
            redis=redis, keys=keys, store=store, stage="diffusion", limits=Limits(), ttl_s=600, link=link
        )
        first = Entry("5-0", {}, deliveries=1)
        assert await guard.admit(envelope("r5"), first) is True
        assert await guard.admit(envelope("r5"), first) is True  # the same script, run again
        assert await crashes(redis, keys, "r5", "diffusion", first.id) == 1
        assert link is not None and link.fallbacks <= 1, "over the link (the first call may load the script)"
        await link.aclose()


async def test_a_redelivery_s_mark_run_twice_counts_one_crash(guard: EntryGuard) -> None:
    """A redelivery's mark counts up, unlike the first delivery's: run twice for one delivery (a retry
    after a lost reply), it must still count one crash, or the request is dead-lettered a crash early."""
    first = Entry("6-0", {}, deliveries=1)
    assert await guard.admit(envelope("r6"), first) is True  # marked 1; the stage then dies with it
    again = Entry("6-0", {}, deliveries=2)
    await guard.check_crashes(again, "r6")  # 1 < max_crashes (2): it runs
    field = crash_field("diffusion", again.id)
    record = guard.keys.request("r6")
    assert await guard.records.mark(record, field, again.deliveries) == 2  # and dies again
    assert await guard.records.mark(record, field, again.deliveries) == 2  # the same call, repeated
    assert await crashes(guard.redis, guard.keys, "r6", "diffusion", again.id) == 2
    with pytest.raises(StageCrashedError):
        await guard.check_crashes(Entry("6-0", {}, deliveries=3), "r6")
