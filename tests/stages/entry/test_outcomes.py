"""The worker's one boundary (:class:`Outcomes.settle`) against a real Redis: each kind of error ends
its request in the table's state and disposes of the stream entry as the table says."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.refusals import Refusals
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.errors import (
    CancelledRequestError,
    DataPlaneError,
    DeadLetteredError,
    EnvelopeError,
    GroupBrokenError,
    InvalidRequestIdError,
    JobValidationError,
    PayloadUnavailableError,
    RequestIdTakenError,
    StageFailedError,
    StageferryError,
)
from stageferry.schemas import Envelope, JobRequest, RequestState, request_key
from stageferry.stages.entry.outcomes import Outcomes
from tests.links import record_sends

pytestmark = pytest.mark.anyio


class Stage:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.stream = StageStream(redis, keys, "diffusion", "diffusion-a", visibility_ms=30_000)
        self.store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        self.outcomes = Outcomes(stage="diffusion", stream=self.stream, store=self.store)

    async def entry(self, rid: str, **extra: str) -> Entry:
        await self.redis.xadd(self.keys.stage_stream("diffusion"), {"request_id": rid, "job": "{}", **extra})
        [entry] = await self.stream.read(1, block_ms=1000)
        return entry

    async def dead_letters(self) -> list[dict[bytes, bytes]]:
        return [fields for _id, fields in await self.redis.xrange(self.keys.dead_letter("diffusion"))]


@pytest.fixture
async def stage(redis_url: str, prefix: str) -> AsyncIterator[Stage]:
    keys = Keys(prefix)
    async with open_client(redis_url) as redis:
        stage = Stage(redis, keys)
        await stage.stream.ensure_group()
        yield stage


@pytest.mark.parametrize(
    ("error", "state", "dead_lettered"),
    [
        (CancelledRequestError("cancelled during denoising", step=3), RequestState.CANCELLED, False),
        (JobValidationError("invalid job", [{"field": "prompt", "message": "m", "type": "t"}]), RequestState.REJECTED,
         False),
        (EnvelopeError("invalid envelope"), RequestState.REJECTED, True),
        (DeadLetteredError("delivered 4 times"), RequestState.FAILED, True),
        (StageFailedError("the model raised"), RequestState.FAILED, False),
        (PayloadUnavailableError("gone"), RequestState.FAILED, False),  # no recompute offered: fails
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, StageferryError) else str(v),
)  # fmt: skip
async def test_settle_writes_the_tables_state(
    stage: Stage, error: StageferryError, state: RequestState, dead_lettered: bool
) -> None:
    entry = await stage.entry("req-1")
    with capture_logs() as logs:
        await stage.outcomes.settle(entry, "req-1", error)
    status = await stage.store.get("req-1")
    assert status is not None and status.state is state and status.stage == "diffusion"
    assert status.error is not None and status.error.code == error.code and status.error.details == error.details
    assert await stage.stream.pending_count() == 0
    dlq = await stage.dead_letters()
    assert [f[b"error_code"].decode() for f in dlq] == ([error.code] if dead_lettered else [])
    assert [e["event"] for e in logs if e["event"].startswith("request.")] == [f"request.{state.value}"]


async def test_recompute_is_offered_first_and_the_request_fails_only_if_declined(stage: Stage) -> None:
    envelope = Envelope(request_id="req-2", key=request_key("req-2", 0), from_stage="encoder", to_stage="diffusion",
                        job=JobRequest(prompt="x"))  # fmt: skip
    offered: list[DataPlaneError] = []

    async def accept(entry: Entry, env: Envelope, exc: DataPlaneError) -> bool:
        offered.append(exc)
        await stage.stream.ack(entry.id)  # stands for the hand-back, which also acknowledges
        return True

    entry = await stage.entry("req-2")
    await stage.outcomes.settle(entry, "req-2", PayloadUnavailableError("gone"), envelope=envelope, recompute=accept)
    assert len(offered) == 1 and await stage.store.get("req-2") is None  # nothing written: it runs again

    async def decline(entry: Entry, env: Envelope, exc: DataPlaneError) -> bool:
        return False

    entry = await stage.entry("req-2")
    await stage.outcomes.settle(entry, "req-2", PayloadUnavailableError("gone"), envelope=envelope, recompute=decline)
    status = await stage.store.get("req-2")
    assert status is not None and status.state is RequestState.FAILED and status.error is not None
    assert status.error.code == "payload_unavailable" and await stage.stream.pending_count() == 0


async def test_a_broken_group_leaves_the_entry_pending_and_writes_nothing(stage: Stage) -> None:
    entry = await stage.entry("req-3")
    with pytest.raises(GroupBrokenError):
        await stage.outcomes.settle(entry, "req-3", GroupBrokenError("a rank died"))
    assert await stage.store.get("req-3") is None and await stage.stream.pending_count() == 1


async def test_an_entry_without_a_request_is_only_dead_lettered(stage: Stage) -> None:
    entry = await stage.entry("not a valid id!")
    await stage.outcomes.settle(entry, None, EnvelopeError("missing or invalid request_id"))
    assert [f[b"error_code"] for f in await stage.dead_letters()] == [b"invalid_envelope"]
    assert await stage.stream.pending_count() == 0


@pytest.mark.parametrize("error", [StageFailedError("the model raised"), DeadLetteredError("delivered 9 times")])
async def test_a_status_that_cannot_be_written_dead_letters_the_entry(stage: Stage, error: StageferryError) -> None:
    """A request key of another type (what a client's ``SET`` made of it) makes the status write fail: the
    entry is dead-lettered with both reasons and nothing escapes to stop the stage."""
    await stage.redis.set(stage.keys.request("req-poison"), "x")
    entry = await stage.entry("req-poison")
    with capture_logs() as logs:
        await stage.outcomes.settle(entry, "req-poison", error)
    [dead] = await stage.dead_letters()
    assert dead[b"error_code"] == error.code.encode() and b"could not be written" in dead[b"reason"]
    assert await stage.stream.pending_count() == 0
    assert any(e["event"] == "worker.status_write_failed" for e in logs)


async def test_a_refused_entry_gets_a_refusal_record_under_its_ticket(stage: Stage) -> None:
    refusals = Refusals(stage.redis, stage.keys, ttl_s=600)
    outcomes = Outcomes(stage="diffusion", stream=stage.stream, store=stage.store, refusals=refusals)
    ticket = uuid.uuid4().hex
    entry = await stage.entry("victim:cancel", ticket=ticket)
    await outcomes.settle(entry, None, InvalidRequestIdError("missing or invalid request_id"))
    refusal = await refusals.get(ticket)
    assert refusal is not None and refusal.code == "invalid_request_id" and refusal.request_id == "victim:cancel"
    assert refusal.ticket == ticket and refusal.entry == entry.id
    assert isinstance(refusal.error(), InvalidRequestIdError)
    assert not await stage.redis.exists(stage.keys.request("victim"), stage.keys.cancel("victim"))
    assert [f[b"error_code"] for f in await stage.dead_letters()] == [b"invalid_request_id"]


async def test_a_submission_under_another_jobs_id_gets_a_refusal_record(stage: Stage) -> None:
    """``request_id_taken`` writes nothing under the id (the owner's), so its submitter reads it by ticket;
    the first refusal of a ticket stands."""
    refusals = Refusals(stage.redis, stage.keys, ttl_s=600)
    outcomes = Outcomes(stage="diffusion", stream=stage.stream, store=stage.store, refusals=refusals)
    ticket = uuid.uuid4().hex
    entry = await stage.entry("owned-1", ticket=ticket)
    await outcomes.settle(entry, "owned-1", RequestIdTakenError("request id already in use by a different job"))
    refusal = await refusals.get(ticket)
    assert refusal is not None and refusal.code == "request_id_taken" and refusal.request_id == "owned-1"
    assert isinstance(refusal.error(), RequestIdTakenError)
    assert not await stage.redis.exists(stage.keys.request("owned-1"), stage.keys.events("owned-1"))
    again = await stage.entry("owned-1", ticket=ticket)
    await outcomes.settle(again, None, InvalidRequestIdError("a later refusal"))
    later = await refusals.get(ticket)
    assert later is not None and later.code == "request_id_taken"
    untagged = await stage.entry("owned-2")  # a services' user's entry: no ticket, no record
    await outcomes.settle(untagged, "owned-2", RequestIdTakenError("taken"))
    assert await stage.redis.keys(stage.keys.refused("*")) == [stage.keys.refused(ticket).encode()]


async def test_status_writes_take_the_streams_script_link(stage: Stage) -> None:
    """The stage's own status writes (``running``, a terminal state) go over the stream's lean link, as
    its other per-entry scripts do, not through redis-py's pool."""
    link = stage.stream.script_link
    assert link is not None
    trips = record_sends(link)
    entry = await stage.entry("req-link")
    trips.clear()  # the read above took the link too
    assert await stage.outcomes.finish("req-link", RequestState.DONE)
    assert trips == [["FCALL"]]
    status = await stage.store.get("req-link")
    assert status is not None and status.state is RequestState.DONE
    await stage.stream.ack(entry.id)
