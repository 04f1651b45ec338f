"""Owned writes and lost requests on real Redis (issue 34): a stage writes a request's record only while
it holds an entry of it, and an entry it no longer holds ends its request ``failed`` / ``request_lost``
only when nothing else can settle it — once, for good."""

from __future__ import annotations

import pytest

from stageferry.broker.control.record_loss import Loss, RecordLoss
from stageferry.config import Limits
from stageferry.errors import RequestLostError
from stageferry.schemas import RequestState, RequestStatus
from stageferry.stages.entry.entry_guard import EntryGuard
from tests.stages.entry import test_admission
from tests.stages.entry.test_admission import Stage, envelope

pytestmark = pytest.mark.anyio

stage = test_admission.stage  # a diffusion stage's stream ("diffusion-a"), store and Redis


def running(rid: str) -> RequestStatus:
    return RequestStatus(request_id=rid, state=RequestState.RUNNING, stage="diffusion")


async def test_an_owned_status_write_needs_the_entry_held(stage: Stage) -> None:
    [entry] = await stage.entries("req-1", 1)
    held = stage.stream.held(entry)
    assert await stage.store.set_status(running("req-1"), held=held)
    stream = stage.keys.stage_stream("diffusion")
    await stage.redis.xclaim(stream, "diffusion", "diffusion-b", 0, [entry.id])  # another replica took it
    done = RequestStatus(request_id="req-1", state=RequestState.DONE, stage="diffusion")
    assert not await stage.store.set_status(done, held=held)
    await stage.redis.delete(stream)  # Redis lost the stream (NOGROUP): held by nobody
    assert not await stage.store.set_status(done, held=held)
    got = await stage.store.get("req-1")
    assert got is not None and got.state is RequestState.RUNNING


async def test_an_admission_of_an_entry_not_held_writes_nothing(stage: Stage) -> None:
    guard = EntryGuard(
        redis=stage.redis,
        keys=stage.keys,
        store=stage.store,
        stage="diffusion",
        limits=Limits(),
        ttl_s=600,
        link=stage.stream.script_link,
        holder=stage.stream.held,
    )
    first, second = await stage.entries("req-2", 2)
    await stage.redis.delete(stage.keys.stage_stream("diffusion"))  # an empty restart took both
    with pytest.raises(RequestLostError):
        await guard.admit_and_look(envelope("req-2"), first)
    redelivered = type(second)(second.id, second.fields, deliveries=2, stream=second.stream)
    with pytest.raises(RequestLostError):
        await guard.admit(envelope("req-2"), redelivered)
    assert not await stage.redis.exists(stage.keys.request("req-2")), "no record came back (held by nothing)"


async def test_a_lost_request_ends_request_lost_once_and_only_when_nothing_holds_it(stage: Stage) -> None:
    loss = RecordLoss(stage.redis, stage.store)
    stream = stage.keys.stage_stream("diffusion")

    [recorded] = await stage.entries("req-3", 1)
    assert await stage.store.set_status(running("req-3"))
    await stage.redis.xclaim(stream, "diffusion", "diffusion-b", 0, [recorded.id])
    assert await loss.end_if_lost(stage.stream.held(recorded), "req-3", stage="diffusion") is Loss.RECORDED

    [queued] = await stage.entries("req-4", 1)  # no record yet, but its entry is still there (reclaimed)
    await stage.redis.xclaim(stream, "diffusion", "diffusion-b", 0, [queued.id])
    assert await loss.end_if_lost(stage.stream.held(queued), "req-4", stage="diffusion") is Loss.QUEUED
    assert await stage.store.get("req-4") is None

    [gone] = await stage.entries("req-5", 1)
    await stage.redis.delete(stream)  # Redis lost the stream with the entry, and the request's record
    assert await loss.end_if_lost(stage.stream.held(gone), "req-5", stage="diffusion") is Loss.ENDED
    ended = await stage.store.get("req-5")
    assert ended is not None and ended.state is RequestState.FAILED
    assert ended.error is not None and ended.error.code == "request_lost"
    assert await loss.end_if_lost(stage.stream.held(gone), "req-5", stage="diffusion") is Loss.RECORDED
    done = RequestStatus(request_id="req-5", state=RequestState.DONE, stage="diffusion")
    assert not await stage.store.set_status(done), "terminal once: a later run cannot make it done"
    final = await stage.store.get("req-5")
    assert final is not None and final.state is RequestState.FAILED
