"""Untrusted input against real stage processes on a real Redis (issue 17): a cost budget per deployment,
no local paths from clients beyond the configured roots, request records written by their first valid
submission only, and a request that keeps killing its stage is dead-lettered instead of taking down
every replica.  Entries are XADDed raw, as a hostile client would, past every client-side check."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.intake import Intake
from stageferry.broker.control.redis_conn import open_client
from stageferry.cli import sample_media
from stageferry.client import SyncClient
from stageferry.errors import RequestIdTakenError, SubmissionRefusedError
from stageferry.schemas import Envelope, JobRequest, RequestState, RequestStatus, Task, request_key
from tests.broker.control.test_control_plane import assert_streams_empty
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(300)

STAGES = [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}]
BUDGET = 320 * 192 * 8  #: a small max_pixel_frames: 8 frames at 320 × 192
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_frames": 8, "num_inference_steps": 2}
PNG = sample_media(Task.FL2VA)["first_frame"].read_bytes()


@dataclass
class Deployment:
    svc: Services
    redis: sync_redis.Redis
    client: SyncClient
    root: Path

    def xadd(self, stage: str, fields: dict[str, Any]) -> str:
        rid = str(fields["request_id"])
        self.redis.xadd(self.svc.keys.stage_stream(stage), fields)
        return rid

    def wait(self, rid: str) -> RequestStatus:
        return self.client.wait(rid, timeout=60)

    def dead_letters(self, stage: str, rid: str) -> list[dict[bytes, bytes]]:
        rows = self.redis.xrange(self.svc.keys.dead_letter(stage))
        return [f for _, f in rows if f.get(b"request_id") == rid.encode()]

    def status_events(self, rid: str) -> list[str]:
        rows = self.redis.xrange(self.svc.keys.events(rid))
        return [f[b"state"].decode() for _, f in rows if f.get(b"kind") == b"status"]


def rid() -> str:
    return f"ut-{uuid.uuid4().hex[:10]}"


def pipeline(tmp_path: Path, root: Path, **limits: Any) -> Path:
    return write_pipeline(
        tmp_path / "pipeline.toml",
        STAGES,
        timeouts={"visibility": 2.0, "claim_renew_every": 0.5},
        limits={"max_pixel_frames": BUDGET, "media_roots": [str(root)], **limits},
        data_plane={"connector": "inline"},
    )


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("untrusted")
    root = tmp / "media"
    root.mkdir()
    url = os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    record = {"STAGEFERRY_TEST_RECORD": str(tmp / "record.txt")}
    redis = sync_redis.Redis.from_url(url)
    with Services(tmp, redis_url=url, prefix=prefix, pipeline=pipeline(tmp, root), extra_env=record) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        svc.wait_live("encoder", "encoder-a")
        svc.wait_live("diffusion", "diffusion-a")
        yield Deployment(svc, redis, svc.client(), root)
        assert all(p.poll() is None for p in svc.procs), svc.logs()
    for key in redis.scan_iter(match=f"{prefix}:*", count=1000):
        redis.delete(key)
    redis.close()


# -- item 1: the cost budget -----------------------------------------------------------------------------


def test_a_job_over_the_budget_is_rejected_quoting_the_deployments_limit(deployment: Deployment) -> None:
    dep = deployment
    status = dep.wait(dep.xadd("encoder", {"request_id": rid(), "job": json.dumps({**JOB, "num_frames": 9})}))
    assert status.state is RequestState.REJECTED and status.error is not None
    [error] = status.error.details["field_errors"]
    assert error["field"] == "num_frames" and error["type"] == "over_budget" and error["limit"] == BUDGET
    assert f"max_pixel_frames = {BUDGET}" in error["message"]
    # The job, within the schema's frame cap, sent raw: rejected on the budget, nothing allocated.
    huge = {**JOB, "width": 2048, "height": 2048, "fps": 60, "num_frames": None, "duration": 17.0}
    status = dep.wait(dep.xadd("encoder", {"request_id": rid(), "job": json.dumps(huge)}))
    assert status.state is RequestState.REJECTED and status.error is not None
    assert any(e["type"] == "over_budget" for e in status.error.details["field_errors"])


def test_every_stage_checks_the_budget_again(deployment: Deployment) -> None:
    """An envelope that skipped the first stage is refused by the stage that would allocate for it."""
    r = rid()
    job = JobRequest.model_validate({**JOB, "num_frames": 64})
    env = Envelope(request_id=r, key=request_key(r, 0), from_stage="encoder", to_stage="diffusion", job=job)
    status = deployment.wait(deployment.xadd("diffusion", {"request_id": r, "envelope": env.model_dump_json()}))
    assert status.state is RequestState.REJECTED and status.stage == "diffusion" and status.error is not None
    assert status.error.details["field_errors"][0]["limit"] == BUDGET


# -- item 2: no local paths from clients -----------------------------------------------------------------


def fl2va(first: str, last: str) -> str:
    return json.dumps({**JOB, "task": "fl2va", "media": {"first_frame": {"path": first}, "last_frame": {"path": last}}})


def test_local_paths_outside_the_roots_or_not_regular_files_are_refused(deployment: Deployment) -> None:
    dep = deployment
    good = dep.root / "frame.png"
    good.write_bytes(PNG)
    fifo = dep.root / "fifo"
    os.mkfifo(fifo)
    (dep.root / "shadow").symlink_to("/etc/shadow")
    hostile = [str(fifo), "/dev/zero", "/etc/passwd", "/proc/self/environ", str(dep.root / "shadow")]
    messages = set()
    for path in hostile:
        status = dep.wait(dep.xadd("encoder", {"request_id": rid(), "job": fl2va(path, str(good))}))
        assert status.state is RequestState.REJECTED and status.error is not None, (path, status)
        [error] = status.error.details["field_errors"]
        assert error["field"] == "media.first_frame.path" and error["type"] == "path_not_allowed", (path, error)
        assert path not in json.dumps(status.model_dump(mode="json"))
        messages.add(error["message"])
    assert len(messages) == 1, messages  # no hint of what each path was
    # The encoder is not stuck on the FIFO: a regular file under the root still works.
    assert dep.wait(dep.xadd("encoder", {"request_id": rid(), "job": fl2va(str(good), str(good))})).state is (
        RequestState.DONE
    )
    logs = dep.svc.logs()
    assert "root:x:0:0" not in logs and "PATH=" not in logs, "file content reached a log"


# -- item 3: a request record is written by its first valid submission only ------------------------------


def test_a_reused_id_never_changes_the_first_requests_outcome(deployment: Deployment) -> None:
    dep = deployment
    owner = dep.client.submit({**JOB, "prompt": "sleep:3 the owner"}, request_id=rid())
    wait_for(lambda: (s := dep.client.status(owner)) and s.state is RequestState.RUNNING, 30, "owner running")
    dep.xadd("encoder", {"request_id": owner, "job": "{"})  # broken
    dep.xadd("encoder", {"request_id": owner, "job": json.dumps({**JOB, "prompt": "someone else"})})  # different
    with pytest.raises(RequestIdTakenError):
        dep.client.submit({**JOB, "prompt": "someone else"}, request_id=owner)
    assert dep.client.submit({**JOB, "prompt": "sleep:3 the owner"}, request_id=owner) == owner  # idempotent
    wait_for(lambda: len(dep.dead_letters("encoder", owner)) == 2, 30, "both intruders dead-lettered")
    status = dep.wait(owner)
    assert status.state is RequestState.DONE, status
    assert "rejected" not in dep.status_events(owner)
    assert {f[b"error_code"] for f in dep.dead_letters("encoder", owner)} == {b"request_id_taken"}
    trace = dep.redis.xrange(dep.svc.keys.events(owner))
    assert not any(b"id_taken" in f.get(b"event", b"") for _, f in trace), "an intruder's log reached the trace"
    ran = (dep.svc.tmp_path / "record.txt").read_text().splitlines()
    assert ran.count(f"encoder {owner}") == 1 and ran.count(f"diffusion {owner}") == 1


def test_a_reused_id_after_the_end_changes_nothing(deployment: Deployment) -> None:
    dep = deployment
    owner = dep.client.submit(JOB, request_id=rid())
    assert dep.wait(owner).state is RequestState.DONE
    result = dep.client.result_bytes(owner)
    dep.xadd("diffusion", {"request_id": owner, "envelope": "not json"})
    dep.xadd("encoder", {"request_id": owner, "job": json.dumps({**JOB, "seed": 7})})
    wait_for(lambda: len(dep.dead_letters("encoder", owner)) == 1, 30, "encoder dead-lettered the intruder")
    wait_for(lambda: len(dep.dead_letters("diffusion", owner)) == 1, 30, "diffusion dead-lettered the intruder")
    status = dep.client.status(owner)
    assert status is not None and status.state is RequestState.DONE
    assert dep.client.result_bytes(owner) == result
    assert dep.status_events(owner).count("done") == 1 and "rejected" not in dep.status_events(owner)


# -- item 7: extra fields in an entry --------------------------------------------------------------------


def test_an_entry_with_undocumented_fields_is_refused(deployment: Deployment) -> None:
    fields = {"request_id": rid(), "job": json.dumps(JOB), "priority": "high"}
    status = deployment.wait(deployment.xadd("encoder", fields))
    assert status.state is RequestState.REJECTED and status.error is not None
    assert status.error.code == "invalid_envelope" and status.error.details["fields"] == ["priority"]
    assert_streams_empty(deployment.svc)


def test_entry_fields_that_do_not_belong_to_the_payload_kind_are_refused(deployment: Deployment) -> None:
    """Issue 37: a ``blob`` beside a payload that is not inline, a ``lease`` (here 5,000 characters) beside
    one that is not NIXL, or not its token, were accepted silently; each is ``invalid_envelope`` now."""
    cases = {"blob": b"\x00" * 64, "lease": "L" * 5000}
    for name, value in cases.items():
        r = rid()
        env = Envelope(request_id=r, key=request_key(r, 0), from_stage="encoder", to_stage="diffusion", job=JOB)
        fields = {"request_id": r, "envelope": env.model_dump_json(), name: value}
        status = deployment.wait(deployment.xadd("diffusion", fields))
        assert status.state is RequestState.REJECTED and status.error is not None, (name, status)
        assert status.error.code == "invalid_envelope" and f"a {name} field" in status.error.message, status.error
        assert len(status.error.message) < 300  # the 5,000 characters are not echoed
    assert_streams_empty(deployment.svc)


# -- item 1: a request that keeps killing its stage ------------------------------------------------------


@pytest.mark.slow
def test_a_request_that_kills_its_stage_twice_is_dead_lettered(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """The test model calls ``os._exit`` on a ``poison`` job (the stand-in for an OOM kill): the first two
    replicas die with it, the third finds two crash marks, dead-letters it and keeps serving."""
    root = tmp_path / "media"
    root.mkdir()
    path = pipeline(tmp_path, root, max_deliveries=20, max_crashes=2)
    with Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as svc:
        client = svc.client()
        poisoned = client.submit({**JOB, "prompt": "poison"})
        for n in range(4):
            proc = svc.start("encoder", f"r{n}")
            wait_for(
                lambda p=proc: p.poll() is not None or ((s := client.status(poisoned)) and s.state.terminal),
                90,
                "a replica death or a settled request",
            )
            status = client.status(poisoned)
            if status is not None and status.state.terminal:
                break
        status = client.wait(poisoned, timeout=30)
        assert status.state is RequestState.FAILED and status.error is not None, svc.logs()
        assert status.error.code == "stage_crashed" and status.error.details == {"crashes": 2, "limit": 2}
        assert [p.returncode for p in svc.procs[:-1]] == [17, 17], "exactly two replicas died with it"
        assert svc.procs[-1].poll() is None, "the replica that dead-lettered it is still serving"
        r = sync_redis.Redis.from_url(redis_url)
        [dead] = [f for _, f in r.xrange(svc.keys.dead_letter("encoder")) if f[b"request_id"] == poisoned.encode()]
        assert dead[b"error_code"] == b"stage_crashed" and b"died 2 times" in dead[b"reason"]
        assert not list(r.scan_iter(match=f"{prefix}:req-crash:{poisoned}:*")), "the crash mark is cleared"
        # the replica still serves: a good job runs through
        svc.start("diffusion", "a")
        assert client.wait(client.submit(JOB), timeout=60).state is RequestState.DONE
        assert_streams_empty(svc)


def test_a_submission_its_stage_keeps_dying_on_before_admission_is_refused_unopened(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    """A submission delivered past ``max_deliveries`` + 1 times never reached admission (where its limit + 1st
    delivery would have been dead-lettered with its status): each delivery's stage died opening it (a
    client's item built to cost a stage its memory).  It is refused on its delivery count before it is
    opened again: the client reads the refusal under its ticket, the entry is
    dead-lettered, nothing is written under its request id.  The deaths are stood in for by a dead
    consumer's reads, which raise the entry's delivery count as a reclaim after a death does."""
    root = tmp_path / "media"
    root.mkdir()
    path = pipeline(tmp_path, root, max_deliveries=2)
    with Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as svc:
        client = svc.client()
        rid = client.submit(JOB)  # into the intake list: no stage runs yet
        keys, stream = svc.keys, svc.keys.stage_stream("encoder")

        async def move() -> int:  # the first stage's own mover (one script), as its leader runs it
            async with open_client(redis_url) as redis:
                return (await Intake(redis, keys, "encoder", max_item_bytes=1 << 20).move(1)).total

        assert anyio.run(move) == 1
        r = sync_redis.Redis.from_url(redis_url)
        r.xgroup_create(stream, "encoder", id="0", mkstream=True)
        [[_, [(entry_id, fields)]]] = r.xreadgroup("encoder", "died-1", {stream: ">"}, count=1)
        assert b"submission" in fields
        for n in (2, 3, 4):  # admitted on its 3rd it would have been dead-lettered then, with its status
            r.xclaim(stream, "encoder", f"died-{n}", 0, [entry_id])
        svc.start("encoder", "a")  # reclaims it once it idles a visibility timeout: its 5th delivery
        with pytest.raises(SubmissionRefusedError) as refused:
            client.wait(rid, timeout=60)
        assert "delivered 5 times (limit 2), never admitted" in refused.value.message, refused.value.message
        [dead] = [f for _, f in r.xrange(keys.dead_letter("encoder"))]
        assert dead[b"error_code"] == b"submission_refused", dead
        assert not r.exists(keys.request(rid)), "nothing written under its id"
        assert "worker.internal_error" not in svc.logs()


# -- issue 34 item 16: a record whose status does not parse ---------------------------------------------


@pytest.mark.parametrize("stored", ["{not json", "victim"], ids=["junk", "names-another-request"])
def test_a_corrupt_status_dead_letters_the_entry(deployment: Deployment, stored: str) -> None:
    """A record whose status does not parse (or names another request: a stage user's HSET) is corrupt:
    the entry is dead-lettered (``status_corrupt``) and the request ends failed — it used to end
    ``stage_failed`` as an internal error, the entry merely acked."""
    dep, r = deployment, rid()
    if stored == "victim":
        stored = RequestStatus(request_id=rid(), state=RequestState.RUNNING, stage="encoder").model_dump_json()
    dep.redis.hset(dep.svc.keys.request(r), mapping={"state": "running", "status": stored})
    dep.xadd("encoder", {"request_id": r, "job": json.dumps(JOB)})
    [dead] = wait_for(lambda: dep.dead_letters("encoder", r), 60, "the dead letter")
    assert dead[b"error_code"] == b"status_corrupt", dead
    status = dep.client.status(r)
    assert status is not None and status.state is RequestState.FAILED and status.error is not None
    assert status.error.code == "status_corrupt"
    assert "worker.internal_error" not in dep.svc.logs()
