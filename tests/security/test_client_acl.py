"""Least privilege for clients, and tenants, with real ACL users (``stageferry.acl``) on a private
``redis-server`` and real stage processes.

A tenant's user completes jobs through the Python client with exactly its rights (Redis never refuses a
command of the normal flow), and everything else is refused by Redis itself: writing statuses, results
or events, ``EXPIRE``/``DEL``, scripts, reading queued prompts, another tenant's keys and intake.  What
the ACL cannot see — a tenant naming another tenant's id on its own intake — the first stage refuses,
without writing anything under that id, and the submitter learns it from the refusal record."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from stageferry.acl import acl_file
from stageferry.broker.control.keys import Keys
from stageferry.client import SyncClient
from stageferry.config import PipelineConfig
from stageferry.errors import JobValidationError, TenantMismatchError
from stageferry.schemas import RequestState
from tests.procs import ROOT, Services, wait_for, write_pipeline
from tests.security.servers import PrivateRedis

pytestmark = pytest.mark.timeout(300)

PREFIX = "sft"
STAGES = [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}]
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}
PASSWORDS = {
    "stageferry": ">stage-pw",
    "sfclient": ">client-pw",
    "sfclient-acme": ">acme-pw",
    "sfclient-globex": ">globex-pw",
}
KEYS = Keys(PREFIX)
SAMPLES = ROOT / "stageferry" / "samples"


def url(port: int, user: str) -> str:
    return f"redis://{user}:{PASSWORDS[user][1:]}@127.0.0.1:{port}/0"


def start_server(tmp_path: Path, tenants: list[str]) -> PrivateRedis:
    config = tmp_path / "acl.conf"
    config.write_text(
        acl_file(PREFIX, "encoder", tenants=tenants, passwords=PASSWORDS) + "user admin on >admin-pw ~* &* +@all\n"
    )
    work = tmp_path / "redis"
    work.mkdir()
    server = PrivateRedis(work, config=config)
    return server.start(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[tuple[PrivateRedis, Services]]:
    """A private Redis with the tenants' ACL users, and both stages running as the services' user."""
    with start_server(tmp_path, ["acme", "globex"]) as server:
        pipeline = write_pipeline(
            tmp_path / "pipeline.toml",
            STAGES,
            data_plane={"connector": "inline"},
            security={"tenants": ["acme", "globex"]},
        )
        with Services(
            tmp_path, redis_url=url(server.port, "stageferry"), prefix=PREFIX, pipeline=pipeline, extra_env={}
        ) as svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            yield server, svc


def admin_of(server: PrivateRedis) -> sync_redis.Redis:
    return sync_redis.Redis.from_url(f"redis://admin:admin-pw@127.0.0.1:{server.port}/0")


def refused(action: Callable[[], Any]) -> bool:
    try:
        action()
    except sync_redis.exceptions.NoPermissionError:
        return True
    return False


def tenant_client(server: PrivateRedis, svc: Services, tenant: str) -> SyncClient:
    return SyncClient(
        url(server.port, f"sfclient-{tenant}"),
        prefix=PREFIX,
        pipeline=PipelineConfig.load(svc.pipeline),
        tenant=tenant,
    )


def test_tenants_complete_jobs_and_reach_only_their_own(tenants: tuple[PrivateRedis, Services]) -> None:
    server, svc = tenants
    admin = admin_of(server)
    with tenant_client(server, svc, "acme") as acme, tenant_client(server, svc, "globex") as globex:
        mine = acme.submit(JOB)
        theirs = globex.submit({**JOB, "prompt": "globex's secret prompt"})
        assert mine.startswith("acme.") and theirs.startswith("globex.")
        assert acme.wait(mine, timeout=120).state is RequestState.DONE, svc.logs()
        assert globex.wait(theirs, timeout=120).state is RequestState.DONE, svc.logs()
        assert acme.result_bytes(mine) and any(e.stage == "diffusion" for e in acme.trace(mine))
        cancelled = acme.submit({**JOB, "prompt": "sleep:30"})
        assert acme.cancel(cancelled)
        assert acme.wait(cancelled, timeout=120).state is RequestState.CANCELLED
        with pytest.raises(JobValidationError):  # the client refuses another tenant's id before Redis does
            acme.submit(JOB, request_id="globex.mine-now")
        assert admin.acl_log() == [], admin.acl_log()  # the normal flow never needed more than the user has

        raw = sync_redis.Redis.from_url(url(server.port, "sfclient-acme"))
        shared, intake, other_intake = (
            KEYS.stage_stream("encoder"),
            KEYS.intake("encoder", "acme"),
            KEYS.intake("encoder", "globex"),
        )
        attacks: dict[str, Callable[[], Any]] = {
            "forge own status": lambda: raw.hset(KEYS.request(mine), "state", "done"),
            "forge own result": lambda: raw.set(KEYS.result(mine), b"not a video"),
            "forge own events": lambda: raw.xadd(KEYS.events(mine), {"kind": "status", "state": "done"}),
            "expire own record": lambda: raw.expire(KEYS.request(mine), 0),
            "delete own result": lambda: raw.delete(KEYS.result(mine)),
            "run a script": lambda: raw.eval("return 1", 0),
            "load a script": lambda: raw.script_load("return 1"),
            "call a function": lambda: raw.fcall("f", 0),
            "read queued prompts (shared)": lambda: raw.xrange(shared),
            "read queued prompts (own intake)": lambda: raw.lrange(intake, 0, -1),
            "pop from own intake": lambda: raw.lpop(intake),
            "trim own intake": lambda: raw.ltrim(intake, 0, 0),
            "delete own intake": lambda: raw.delete(intake),
            "XADD to own intake": lambda: raw.xadd(intake, {"request_id": "acme.x", "job": "{}"}),
            "XADD the last id to the stage stream": lambda: raw.xadd(
                shared, {"request_id": "acme.x"}, id="18446744073709551615-18446744073709551615"
            ),
            "XADD with MAXLEN 0": lambda: raw.xadd(shared, {"request_id": "acme.x"}, maxlen=0),
            "push the wake list": lambda: raw.lpush(KEYS.wake("encoder"), b"x" * 1024),
            "select another database": lambda: raw.execute_command("SELECT", 1),
            "read the dead-letter stream": lambda: raw.xrange(KEYS.dead_letter("encoder")),
            "clobber the intake with SET": lambda: raw.set(intake, "x"),
            "LPUSH on a cancel flag": lambda: raw.lpush(KEYS.cancel(mine), "x"),
            "read another tenant's status": lambda: raw.hget(KEYS.request(theirs), "status"),
            "read another tenant's events": lambda: raw.xrange(KEYS.events(theirs)),
            "read another tenant's result": lambda: raw.get(KEYS.result(theirs)),
            "cancel another tenant's request": lambda: raw.set(KEYS.cancel(theirs), "1"),
            "upload for another tenant": lambda: raw.set(KEYS.upload(theirs, "first_frame"), b"x"),
            "submit on another tenant's intake": lambda: raw.rpush(other_intake, submission("globex.x", JOB)),
            "submit on the shared stream": lambda: raw.xadd(shared, {"request_id": "acme.x", "job": "{}"}),
            "write a later stage's stream": lambda: raw.xadd(KEYS.stage_stream("diffusion"), {"request_id": "a"}),
            "list keys": lambda: raw.keys("*"),
            "scan keys": lambda: raw.scan(0),
            "read an agent record": lambda: raw.hgetall(KEYS.agent("encoder-a")),
            "flush everything": lambda: raw.flushall(),
        }
        allowed = [name for name, attack in attacks.items() if not refused(attack)]
        assert allowed == [], allowed
        assert json.loads(admin.hget(KEYS.request(theirs), "status"))["state"] == "done"  # untouched
        raw.close()
    admin.close()


def submission(rid: str, job: dict[str, Any], ticket: str | None = None, **extra: Any) -> str:
    """An intake item as a raw client writes it (docs/protocol.md): the ticket first."""
    return json.dumps({"v": 1, "ticket": ticket or uuid.uuid4().hex, "request_id": rid, "job": job, **extra})


def test_a_tenant_cannot_submit_for_another_tenant(tenants: tuple[PrivateRedis, Services]) -> None:
    """On its own intake a tenant can push anything; the first stage refuses what is not its own, writes
    nothing under the named id, and the submitter (only) can read why, under its ticket."""
    server, svc = tenants
    admin = admin_of(server)
    acme = sync_redis.Redis.from_url(url(server.port, "sfclient-acme"))
    globex = sync_redis.Redis.from_url(url(server.port, "sfclient-globex"))
    intake = KEYS.intake("encoder", "acme")
    forged_envelope = {"from_stage": "encoder", "attempt": 7, "deadline": 1e12}
    cases = {
        "globex.stolen": (submission("globex.stolen", JOB), "tenant_mismatch"),
        "untenanted-id": (submission("untenanted-id", JOB), "tenant_mismatch"),
        "acme.forged-envelope": (
            submission("acme.forged-envelope", JOB, envelope=forged_envelope),
            "submission_refused",
        ),
        "acme.bad:id": (submission("acme.bad:id", JOB), "invalid_request_id"),
    }
    tickets = {rid: json.loads(item)["ticket"] for rid, (item, _code) in cases.items()}
    for item, _code in cases.values():
        acme.rpush(intake, item)
    for rid, (_item, code) in cases.items():
        refusal = wait_for(lambda t=tickets[rid]: acme.hgetall(KEYS.refused(t, "acme")), 60, f"refusal of {rid}")
        assert refusal[b"code"].decode() == code, (rid, refusal)
        assert refusal[b"request_id"].decode() == rid
        assert refused(functools.partial(globex.hgetall, KEYS.refused(tickets[rid], "acme")))  # not globex's to read
    for rid in cases:
        assert not admin.exists(KEYS.request(rid), KEYS.events(rid)), rid  # nothing written under those ids
    dead = admin.xrange(KEYS.dead_letter("encoder"))
    assert {f[b"request_id"].decode() for _, f in dead} == set(cases)

    # A tenant's job may name only its own request's uploads: another tenant's media stay unread.
    globex.set(KEYS.upload("globex.private", "first_frame"), (SAMPLES / "first_frame.png").read_bytes(), ex=600)
    steal = {**JOB, "task": "fl2va"}
    steal["media"] = {
        "first_frame": {"upload_key": KEYS.upload("globex.private", "first_frame")},
        "last_frame": {"upload_key": KEYS.upload("globex.private", "first_frame")},
    }
    acme.rpush(intake, submission("acme.steal-media", steal))
    with SyncClient(
        url(server.port, "sfclient-acme"), prefix=PREFIX, pipeline=PipelineConfig.load(svc.pipeline), tenant="acme"
    ) as client:
        status = client.wait("acme.steal-media", timeout=120)
        assert status.state is RequestState.REJECTED and status.error is not None, status
        assert {e["type"] for e in status.error.details["field_errors"]} == {"bad_upload_key"}, status.error
        good = client.submit(JOB)
        assert client.wait(good, timeout=120).state is RequestState.DONE, svc.logs()
    assert all(p.poll() is None for p in svc.procs), "refusals never stop a stage"
    acme.close()
    globex.close()
    admin.close()


def test_single_tenant_raw_client_learns_of_a_refused_id(tmp_path: Path) -> None:
    """The single-tenant client user: a raw submission with an id that breaks the rule (or would alias
    another request's keys) is refused, and the raw client reads why under its submission's ticket."""
    with start_server(tmp_path, []) as server:
        pipeline = write_pipeline(tmp_path / "pipeline.toml", STAGES, data_plane={"connector": "inline"})
        with Services(
            tmp_path, redis_url=url(server.port, "stageferry"), prefix=PREFIX, pipeline=pipeline, extra_env={}
        ) as svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            with SyncClient(url(server.port, "sfclient"), prefix=PREFIX, pipeline=PipelineConfig.load(pipeline)) as c:
                victim = c.submit({**JOB, "prompt": "sleep:3"})
                raw = sync_redis.Redis.from_url(url(server.port, "sfclient"))
                bad = ["a b*c?[d]", "x" * 5000, f"{victim}:cancel", f"{victim}:events", "trailing\n"]
                tickets = {}
                for rid in bad:
                    tickets[rid] = uuid.uuid4().hex
                    raw.rpush(KEYS.intake("encoder"), submission(rid, JOB, tickets[rid]))
                for rid, ticket in tickets.items():
                    refusal = wait_for(lambda t=ticket: raw.hgetall(KEYS.refused(t)), 60, "refusal")
                    assert refusal[b"code"] == b"invalid_request_id", (rid, refusal)
                assert c.wait(victim, timeout=120).state is RequestState.DONE  # not cancelled, not broken
                assert c.result_bytes(victim)
                raw.close()
            assert all(p.poll() is None for p in svc.procs)


def test_wait_raises_the_refusal_of_its_own_entry(tenants: tuple[PrivateRedis, Services]) -> None:
    """A Python client whose submission is refused (here: an untenanted client in a tenant deployment,
    pushing to the untenanted intake as the services' user) gets the typed refusal from ``wait``, not a
    hang."""
    server, svc = tenants
    with SyncClient(url(server.port, "stageferry"), prefix=PREFIX, pipeline=PipelineConfig.load(svc.pipeline)) as c:
        rid = c.submit(JOB)
        with pytest.raises(TenantMismatchError):
            c.wait(rid, timeout=60)
