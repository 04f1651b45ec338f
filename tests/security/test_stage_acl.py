"""The stage ACL user may run everything a stage runs (issue 34: the dead-letter script called TIME and
XTRIM, which it was not granted, so every dead letter failed in a real deployment).

* Statically: every command a Lua script in the package calls (``redis.call``/``redis.pcall`` with a
  literal name, and no other kind of call) is in :data:`stageferry.acl.STAGE_COMMANDS`.
* Live: each script path of ``broker/control`` — the stream's read (own, reclaimed, new), renew, hand-off
  (plain and with its status), finish, ack and dead letter; the request store's admission and (owned)
  status writes; the entry guard's admissions and crash marks; the lost-request end; refusals and the
  heartbeat — runs as the ``stageferry`` user of ``stageferry acl`` on a private redis-server loaded with
  that ACL, and Redis refuses nothing (``ACL LOG`` stays empty).
"""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

from stageferry.acl import STAGE_COMMANDS, acl_file, redis_db
from stageferry.broker.control.client_keys import ClientKeySweeper, client_key_bounds
from stageferry.broker.control.entry_records import crash_field
from stageferry.broker.control.intake import Intake
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import Heartbeat
from stageferry.broker.control.record_loss import Loss, RecordLoss
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.refusals import Refusals
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.config import Limits
from stageferry.errors import InvalidRequestIdError, RequestLostError
from stageferry.schemas import Envelope, JobRequest, RequestState, RequestStatus
from stageferry.stages.entry.entry_guard import EntryGuard
from tests.procs import ROOT
from tests.security.servers import AclRedis

CALL = re.compile(r"redis\.p?call\(")
LITERAL = re.compile(r"redis\.p?call\(\s*'([A-Za-z]+)'(?:\s*,\s*'([A-Za-z]+)')?")
#: Commands whose ACL name carries the subcommand (``xgroup|create``).
WITH_SUBCOMMAND = {"xgroup", "xinfo", "script", "client", "config", "object"}


def lua_commands() -> dict[str, list[str]]:
    """ACL name → files, for every ``redis.call``/``redis.pcall`` in the package's sources."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "stageferry").rglob("*.py")):
        text = path.read_text()
        calls, literal = len(CALL.findall(text)), list(LITERAL.finditer(text))
        assert calls == len(literal), f"{path}: a redis.call whose command is not a literal name"
        for match in literal:
            name, sub = match.group(1).lower(), (match.group(2) or "").lower()
            acl_name = f"{name}|{sub}" if name in WITH_SUBCOMMAND else name
            found.setdefault(acl_name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_command_a_script_calls_is_granted_to_the_stage_user() -> None:
    commands = lua_commands()
    assert {"xadd", "xpending", "xtrim"} <= set(commands)  # the scan sees the scripts
    assert "time" not in commands, "scripts take the server's clock from an XADD id (the user has no TIME)"
    missing = {name: files for name, files in commands.items() if name not in STAGE_COMMANDS}
    assert not missing, f"not granted to the stage ACL user: {missing}"


@pytest.mark.anyio
async def test_every_control_plane_script_runs_as_the_stage_user(tmp_path: Path, prefix: str) -> None:
    keys = Keys(prefix)
    with AclRedis(tmp_path, prefix) as server:
        async with open_client(server.url("stageferry")) as redis:
            stream = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=1)
            other = StageStream(redis, keys, "encoder", "encoder-b", visibility_ms=1)
            store = RequestStore(redis, keys, ttl_s=60, events_maxlen=100)
            guard = EntryGuard(
                redis=redis, keys=keys, store=store, stage="encoder", limits=Limits(), ttl_s=60,
                link=stream.script_link, holder=stream.held,
            )  # fmt: skip
            await stream.ensure_group()
            job = JobRequest(prompt="a cat")

            async def entry_for(rid: str) -> Entry:
                await redis.xadd(keys.stage_stream("encoder"), {"request_id": rid, "job": job.model_dump_json()})
                [got] = await stream.read(1, block_ms=500, new_only=True)
                return got

            def envelope(rid: str) -> Envelope:
                return Envelope(request_id=rid, key=f"{rid}_0", from_stage="client", to_stage="encoder", job=job)

            first = await entry_for("r-1")
            status = RequestStatus(request_id="r-1", state=RequestState.QUEUED, stage="encoder")
            assert (await guard.admit_and_look(envelope("r-1"), first))[0] is True
            async with guard.crash_mark(first, "r-1", marked=True):
                assert await store.set_status(status, held=stream.held(first))
                assert await stream.renew(first.id)
                write = store.status_write(status.model_copy(update={"stage": "diffusion"}), stage_index=1)
                assert await stream.hand_off(
                    first.id, "diffusion", {"request_id": "r-1", "envelope": "{}"}, status=write,
                    crash_field=crash_field("encoder", first.id),
                )  # fmt: skip

            second = await entry_for("r-2")
            redelivered = Entry(second.id, second.fields, deliveries=2, stream=second.stream)
            assert await guard.admit(envelope("r-2"), redelivered) is False
            async with guard.crash_mark(redelivered, "r-2"):
                pass
            done = store.status_write(RequestStatus(request_id="r-2", state=RequestState.DONE, stage="encoder"))
            mark = crash_field("encoder", second.id)
            assert await stream.finish(
                second.id, status=done, cancel=keys.cancel("r-2"), crash_field=mark, result_key=keys.result("r-2"),
                result=(b"video", 60),
            ) == (True, True)  # fmt: skip

            third = await entry_for("r-3")
            assert await stream.dead_letter(third, reason="poison", error_code="invalid_envelope")
            fourth = await entry_for("r-4")
            assert await stream.ack(fourth.id)

            fifth = await entry_for("r-5")  # reclaimed by another replica (visibility 1 ms), then not held here
            with anyio.fail_after(60):  # the reclaim is the read's, once the entry idled past visibility
                while not (got := await other.read(1, block_ms=500)):
                    pass
            [reclaimed] = got
            assert reclaimed.id == fifth.id
            with pytest.raises(RequestLostError):
                await guard.admit(envelope("r-5"), fifth)
            loss = RecordLoss(redis, store)
            assert await loss.end_if_lost(stream.held(fifth), "r-5", stage="encoder") is Loss.QUEUED
            await other.ack(fifth.id)
            assert await loss.end_if_lost(stream.held(fifth), "r-5", stage="encoder") is Loss.ENDED

            await Refusals(redis, keys, ttl_s=60).record(
                "0" * 32, entry_id="1-0", tenant=None, stream=keys.stage_stream("encoder"),
                error=InvalidRequestIdError("bad id"), request_id=b"bad id",
            )  # fmt: skip
            await Intake(redis, keys, "encoder", max_item_bytes=1024).move(4)  # the intake's mover, too
            assert await ClientKeySweeper(  # and the sweep of client-written keys
                redis, client_key_bounds(keys, request_ttl_s=60, max_upload_bytes=1024)
            ).sweep()
            assert await other.pruner.prune(stale_s=0) == ("encoder-a",)  # and the prune of gone consumers
            heartbeat = Heartbeat(redis, keys, "encoder", "a")
            await heartbeat.beat()
            await heartbeat.withdraw()
            await stream.aclose()
            await other.aclose()
        assert server.refusals() == []


def test_the_shipped_acl_file_is_what_stageferry_acl_prints() -> None:
    """``compose/redis-acl.conf`` is written by hand from ``stageferry acl``: a grant added to one (the
    stage user's ``+xtrim``) must reach the other."""
    shipped = [
        line for line in (ROOT / "compose" / "redis-acl.conf").read_text().splitlines() if line.startswith("user ")
    ]
    assert shipped == acl_file("sf", "encoder").splitlines()


@pytest.mark.parametrize(
    ("url", "db"),
    [
        ("redis://127.0.0.1:6379/2", 2),
        ("redis://127.0.0.1:6379?db=3", 3),
        ("redis://127.0.0.1:6379", 0),
        ("redis+sentinel://stageferry:pw@s1:26379,s2:26379,s3:26379/stageferry/0?wait_replicas=2", 0),
        ("redis+sentinel://s1:26379/stageferry/5", 5),
    ],
)
def test_the_acl_pins_the_database_its_url_names_a_sentinel_url_too(url: str, db: int) -> None:
    """``stageferry acl`` reads the database from the deployment's URL: a sentinel URL's follows its
    service (it was refused as "no valid database: 'stageferry/0'", with the URL the HA docs give)."""
    assert redis_db(url) == db
