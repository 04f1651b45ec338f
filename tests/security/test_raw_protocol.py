"""The raw protocol (docs/protocol.md) as a hostile or unlucky raw client meets it: plain redis-py as the
shipped single-tenant client user (``stageferry acl``) on a private ``redis-server``, real stages.

* what used to stop or trim everyone's queue (a max-id ``XADD``, ``XADD ... MAXLEN 0``) is refused by
  Redis itself, and so is every other write of the stream, the wake list or another database;
* a submission reusing an id while the first job runs is refused under its own ticket
  (``request_id_taken``) and the documented ``job_sha`` recipe tells the raw client the finished record
  is not its job's; the first job's record and result are untouched;
* a submission too large to be moved, or one that is not a submission at all, is refused under its
  ticket without ever being copied whole into the stream; the stages go on."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from stageferry.acl import acl_file
from stageferry.broker.control.keys import Keys
from stageferry.schemas import JobRequest
from tests.procs import ROOT, Services, wait_for, write_pipeline
from tests.security.servers import PrivateRedis

pytestmark = pytest.mark.timeout(300)

PREFIX = "sfr"
KEYS = Keys(PREFIX)
STAGES = [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}]
JOB = {"task": "t2va", "prompt": "a paper boat in the rain", "width": 320, "height": 192, "num_inference_steps": 2}
PASSWORDS = {"stageferry": ">stage-pw", "sfclient": ">client-pw"}
TERMINAL = (b"done", b"failed", b"rejected", b"cancelled")


def url(port: int, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user][1:]}@127.0.0.1:{port}/0"


def item(rid: str, job: dict[str, Any], ticket: str) -> str:
    return json.dumps({"v": 1, "ticket": ticket, "request_id": rid, "job": job})


def documented_digest(job: dict[str, Any]) -> str:
    """The ``job_sha`` recipe exactly as docs/protocol.md gives it (plain json and hashlib)."""
    defaults = {
        "task": "t2va", "prompt": None, "negative_prompt": "", "width": 1344, "height": 768, "fps": 24,
        "duration": None, "num_frames": None, "num_inference_steps": 8, "seed": 0, "flow_shift": 5.0,
        "audio_flow_shift": 3.0, "guidance": 5.0, "lora": None,
        "media": {"first_frame": None, "last_frame": None, "reference_video": None, "reference_audio": None},
    }  # fmt: skip
    floats = {"duration", "flow_shift", "audio_flow_shift", "guidance"}
    full = {k: job.get(k, v) for k, v in defaults.items()}
    full = {k: float(v) if k in floats and v is not None else v for k, v in full.items()}
    return hashlib.sha256(json.dumps(full, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def test_the_documented_canonical_encoding_is_the_stages() -> None:
    """The recipe and the example JSON in docs/protocol.md agree with ``JobRequest.digest`` (a prompt
    with non-ASCII characters, integers given for floats, a guidance left out)."""
    for job in (JOB, {**JOB, "prompt": "ein Boot im Regen – 雨の中の紙の船", "flow_shift": 4, "seed": 7}):
        assert documented_digest(job) == JobRequest.model_validate(job).digest()
    doc = (ROOT / "docs" / "protocol.md").read_text()
    line = re.search(r"^(\{\"task\":\"t2va\",\"prompt\":\"a paper boat in the rain\".*)$", doc, re.M)
    assert line is not None, "docs/protocol.md has the example job"
    example = json.loads(line[1])
    assert json.dumps(example, separators=(",", ":")) == JobRequest.model_validate(example).model_dump_json()


@pytest.fixture
def deployment(tmp_path: Path) -> Any:
    config = tmp_path / "acl.conf"
    config.write_text(acl_file(PREFIX, "encoder", passwords=PASSWORDS) + "user admin on >admin-pw ~* &* +@all\n")
    work = tmp_path / "redis"
    work.mkdir()
    server = PrivateRedis(work, config=config)
    server.start(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")
    pipeline = write_pipeline(
        tmp_path / "pipeline.toml", STAGES, data_plane={"connector": "inline"}, limits={"max_entry_bytes": 1 << 20}
    )
    with (
        server,
        Services(
            tmp_path, redis_url=url(server.port, "stageferry"), prefix=PREFIX, pipeline=pipeline, extra_env={}
        ) as svc,
    ):
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        yield server, svc


def refused(action: Any) -> bool:
    try:
        action()
    except sync_redis.exceptions.NoPermissionError:
        return True
    return False


def wait_terminal(raw: sync_redis.Redis, rid: str) -> bytes:
    return wait_for(lambda: (s := raw.hget(KEYS.request(rid), "state")) in TERMINAL and s, 120, f"{rid} terminal")


def test_a_raw_client_cannot_stop_or_trim_the_queue_and_sees_its_refusals(deployment: Any) -> None:
    server, svc = deployment
    raw = sync_redis.Redis.from_url(url(server.port, "sfclient"))
    admin = sync_redis.Redis.from_url(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")
    stream, intake = KEYS.stage_stream("encoder"), KEYS.intake("encoder")
    attacks = {
        "XADD the last possible id": lambda: raw.xadd(
            stream, {"request_id": "x"}, id="18446744073709551615-18446744073709551615"
        ),
        "XADD with MAXLEN 0": lambda: raw.xadd(stream, {"request_id": "x"}, maxlen=0),
        "XTRIM the stream": lambda: raw.xtrim(stream, maxlen=0),
        "XADD a stage-style envelope": lambda: raw.xadd(
            stream, {"request_id": "x", "envelope": json.dumps({"from_stage": "encoder", "attempt": 7})}
        ),
        "pop the intake": lambda: raw.lpop(intake),
        "trim the intake": lambda: raw.ltrim(intake, 0, 0),
        "read the intake": lambda: raw.lrange(intake, 0, -1),
        "push the wake list (popped whole)": lambda: raw.lpush(KEYS.wake("encoder"), b"x" * 4096),
        "SELECT another database": lambda: raw.execute_command("SELECT", 1),
        "run a Redis Function": lambda: raw.fcall("anything", 1, stream),
    }
    assert [name for name, attack in attacks.items() if not refused(attack)] == []
    # What the ACL lets through but cannot bound: a 1 MiB cancel flag and a marker, both without a TTL.
    raw.set(KEYS.cancel("hog"), b"x" * (1 << 20))
    raw.set(KEYS.submitted("ageless"), b"encoder")

    # The first job runs (sleep:4 holds it in the encoder); a second, different job reuses its id.
    first_ticket, second_ticket = uuid.uuid4().hex, uuid.uuid4().hex
    first_job, second_job = {**JOB, "prompt": "sleep:4 the first job"}, {**JOB, "prompt": "someone else's"}
    raw.rpush(intake, item("shared-id", first_job, first_ticket))
    wait_for(lambda: raw.hget(KEYS.request("shared-id"), "state") == b"running", 60, "the first job running")
    raw.rpush(intake, item("shared-id", second_job, second_ticket))
    refusal = wait_for(lambda: raw.hgetall(KEYS.refused(second_ticket)), 60, "the second submission's refusal")
    assert refusal[b"code"] == b"request_id_taken" and refusal[b"request_id"] == b"shared-id", refusal
    assert refusal[b"ticket"] == second_ticket.encode() and refusal[b"version"] == b"2"
    assert wait_terminal(raw, "shared-id") == b"done", svc.logs()
    sha = raw.hget(KEYS.request("shared-id"), "job_sha")
    assert sha == documented_digest(first_job).encode()  # the first submitter proves it is its job
    assert sha != documented_digest(second_job).encode()  # the second learns it is not
    assert raw.hgetall(KEYS.refused(first_ticket)) == {}
    assert raw.get(KEYS.result("shared-id"))

    # Items that are not submissions, or too large to move (max_submission_bytes = 1 MiB): refused by ticket.
    big, junk, extra, deep = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
    raw.rpush(intake, item("big-1", {**JOB, "negative_prompt": "x" * 8192, "pad": "y" * (2 << 20)}, big))
    raw.rpush(intake, f'{{"v":1,"ticket":"{junk}", not json')
    raw.rpush(intake, item("extra-1", JOB, extra)[:-1] + ',"attempt":7,"deadline":1e12}')
    # nested past the interpreter's recursion limit (json.loads raised RecursionError: the worker died on it)
    raw.rpush(intake, f'{{"v":1,"ticket":"{deep}","request_id":"deep-1","job":' + "[" * 5000 + "]" * 5000 + "}")
    for ticket in (big, junk, extra, deep):
        refusal = wait_for(lambda t=ticket: raw.hgetall(KEYS.refused(t)), 60, "refusal")
        assert refusal[b"code"] == b"submission_refused", refusal
    assert b"above limits.max_submission_bytes = 1048576" in raw.hgetall(KEYS.refused(big))[b"message"]
    dead = admin.xrange(KEYS.dead_letter("encoder"))
    assert all(len(b"".join(f.values())) < (1 << 20) for _, f in dead)  # the big item never went in whole
    assert not admin.exists(
        KEYS.request("extra-1"), KEYS.request("big-1"), KEYS.request("deep-1")
    )  # none under their ids

    # And the queue still works for everyone.
    ok = uuid.uuid4().hex
    raw.rpush(intake, item("after-1", JOB, ok))
    assert wait_terminal(raw, "after-1") == b"done"
    # The first stage's sweep bounded them (clients' keys: size and TTL; it runs as the services' user).
    wait_for(lambda: not admin.exists(KEYS.cancel("hog")), 90, "the oversized cancel flag deleted")
    wait_for(lambda: 0 < admin.ttl(KEYS.submitted("ageless")) <= 86_400, 90, "the marker given a TTL")
    # The stages were never refused (their dead letters included: issue 34 item 2).
    stage_refusals = [e for e in admin.acl_log() if e["username"] != "sfclient"]
    assert stage_refusals == [], stage_refusals
    assert all(p.poll() is None for p in svc.procs)
    raw.close()
    admin.close()


def test_the_generated_config_caps_memory_without_eviction(tmp_path: Path) -> None:
    """``stageferry acl``'s memory lines on a real redis-server: a client's write past ``maxmemory`` is
    refused (OOM), and nothing already stored is evicted to make room."""
    config = tmp_path / "redis.conf"
    text = acl_file(PREFIX, "encoder", passwords=PASSWORDS, maxmemory=16 << 20)
    assert text.startswith("maxmemory 16777216\nmaxmemory-policy noeviction\n")
    config.write_text(text + "user admin on >admin-pw ~* &* +@all\n")
    work = tmp_path / "redis"
    work.mkdir()
    with PrivateRedis(work, config=config) as server:
        server.start(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")
        admin = sync_redis.Redis.from_url(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")
        raw = sync_redis.Redis.from_url(url(server.port, "sfclient"))
        assert admin.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        raw.rpush(KEYS.intake("encoder"), item("kept-1", JOB, uuid.uuid4().hex))
        raw.set(KEYS.upload("hog-0", "first_frame"), b"x" * (4 << 20))
        with pytest.raises(sync_redis.exceptions.OutOfMemoryError):
            for i in range(1, 16):
                raw.set(KEYS.upload(f"hog-{i}", "first_frame"), b"x" * (4 << 20))
        assert admin.strlen(KEYS.upload("hog-0", "first_frame")) == 4 << 20  # nothing evicted
        assert admin.llen(KEYS.intake("encoder")) == 1  # the queued submission stayed
        raw.close()
        admin.close()


def test_the_shipped_config_caps_memory() -> None:
    shipped = (ROOT / "compose" / "redis-acl.conf").read_text()
    assert "\nmaxmemory 2684354560\nmaxmemory-policy noeviction\n" in shipped
    assert "${REDIS_MAXMEMORY:-2560mb}" in (ROOT / "compose" / "docker-compose.yml").read_text()
