"""Client against a real Redis: submit once, validation, uploads, cancel, waiting, traces, sync facade."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from stageferry import Client, JobRequest, RequestState, RequestStatus, SyncClient
from stageferry.config import Limits, PipelineConfig
from stageferry.errors import DeadlineExceededError, JobValidationError, RequestIdTakenError, StatusCorruptError
from stageferry.schemas import OutputInfo

pytestmark = pytest.mark.anyio

JOB = {"task": "t2va", "prompt": "a boat", "width": 320, "height": 192}


@pytest.fixture
async def client(redis_url: str, prefix: str) -> AsyncIterator[Client]:
    async with Client(redis_url, prefix=prefix) as c:
        yield c


async def stream_entries(client: Client) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The submissions queued on the first stage's intake, as (ticket, fields) in a stream entry's shape."""
    out = []
    for item in await client.redis.lrange(client.keys.intake("encoder"), 0, -1):  # type: ignore[misc]
        sub = json.loads(item)
        assert list(sub)[:2] == ["v", "ticket"] and sub["v"] == 1 and re.fullmatch(r"[0-9a-f]{32}", sub["ticket"])
        out.append(
            (
                sub["ticket"].encode(),
                {b"request_id": sub["request_id"].encode(), b"job": json.dumps(sub["job"]).encode()},
            )
        )
    return out


async def test_submit_twice_enqueues_once(client: Client) -> None:
    first = await client.submit(JOB, request_id="dup-1")
    second = await client.submit(JobRequest.model_validate(JOB), request_id="dup-1")
    assert first == second == "dup-1"
    entries = await stream_entries(client)
    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"request_id"] == b"dup-1"
    assert json.loads(fields[b"job"])["prompt"] == "a boat"
    status = await client.status("dup-1")
    assert status is not None and status.state is RequestState.QUEUED and status.stage == "encoder"


async def test_a_taken_id_with_a_different_job_is_a_conflict(client: Client) -> None:
    """The second submitter learns that the id is taken; it never gets (or changes) the first job's request."""
    await client.submit(JOB, request_id="taken-1")
    await client.store.admit("taken-1", JobRequest.model_validate(JOB).digest())  # as the first stage does
    with pytest.raises(RequestIdTakenError) as info:
        await client.submit({**JOB, "prompt": "a different boat"}, request_id="taken-1", uploads={})
    assert info.value.code == "request_id_taken"
    assert len(await stream_entries(client)) == 1
    assert await client.submit(JOB, request_id="taken-1") == "taken-1"  # the same job: idempotent


async def test_the_deployment_budget_is_checked_before_anything_is_enqueued(redis_url: str, prefix: str) -> None:
    pipeline = PipelineConfig(limits=Limits(max_pixel_frames=320 * 192 * 8))
    async with Client(redis_url, prefix=prefix, pipeline=pipeline) as small:
        with pytest.raises(JobValidationError) as info:
            await small.submit({**JOB, "num_frames": 9}, request_id="big-1")
        [error] = info.value.field_errors
        assert error["type"] == "over_budget" and "max_pixel_frames = 491520" in error["message"]
        with pytest.raises(JobValidationError) as info:
            media = {"first_frame": {"path": "/etc/passwd"}, "last_frame": {"path": "/etc/passwd"}}
            await small.submit({**JOB, "task": "fl2va", "num_frames": 8, "media": media}, request_id="path-1")
        assert {e["field"] for e in info.value.field_errors} == {"media.first_frame.path", "media.last_frame.path"}
        assert await stream_entries(small) == []
        assert await small.status("big-1") is None


async def test_default_request_id(client: Client) -> None:
    rid = await client.submit(JOB)
    assert re.fullmatch(r"video_sync-[0-9a-f]{16}", rid)


async def test_invalid_dict_names_the_field_and_enqueues_nothing(client: Client) -> None:
    with pytest.raises(JobValidationError) as info:
        await client.submit({**JOB, "num_inference_steps": 0, "colour": "red"}, request_id="bad-1")
    fields = {e["field"]: e for e in info.value.field_errors}
    assert fields["num_inference_steps"]["type"] == "greater_than_equal"
    assert fields["colour"]["type"] == "extra_forbidden"
    assert all(set(e) == {"field", "message", "type"} for e in info.value.field_errors)
    assert info.value.code == "invalid_job"
    assert await stream_entries(client) == []
    assert await client.status("bad-1") is None


async def test_invalid_request_id(client: Client) -> None:
    with pytest.raises(JobValidationError) as info:
        await client.submit(JOB, request_id="no spaces allowed")
    assert info.value.field_errors[0]["field"] == "request_id"


async def test_uploads_land_under_upload_keys_with_ttl(client: Client, tmp_path: Path) -> None:
    last = tmp_path / "last.png"
    last.write_bytes(b"\x89PNG last")
    job = {**JOB, "task": "fl2va"}
    rid = await client.submit(
        job, request_id="up-1", uploads={"first_frame": b"\x89PNG first", "last_frame": last}, upload_ttl_s=120
    )
    ticket, fields = (await stream_entries(client))[0]
    media = json.loads(fields[b"job"])["media"]
    for name, body in (("first_frame", b"\x89PNG first"), ("last_frame", b"\x89PNG last")):
        # under the request's id and the submission's ticket: nobody else can name (and overwrite) them
        key = client.keys.upload(rid, f"{name}.{ticket.decode()}")
        assert media[name] == {"path": None, "upload_key": key}
        assert await client.redis.get(key) == body
        assert 0 < await client.redis.ttl(key) <= 120


async def test_upload_to_unknown_media_is_rejected(client: Client) -> None:
    with pytest.raises(JobValidationError) as info:
        await client.submit({**JOB, "task": "fl2va"}, uploads={"poster": b"x"})
    assert info.value.field_errors[0]["field"] == "media.poster"
    assert await stream_entries(client) == []


async def test_cancel_sets_the_flag(client: Client) -> None:
    rid = await client.submit(JOB)
    assert await client.cancel(rid) is True
    assert await client.redis.exists(client.keys.cancel(rid)) == 1
    assert await client.cancel("never-submitted") is False
    await client.store.set_status(RequestStatus(request_id=rid, state=RequestState.CANCELLED))
    assert await client.cancel(rid) is False


async def test_wait_returns_when_another_task_finishes_the_request(client: Client, redis_url: str) -> None:
    rid = await client.submit(JOB)

    async def finish() -> None:
        with anyio.fail_after(30):
            while client.store.fanin.waiters < 1:  # the wait is under way
                await anyio.sleep(0.01)
        async with Client(redis_url, prefix=client.keys.prefix) as other:
            done = RequestStatus(
                request_id=rid, state=RequestState.DONE, result=OutputInfo(location="redis:x", bytes=3)
            )
            assert await other.store.set_status(done)

    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        status = await client.wait(rid, timeout=10)
    assert status.state is RequestState.DONE
    assert status.result is not None and status.result.bytes == 3


async def test_wait_times_out(client: Client) -> None:
    rid = await client.submit(JOB)
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        await client.wait(rid, timeout=0.3)
    assert time.monotonic() - started < 2


async def test_watch_yields_events_until_terminal(client: Client) -> None:
    rid = await client.submit(JOB)
    await client.store.append_event(rid, {"event": "payload.put", "transport": "inline", "bytes": 10})
    await client.store.set_status(RequestStatus(request_id=rid, state=RequestState.FAILED))
    names = [ev.event async for ev in client.watch(rid, timeout=5)]
    assert names == ["payload.put", "status.failed"]  # "queued" is written by the first stage


async def test_trace_and_result_bytes(client: Client) -> None:
    rid = await client.submit(JOB)
    await client.redis.set(client.keys.result(rid), b"mp4-bytes")
    assert await client.result_bytes(rid) == b"mp4-bytes"
    assert await client.result_bytes("missing") is None
    assert await client.trace(rid) == []  # until the first stage takes it: clients write no records
    await client.store.set_status(RequestStatus(request_id=rid, state=RequestState.QUEUED, stage="encoder"))
    events = await client.trace(rid)
    assert [ev.event for ev in events] == ["status.queued"]
    assert events[0].stage == "encoder"


def test_sync_client(redis_url: str, prefix: str) -> None:
    with SyncClient(redis_url, prefix=prefix) as client:
        rid = client.submit(JOB, request_id="sync-1")
        status = client.status(rid)
        assert status is not None and status.state is RequestState.QUEUED
        assert client.cancel(rid) is True
        assert client.trace(rid) == []  # no stage has taken it yet
        with pytest.raises(DeadlineExceededError):
            client.wait(rid, timeout=0.1)


async def test_a_record_that_names_another_request_is_corrupt_not_that_request(client: Client) -> None:
    """A record is data in Redis: one forged under ``forged-1`` naming ``victim-1`` (or junk) is refused
    as :class:`StatusCorruptError`, never answered as the victim's status; a forged terminal event in
    ``forged-1``'s trace naming the victim does not end ``forged-1``'s wait as the victim's either."""
    victim = RequestStatus(request_id="victim-1", state=RequestState.DONE, result=OutputInfo(location="redis:v"))
    await client.store.set_status(victim)
    await client.redis.hset(
        client.keys.request("forged-1"), mapping={"state": "done", "status": victim.model_dump_json()}
    )
    await client.redis.hset(client.keys.request("junk-1"), mapping={"state": "running", "status": "{not json"})
    for rid in ("forged-1", "junk-1"):
        with pytest.raises(StatusCorruptError) as info:
            await client.status(rid)
        assert info.value.code == "status_corrupt" and rid in info.value.message
    assert (await client.status("victim-1")) == victim

    forged_event = {"kind": "status", "state": "done", "status": victim.model_dump_json()}
    await client.redis.xadd(client.keys.events("forged-1"), forged_event)  # type: ignore[arg-type]
    with pytest.raises(StatusCorruptError):  # the event is not taken at its word: the record is read, and judged
        await client.wait("forged-1", timeout=10)
