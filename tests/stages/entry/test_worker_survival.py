"""A stage never dies of what a client or Redis does (real Redis, real stage processes).

* an entry whose request cannot even be failed (its status key is of another type) is dead-lettered with
  its reason, and the stage goes on — also on the max-deliveries path;
* after Redis restarts empty with an entry in hand (``NOGROUP``, or a run of the entry again once Redis is
  back), the stage re-creates its group and goes on, writes nothing for the entry it no longer holds, and
  ends its request ``failed`` ``request_lost``: a waiting client is told so, and it stays so;
* a slow script (``BUSY``) is waited out.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import anyio
import pytest
import redis as sync_redis

from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.schemas import RequestState, RequestStatus
from tests.broker.control.test_control_plane import JOB, completions, make_services
from tests.procs import Services, wait_for

pytestmark = pytest.mark.timeout(240)

BUSY_SCRIPT = """
local t0 = redis.call('TIME')
while true do
  local t = redis.call('TIME')
  if (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1]) * 1000000 then return 1 end
end
"""


def dead_letters(r: sync_redis.Redis, key: str) -> dict[str, dict[bytes, bytes]]:
    return {f[b"request_id"].decode(): f for _, f in r.xrange(key)}


def test_a_status_key_of_another_type_never_stops_the_stage(tmp_path: Path, redis_url: str, prefix: str) -> None:
    svc = make_services(tmp_path, redis_url, prefix)
    keys = svc.keys
    r = sync_redis.Redis.from_url(redis_url)
    with svc:
        r.set(keys.request("victim-status"), "x")  # what `SET sf:req:x x` did through the old client ACL
        r.set(keys.events("victim-events"), "x")  # the status script's XADD fails after its HSET
        for rid in ("victim-status", "victim-events"):
            r.xadd(keys.stage_stream("encoder"), {"request_id": rid, "job": json.dumps(JOB)})
        encoder = svc.start("encoder", "a")
        svc.start("diffusion", "a")
        dlq = keys.dead_letter("encoder")
        dead = wait_for(lambda: len(d := dead_letters(r, dlq)) == 2 and d, 60, "both entries dead-lettered")
        for rid in ("victim-status", "victim-events"):
            assert b"could not be written" in dead[rid][b"reason"], dead[rid]
        client = svc.client()
        rid = client.submit(JOB)
        assert client.wait(rid, timeout=60).state is RequestState.DONE, svc.logs()
        assert encoder.poll() is None, svc.logs()
        assert r.xlen(keys.stage_stream("encoder")) == 0  # nothing left to be delivered again
        assert "worker.status_write_failed" in svc.logs()
    r.close()


def test_max_deliveries_dead_letters_even_when_the_status_write_fails(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    svc = make_services(tmp_path, redis_url, prefix)  # max_deliveries 2, visibility 2 s
    keys = svc.keys
    stream = keys.stage_stream("encoder")
    r = sync_redis.Redis.from_url(redis_url)
    with svc:
        r.xgroup_create(stream, "encoder", id="0", mkstream=True)
        entry = r.xadd(stream, {"request_id": "poisoned", "job": json.dumps(JOB)})
        r.xreadgroup("encoder", "ghost", {stream: ">"}, count=1)  # delivered to replicas that died on it
        for _ in range(2):
            r.xclaim(stream, "encoder", "ghost", 0, [entry])
        r.set(keys.request("poisoned"), "x")
        encoder = svc.start("encoder", "a")
        dead = wait_for(lambda: dead_letters(r, keys.dead_letter("encoder")).get("poisoned"), 60, "dead-lettered")
        # The id's owner is checked before the delivery count (a second entry must not write the owner's
        # record, issue 17), so here the admission's write to the clobbered key is what fails: either way the
        # entry reaches the dead-letter stream with its reason, and the stage stays up.
        reason = dead[b"reason"]
        assert (b"delivered" in reason and dead[b"error_code"] == b"dead_lettered") or (
            b"WRONGTYPE" in reason and dead[b"error_code"] == b"control_plane"
        ), dead
        # The dead letter and the ack are two round trips (``StageStream.dead_letter``): the ack may follow.
        wait_for(lambda: r.xpending(stream, "encoder")["pending"] == 0, 30, "the entry acked after its dead letter")
        svc.start("diffusion", "a")
        client = svc.client()
        assert client.wait(client.submit(JOB), timeout=60).state is RequestState.DONE, svc.logs()
        assert encoder.poll() is None
    r.close()


def told(outcome: RequestStatus | BaseException) -> str:
    """What a waiter was told: a state, or an error's code (``request_lost`` either way for a lost one)."""
    if isinstance(outcome, BaseException):
        return getattr(outcome, "code", type(outcome).__name__)
    return outcome.error.code if outcome.error is not None else outcome.state.value


async def wait_outcome(client: Client, rid: str, timeout: float) -> RequestStatus | BaseException:
    try:
        return await client.wait(rid, timeout=timeout)
    except Exception as exc:
        return exc


async def lost_for_good(client: Client, svc: Services, server: EmbeddedRedis, rid: str) -> None:
    """The request the empty restart took: its record is gone or ``failed`` ``request_lost`` — never a
    ``running`` left behind (issue 34: admission made it again, held by nothing, so waits hung) nor a
    ``done`` after its waiters were told it was lost — and a wait started now says ``request_lost`` too."""
    status = await client.store.get(rid)
    assert status is None or (status.state is RequestState.FAILED and status.error is not None), (status, svc.logs())
    if status is not None:
        assert status.error is not None and status.error.code == "request_lost", status
    assert told(await wait_outcome(client, rid, 10)) in {"request_lost", "not_found"}
    admin = sync_redis.Redis.from_url(server.url)
    states = [f.get(b"state") for _, f in admin.xrange(client.keys.events(rid)) if f.get(b"kind") == b"status"]
    admin.close()
    assert b"done" not in states and b"running" not in states, states


@pytest.mark.anyio
async def test_redis_restarting_empty_with_an_entry_in_hand(tmp_path: Path, prefix: str) -> None:
    """The encoder holds an entry when Redis restarts empty: its hand-off meets ``NOGROUP``, the group is
    made again, and the request, held by nothing now, ends ``failed`` ``request_lost``; the stage goes on."""
    async with EmbeddedRedis(appendonly=False, data_dir=tmp_path / "redis-data") as server:
        svc = make_services(tmp_path, server.url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
        with svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "encoder", "encoder-a")
            pipeline = PipelineConfig.load(svc.pipeline)
            async with Client(server.url, prefix=prefix, pipeline=pipeline) as client:
                lost = await client.submit({**JOB, "prompt": "sleep:3"})
                with anyio.fail_after(60):
                    while (s := await client.status(lost)) is None or s.state is not RequestState.RUNNING:
                        await anyio.sleep(0.05)
                outcome: list[RequestStatus | BaseException] = []

                async def waiter() -> None:
                    outcome.append(await wait_outcome(client, lost, 60))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    with anyio.fail_after(30):
                        while client.store.fanin.waiters < 1:  # the wait is under way
                            await anyio.sleep(0.02)
                    await server.restart()  # no persistence: streams, groups and the request are gone
                assert [told(o) for o in outcome] == ["request_lost"], outcome
                await anyio.to_thread.run_sync(
                    wait_for, lambda: "worker.entry_unheld" in svc.logs(), 60, "the encoder finds its entry gone"
                )
                await lost_for_good(client, svc, server, lost)
                rid = await client.submit(JOB)
                assert (await client.wait(rid, timeout=90)).state is RequestState.DONE, svc.logs()
            assert all(p.poll() is None for p in svc.procs), svc.logs()
            assert "stream.group_lost" in svc.logs()


def encoder_log(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in tmp_path.glob("encoder-a-*.log"))


@pytest.mark.anyio
async def test_an_entry_run_again_after_redis_came_back_empty_is_not_admitted(tmp_path: Path, prefix: str) -> None:
    """Issue 34's repro: Redis goes away for seconds while the encoder computes, and comes back empty.  The
    worker runs its entry again (the hand-off failed on the connection); the entry is not held any more,
    so admission writes nothing (it used to make the record again, ``running`` for 24 h and held by
    nothing: waits hung) and the request ends ``failed`` ``request_lost``."""
    async with EmbeddedRedis(appendonly=False, data_dir=tmp_path / "redis-data") as server:
        svc = make_services(tmp_path, server.url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
        with svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "encoder", "encoder-a")
            pipeline = PipelineConfig.load(svc.pipeline)
            async with Client(server.url, prefix=prefix, pipeline=pipeline) as client:
                lost = await client.submit({**JOB, "prompt": "sleep:2"})
                with anyio.fail_after(60):
                    while (s := await client.status(lost)) is None or s.state is not RequestState.RUNNING:
                        await anyio.sleep(0.05)
                await server.kill()
                await anyio.to_thread.run_sync(
                    wait_for, lambda: "worker.redis_retry" in encoder_log(tmp_path), 60, "the encoder retries its entry"
                )
                await server.start()  # empty: no persistence
                await anyio.to_thread.run_sync(
                    wait_for, lambda: "worker.entry_unheld" in svc.logs(), 90, "the entry's new run is not admitted"
                )
                await lost_for_good(client, svc, server, lost)
                rid = await client.submit(JOB)
                assert (await client.wait(rid, timeout=90)).state is RequestState.DONE, svc.logs()
            assert all(p.poll() is None for p in svc.procs), svc.logs()


@pytest.mark.anyio
async def test_told_lost_stays_lost_when_the_last_stage_finishes_it(tmp_path: Path, prefix: str) -> None:
    """Issue 34, "lost then done": the diffusion stage holds the entry when Redis restarts empty and then
    finishes it.  Its finish is an owned write: it writes no ``done`` (it used to, after the waiter had
    been told ``request_lost``), and the request ends ``failed`` ``request_lost`` — one answer."""
    async with EmbeddedRedis(appendonly=False, data_dir=tmp_path / "redis-data") as server:
        svc = make_services(tmp_path, server.url, prefix, STAGEFERRY_TEST_SLOW_STAGE="diffusion")
        with svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "diffusion", "diffusion-a")
            pipeline = PipelineConfig.load(svc.pipeline)
            async with Client(server.url, prefix=prefix, pipeline=pipeline) as client:
                lost = await client.submit({**JOB, "prompt": "sleep:3"})
                while (s := await client.status(lost)) is None or s.stage != "diffusion" or s.state.value != "running":
                    await anyio.sleep(0.05)
                outcome: list[RequestStatus | BaseException] = []

                async def waiter() -> None:
                    outcome.append(await wait_outcome(client, lost, 60))

                async with anyio.create_task_group() as tg:
                    tg.start_soon(waiter)
                    with anyio.fail_after(30):
                        while client.store.fanin.waiters < 1:  # the wait is under way
                            await anyio.sleep(0.02)
                    await server.restart()
                assert [told(o) for o in outcome] == ["request_lost"], outcome
                await anyio.to_thread.run_sync(
                    wait_for, lambda: "worker.entry_unheld" in svc.logs(), 60, "diffusion finds its entry gone"
                )
                await lost_for_good(client, svc, server, lost)
                assert completions(tmp_path, "diffusion", lost) == 1  # it did run to the end
            assert all(p.poll() is None for p in svc.procs), svc.logs()


@pytest.mark.anyio
async def test_a_busy_script_is_waited_out(tmp_path: Path, prefix: str) -> None:
    async with EmbeddedRedis(extra_args=["--busy-reply-threshold", "100"]) as server:
        svc = make_services(tmp_path, server.url, prefix, STAGEFERRY_TEST_SLOW_STAGE="encoder")
        with svc:
            svc.start("encoder", "a")
            svc.start("diffusion", "a")
            await anyio.to_thread.run_sync(svc.wait_live, "diffusion", "diffusion-a")
            pipeline = PipelineConfig.load(svc.pipeline)
            async with Client(server.url, prefix=prefix, pipeline=pipeline) as client:
                rid = await client.submit({**JOB, "prompt": "sleep:1"})
                busy = sync_redis.Redis.from_url(server.url, socket_timeout=30)
                thread = threading.Thread(target=lambda: busy.eval(BUSY_SCRIPT, 0, 4))
                thread.start()
                await anyio.to_thread.run_sync(thread.join)
                busy.close()
                assert (await client.wait(rid, timeout=90)).state is RequestState.DONE, svc.logs()
            assert all(p.poll() is None for p in svc.procs), svc.logs()
            assert "BUSY" in svc.logs()
