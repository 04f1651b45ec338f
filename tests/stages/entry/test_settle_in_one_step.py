"""The scripts that take an entry in and settle it, each one round trip, against a real Redis.

* A first delivery's admission script also sets its crash mark and reads what ``Admission.settled``
  needs (record status, cancel flag, run owner): the decision is the same as with the separate read; and
  it writes the entry's start status (a later stage's ``running``) only when the entry will run.
* The hand-off script writes the next stage's ``queued`` into the record (its event comes with that
  stage's ``running``) and clears the crash mark with the hand-off; the cancel flag is the next stage's
  admission's to read.
* The last stage's finish script stores the result, writes ``done``, acks the entry and deletes the
  crash mark — or, cancelled, writes nothing; for an entry no longer ours it writes nothing either (an
  owned write: its holder finishes the request), and only deletes the crash mark.
"""

from __future__ import annotations

from typing import Any

import pytest

from stageferry.broker.control.entry_records import Look, crash_field
from stageferry.broker.control.streams import Entry
from stageferry.config import Limits
from stageferry.errors import CancelledRequestError, RequestIdTakenError
from stageferry.schemas import JobRequest, RequestState, RequestStatus
from stageferry.stages.entry.entry_guard import EntryGuard
from stageferry.stages.entry.outcomes import Outcomes
from stageferry.trace.events import parse_events
from tests.stages.entry import test_admission
from tests.stages.entry.test_admission import RoundTrips, Stage, crashes, envelope, set_crashes

pytestmark = pytest.mark.anyio

stage = test_admission.stage  # the same fixture: a diffusion stage's stream, store and Redis


def guard_of(stage: Stage) -> EntryGuard:
    return EntryGuard(
        redis=stage.redis,
        keys=stage.keys,
        store=stage.store,
        stage="diffusion",
        limits=Limits(),
        ttl_s=600,
        link=stage.stream.script_link,  # as the worker wires it
    )


async def warm_up(guard: EntryGuard, stage: Stage) -> None:
    """Load the admission's script into Redis (a first call of a new script is NOSCRIPT + LOAD + retry): a
    first delivery of no stream (this guard has no holder), so that the entries in hand stay as they are."""
    await guard.admit_and_look(envelope("warm-up"), Entry("0-1", {}, deliveries=1))


async def test_a_first_delivery_is_admitted_marked_and_looked_at_in_one_round_trip(stage: Stage) -> None:
    guard = guard_of(stage)
    first, second = await stage.entries("req-1", 2)
    await warm_up(guard, stage)
    trips = RoundTrips(stage.redis, stage.stream)
    marked, looked = await guard.admit_and_look(envelope("req-1"), first)
    assert trips.count == 1
    assert marked is True and looked is not None
    assert await crashes(stage.redis, stage.keys, "req-1", "diffusion", first.id) == 1
    assert await stage.store.owner("req-1") == envelope("req-1").job.digest()
    # no status, not cancelled, this entry's run, no start
    assert looked == Look(status=None, cancelled=False, claimed=True, owner=first.id, started=False)
    trips.count = 0
    assert await stage.admission.settled(first, envelope("req-1"), looked) is False
    assert trips.count == 0  # nothing read again

    _, second_look = await guard.admit_and_look(envelope("req-1"), second)
    assert second_look == Look(status=None, cancelled=False, claimed=False, owner=first.id, started=False)
    assert await stage.admission.settled(second, envelope("req-1"), second_look) is True  # a duplicate: acked
    assert await stage.stream.pending_count() == 1

    again = type(first)(first.id, first.fields, deliveries=2, stream=first.stream)  # redelivered: admitted alone
    assert await guard.admit_and_look(envelope("req-1"), again) == (
        False,
        None,
    )


async def test_a_taken_id_gets_no_mark_and_no_run_owner(stage: Stage) -> None:
    guard = guard_of(stage)
    [first, other] = await stage.entries("req-2", 2)
    await guard.admit_and_look(envelope("req-2"), first)
    taken = envelope("req-2").model_copy(update={"job": JobRequest(prompt="another job")})
    with pytest.raises(RequestIdTakenError):
        await guard.admit_and_look(taken, other)
    assert await crashes(stage.redis, stage.keys, "req-2", "diffusion", other.id) == 0


async def test_a_cancelled_or_finished_request_is_seen_by_the_admission_look(stage: Stage) -> None:
    guard = guard_of(stage)
    [cancelled] = await stage.entries("req-3", 1)
    await stage.redis.set(stage.keys.cancel("req-3"), b"1")
    _, looked = await guard.admit_and_look(envelope("req-3"), cancelled)
    with pytest.raises(CancelledRequestError):
        await stage.admission.settled(cancelled, envelope("req-3"), looked)
    [done] = await stage.entries("req-4", 1)
    await stage.store.admit("req-4", envelope("req-4").job.digest())  # its job's, and then finished
    assert await stage.store.set_status(RequestStatus(request_id="req-4", state=RequestState.DONE, stage="diffusion"))
    _, looked = await guard.admit_and_look(envelope("req-4"), done)
    assert await stage.admission.settled(done, envelope("req-4"), looked) is True


async def test_the_admission_writes_the_start_status_only_for_an_entry_that_will_run(stage: Stage) -> None:
    guard, outcomes = guard_of(stage), outcomes_of(stage)
    queued = RequestStatus(request_id="req-8", state=RequestState.QUEUED, stage="diffusion")
    for rid in ("req-8", "req-9"):
        await stage.store.admit(rid, envelope(rid).job.digest())
        assert await stage.store.set_status(queued.model_copy(update={"request_id": rid}), stage_index=1)
    first, second = await stage.entries("req-8", 2)

    async def admit(entry: Entry, rid: str) -> tuple[bool, Any]:
        starts = outcomes.start_writes(entry, envelope(rid), media_free=True)
        assert starts
        return await guard.admit_and_look(envelope(rid), entry, starts)

    await warm_up(guard, stage)
    trips = RoundTrips(stage.redis, stage.stream)
    _, looked = await admit(first, "req-8")
    assert trips.count == 1 and looked.started
    got = await stage.store.get("req-8")
    assert got is not None and got.state is RequestState.RUNNING and got.stage == "diffusion"
    assert await stage.admission.settled(first, envelope("req-8"), looked) is False
    _, looked = await admit(second, "req-8")  # a duplicate run: no start written (it is skipped)
    assert not looked.started and await stage.admission.settled(second, envelope("req-8"), looked) is True
    await stage.stream.ack(first.id)  # done with: the next read takes a new entry

    [cancelled] = await stage.entries("req-9", 1)
    await stage.redis.set(stage.keys.cancel("req-9"), b"1")
    _, looked = await admit(cancelled, "req-9")
    assert not looked.started
    got = await stage.store.get("req-9")
    assert got is not None and got.state is RequestState.QUEUED  # the outcome writes "cancelled" next


def outcomes_of(stage: Stage) -> Outcomes:
    return Outcomes(stage="diffusion", stream=stage.stream, store=stage.store, stages=("encoder", "diffusion"))


async def test_the_hand_off_writes_queued_into_the_record_and_clears_the_crash_mark(stage: Stage) -> None:
    warm, entry = await stage.entries("req-5", 2)
    warming = outcomes_of(stage).status_write("req-5-warm", RequestState.QUEUED, stage="next")
    await stage.stream.hand_off(  # this script loaded (a first call is NOSCRIPT, then a load through redis-py)
        warm.id, "next", {"request_id": "req-5"}, status=warming, crash_field=crash_field("diffusion", warm.id)
    )
    mark = crash_field("diffusion", entry.id)
    await set_crashes(stage.redis, stage.keys, "req-5", "diffusion", entry.id, 1)
    status = outcomes_of(stage).status_write("req-5", RequestState.QUEUED, stage="next")
    fields = {"request_id": "req-5", "envelope": "{}"}
    events = stage.keys.events("req-5")
    before = await stage.redis.xlen(events)
    await stage.redis.set(stage.keys.cancel("req-5"), b"1")  # the next stage's admission reads it, not this
    trips = RoundTrips(stage.redis, stage.stream)
    assert await stage.stream.hand_off(entry.id, "next", fields, status=status, crash_field=mark)
    assert trips.count == 1
    assert await stage.redis.xlen(stage.keys.stage_stream("next")) == 2
    assert await crashes(stage.redis, stage.keys, "req-5", "diffusion", entry.id) == 0
    got = await stage.store.get("req-5")
    assert got is not None and got.state is RequestState.QUEUED and got.stage == "next"
    # no event of its own: the next stage's admission sends it with its running (folded)
    assert await stage.redis.xlen(events) == before
    assert await stage.stream.pending_count() == 0


async def test_a_later_stages_admission_sends_the_hand_offs_queued_with_its_running(stage: Stage) -> None:
    """The event the hand-off did not send: the admission's one event, ``running``, carries the ``queued``
    (``folded``), dated by the entry's id, so that the trace still shows how long the entry waited."""
    guard = guard_of(stage)
    await warm_up(guard, stage)
    await stage.store.set_status(RequestStatus(request_id="req-10", state=RequestState.RUNNING, stage="encoder"))
    [entry] = await stage.entries("req-10", 1)  # handed on after the encoder's running
    env = envelope("req-10")
    starts = outcomes_of(stage).start_writes(entry, env, media_free=True)
    assert [w.state for w in starts] == ["queued", "running"]
    before = await stage.redis.xlen(stage.keys.events("req-10"))
    _, looked = await guard.admit_and_look(env, entry, starts)
    assert looked is not None and looked.started
    rows = await stage.redis.xrange(stage.keys.events("req-10"))
    assert len(rows) == before + 1
    events = parse_events([(eid.decode(), {k.decode(): v.decode() for k, v in f.items()}) for eid, f in rows])
    queued, running = events[-2:]
    assert (queued.event, queued.stage, running.event, running.stage) == (
        "status.queued",
        "diffusion",
        "status.running",
        "diffusion",
    )
    assert queued.timestamp == pytest.approx(int(entry.id.split("-")[0]) / 1000)


async def test_finish_stores_the_result_writes_done_and_acks_in_one_round_trip(stage: Stage) -> None:
    [entry] = await stage.entries("req-6", 1)
    mark = crash_field("diffusion", entry.id)
    await set_crashes(stage.redis, stage.keys, "req-6", "diffusion", entry.id, 1)
    status = outcomes_of(stage).status_write("req-6", RequestState.DONE, stage="diffusion")
    keys = dict(cancel=stage.keys.cancel("req-6"), crash_field=mark, result_key=stage.keys.result("req-6"))
    await stage.redis.set(keys["cancel"], b"1")
    with pytest.raises(CancelledRequestError):
        await stage.stream.finish(entry.id, status=status, result=(b"video", 600), **keys)
    assert await stage.store.get("req-6") is None and await stage.redis.get(keys["result_key"]) is None
    assert await stage.stream.pending_count() == 1
    await stage.redis.delete(keys["cancel"])
    trips = RoundTrips(stage.redis, stage.stream)
    assert await stage.stream.finish(entry.id, status=status, result=(b"video", 600), **keys) == (True, True)
    assert trips.count == 1
    assert await stage.redis.get(keys["result_key"]) == b"video"
    assert 0 < await stage.redis.ttl(keys["result_key"]) <= 600
    got = await stage.store.get("req-6")
    assert got is not None and got.state is RequestState.DONE
    assert await crashes(stage.redis, stage.keys, "req-6", "diffusion", entry.id) == 0
    assert await stage.stream.pending_count() == 0
    # a second finisher (say, a replica that lost the entry and computed it again) changes nothing
    assert await stage.stream.finish(entry.id, status=status, result=(b"other", 600), **keys) == (False, False)
    assert await stage.redis.get(keys["result_key"]) == b"video"


async def test_finish_of_an_entry_no_longer_ours_writes_nothing(stage: Stage) -> None:
    """An owned write (issue 34): a replica that lost its entry to another one writes neither the result nor
    the terminal status (the holder does); only its crash mark goes.  Without it, a run after Redis lost the
    request wrote ``done`` for a request its waiters had been told was lost."""
    [entry] = await stage.entries("req-7", 1)
    await stage.redis.xclaim(stage.keys.stage_stream("diffusion"), "diffusion", "diffusion-b", 0, [entry.id])
    status = outcomes_of(stage).status_write("req-7", RequestState.DONE, stage="diffusion")
    mark = crash_field("diffusion", entry.id)
    await set_crashes(stage.redis, stage.keys, "req-7", "diffusion", entry.id, 1)
    finished = await stage.stream.finish(
        entry.id,
        status=status,
        cancel=stage.keys.cancel("req-7"),
        crash_field=mark,
        result_key=stage.keys.result("req-7"),
        result=(b"video", 60),
    )
    assert finished == (False, False)
    assert await stage.stream.pending_count() == 1  # the other replica's to settle
    assert await stage.store.get("req-7") is None
    assert not await stage.redis.exists(stage.keys.result("req-7"))
    assert await crashes(stage.redis, stage.keys, "req-7", "diffusion", entry.id) == 0
