"""Request records against a real Redis: statuses move forward only, and an id belongs to its first job.

The writes are issued out of order on purpose, as a slow replica or a late hand-off would issue them:
the comparison happens inside the writing script, so whatever arrives late changes nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from stageferry.broker.control.functions import invocation
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.control.requests import LINK_MAX_UPLOAD_BYTES, Admission, RequestStore
from stageferry.broker.control.resp_link import open_link
from stageferry.errors import ControlPlaneError
from stageferry.schemas import ErrorInfo, JobRequest, Progress, RequestState, RequestStatus
from tests.links import record_sends
from tests.security.servers import AclRedis

pytestmark = pytest.mark.anyio

JOB = JobRequest(prompt="a cat", width=320, height=192, num_inference_steps=4)
OTHER = JobRequest(prompt="a dog", width=320, height=192, num_inference_steps=4)


@pytest.fixture
async def store(redis_url: str, prefix: str) -> AsyncIterator[RequestStore]:
    redis = connect(redis_url)
    yield RequestStore(redis, Keys(prefix), ttl_s=600, events_maxlen=100)
    await redis.aclose()


def status(state: RequestState, stage: str, attempt: int = 0, step: int | None = None) -> RequestStatus:
    progress = None if step is None else Progress(stage=stage, step=step, total=10)
    return RequestStatus(request_id="r-1", state=state, stage=stage, attempt=attempt, progress=progress)


async def states(store: RequestStore) -> list[tuple[str, str | None]]:
    """The status events written, oldest first: (state, stage)."""
    out = []
    for _, fields in await store.events("r-1"):
        if fields.get("kind") == "status":
            out.append((fields["state"], fields["status"]["stage"]))
    return out


async def test_a_late_queued_never_moves_a_running_request_back(store: RequestStore) -> None:
    assert await store.set_status(status(RequestState.QUEUED, "encoder"), stage_index=0)
    assert await store.set_status(status(RequestState.RUNNING, "encoder"), stage_index=0)
    # diffusion starts before the encoder's "queued in diffusion" lands
    assert await store.set_status(status(RequestState.RUNNING, "diffusion"), stage_index=1)
    assert not await store.set_status(status(RequestState.QUEUED, "diffusion"), stage_index=1)
    assert not await store.set_status(status(RequestState.RUNNING, "encoder", step=3), stage_index=0)
    current = await store.get("r-1")
    assert current is not None and (current.state, current.stage) == (RequestState.RUNNING, "diffusion")
    assert await states(store) == [("queued", "encoder"), ("running", "encoder"), ("running", "diffusion")]


async def test_progress_moves_forward_only(store: RequestStore) -> None:
    assert await store.set_status(status(RequestState.RUNNING, "diffusion", step=5), stage_index=1)
    assert not await store.set_status(status(RequestState.RUNNING, "diffusion", step=4), stage_index=1)
    assert await store.set_status(status(RequestState.RUNNING, "diffusion", step=5), stage_index=1)  # same: kept
    assert await store.set_status(status(RequestState.RUNNING, "diffusion", step=6), stage_index=1)
    current = await store.get("r-1")
    assert current is not None and current.progress is not None and current.progress.step == 6


async def test_a_new_attempt_goes_back_to_an_earlier_stage(store: RequestStore) -> None:
    """A recompute sends the request back upstream with attempt + 1: that is forward, not backward."""
    assert await store.set_status(status(RequestState.RUNNING, "diffusion", step=2), stage_index=1)
    assert await store.set_status(status(RequestState.QUEUED, "encoder", attempt=1), stage_index=0)
    assert not await store.set_status(status(RequestState.RUNNING, "diffusion", step=3), stage_index=1)  # old attempt
    assert await store.set_status(status(RequestState.RUNNING, "encoder", attempt=1), stage_index=0)
    current = await store.get("r-1")
    assert current is not None and (current.stage, current.attempt) == ("encoder", 1)


async def test_terminal_is_written_once_and_never_overtaken(store: RequestStore) -> None:
    done = RequestStatus(request_id="r-1", state=RequestState.DONE, stage="diffusion")
    assert await store.set_status(done, stage_index=1)
    failed = RequestStatus(
        request_id="r-1", state=RequestState.FAILED, stage="encoder", error=ErrorInfo(code="x", message="late")
    )
    assert not await store.set_status(failed, stage_index=0)
    assert not await store.set_status(status(RequestState.RUNNING, "diffusion", attempt=5), stage_index=1)
    current = await store.get("r-1")
    assert current is not None and current.state is RequestState.DONE


async def test_a_refusal_writes_nothing_over_an_owned_record(store: RequestStore) -> None:
    rejected = RequestStatus(
        request_id="r-1", state=RequestState.REJECTED, stage="encoder", error=ErrorInfo(code="invalid_job", message="x")
    )
    assert await store.admit("r-1", JOB.digest()) is Admission.NEW
    assert await store.set_status(status(RequestState.QUEUED, "encoder"), stage_index=0)
    assert not await store.set_status(rejected, mode="unowned")
    current = await store.get("r-1")
    assert current is not None and current.state is RequestState.QUEUED
    assert await states(store) == [("queued", "encoder")]
    # nobody's id: the refusal is written, and the id is then taken for good
    assert await store.set_status(rejected.model_copy(update={"request_id": "r-2"}), mode="unowned")
    assert await store.admit("r-2", JOB.digest()) is Admission.TAKEN


async def test_an_id_belongs_to_its_first_job(store: RequestStore) -> None:
    assert await store.owner("r-1") is None
    assert await store.admit("r-1", JOB.digest()) is Admission.NEW
    assert await store.admit("r-1", JOB.digest()) is Admission.SAME_JOB
    assert await store.admit("r-1", OTHER.digest()) is Admission.TAKEN
    assert await store.owner("r-1") == JOB.digest()


async def test_a_wait_ends_with_the_status_its_terminal_event_carries(store: RequestStore, prefix: str) -> None:
    """The waiter takes the terminal status from the event (no HGET after it): here the record is deleted
    in the same transaction that writes the status, and the wait still returns the status written."""
    keys = Keys(prefix)
    await store.set_status(status(RequestState.RUNNING, "encoder"))
    result: list[RequestStatus] = []

    async def wait() -> None:
        result.append(await store.wait("r-1", timeout=30))

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        while store.fanin.waiters < 1:
            await anyio.sleep(0.01)
        done = RequestStatus(request_id="r-1", state=RequestState.DONE, stage="diffusion")
        write = store.status_write(done, stage_index=1)
        async with store._redis.pipeline(transaction=True) as pipe:
            pipe.execute_command(*invocation(store._set_status, [write.record, write.events], write.args()))
            pipe.delete(keys.request("r-1"))
            await pipe.execute()
    assert [(s.state, s.stage) for s in result] == [(RequestState.DONE, "diffusion")]


@pytest.mark.parametrize(("upload_bytes", "over_link"), [(0, True), (LINK_MAX_UPLOAD_BYTES, True), (1 << 20, False)])
async def test_a_submission_takes_the_lean_link_unless_its_uploads_are_large(
    store: RequestStore, prefix: str, upload_bytes: int, over_link: bool
) -> None:
    """A link is one socket shared by every submit of a client (the gateway's): a megabyte of uploads goes
    through redis-py's pool instead, and the submission lands the same either way."""
    link = open_link(store._redis)
    assert link is not None
    trips = record_sends(link)
    keys = Keys(prefix)
    uploads = {keys.upload("r-1", "ref"): b"x" * upload_bytes} if upload_bytes else {}
    try:
        entry = await store.submit("r-1", JOB, "encoder", stream_maxlen=10, uploads=uploads, link=link)
    finally:
        await link.aclose()
    assert entry is not None and await store._redis.llen(keys.intake("encoder")) == 1  # type: ignore[misc]
    assert (await store._redis.strlen(keys.upload("r-1", "ref"))) == upload_bytes
    sent = [name for trip in trips for name in trip]
    assert ("RPUSH" in sent) is over_link and ("LLEN" in sent) is over_link
    assert "MULTI" not in sent  # a pipeline: the push, then the marker


async def test_a_follower_whose_shared_reader_lags_still_gets_the_terminal_event(store: RequestStore) -> None:
    """The record turns terminal in the same script that appends its event, but the shared reader may not
    have handed that event out when a quiet spell's check finds the record terminal: the follower reads
    the rest of the trace itself.  Here the reader never hands anything out (as if every row were still in
    flight)."""
    for state, stage, index in [(RequestState.QUEUED, "encoder", 0), (RequestState.RUNNING, "encoder", 0)]:
        assert await store.set_status(status(state, stage), stage_index=index)
    assert await store.set_status(status(RequestState.DONE, "diffusion"), stage_index=1)

    async def in_flight(sub: object, timeout: float) -> list[object]:
        await anyio.sleep(timeout)
        return []

    store.fanin._next_rows = in_flight  # type: ignore[method-assign,assignment]
    with anyio.fail_after(10):
        rows = [fields async for _, fields in store.follow("r-1", timeout=30)]
    assert [(f["state"], f["kind"]) for f in rows] == [("queued", "status"), ("running", "status"), ("done", "status")]


@pytest.mark.parametrize("upload_bytes", [16, LINK_MAX_UPLOAD_BYTES + 1], ids=["over-link", "through-redis-py"])
async def test_a_submission_whose_push_fails_leaves_no_queued_request(
    tmp_path: Path, prefix: str, upload_bytes: int
) -> None:
    """Issue 34: a MULTI does not roll back, so a failed XADD (now: the intake's RPUSH) left the "submitted"
    marker (the request said ``queued`` for 24 h, held by nothing) and the uploads.  As the client user of
    ``stageferry acl``, against a real failing push: the marker and the uploads are withdrawn with its own
    commands, the push's error is raised, and Redis refused nothing."""
    keys = Keys(prefix)
    with AclRedis(tmp_path, prefix) as server:
        admin = server.admin()
        admin.set(keys.intake("encoder"), b"not a list")  # the intake takes no push any more
        redis = connect(server.url("sfclient"))
        store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        link = open_link(redis)
        upload = keys.upload("phantom-1", "ref")
        try:
            with pytest.raises(ControlPlaneError, match="WRONGTYPE"):
                await store.submit(
                    "phantom-1", JOB, "encoder", stream_maxlen=10, uploads={upload: b"x" * upload_bytes}, link=link
                )
            assert not await store.known("phantom-1"), "no queued request left behind"
            assert admin.exists(keys.submitted("phantom-1"), upload) == 0
            assert server.refusals() == []
            admin.delete(keys.intake("encoder"))  # the intake fixed: the same id goes in as new
            assert await store.submit("phantom-1", JOB, "encoder", stream_maxlen=10, link=link) is not None
            assert await store.known("phantom-1")
        finally:
            if link is not None:
                await link.aclose()
            await redis.aclose()
            admin.close()
