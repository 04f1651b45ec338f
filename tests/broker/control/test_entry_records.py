"""The entry-life scripts against a real Redis: typed replies, and the Redis commands a request costs.

The scripts' replies are frozen dataclasses (:class:`Look`, :class:`Admitted`), their arguments named
(:class:`StatusWrite`, :class:`EntryKeys`).  The last test runs a real two-stage deployment on a private
``redis-server`` and counts, with ``MONITOR``, every command that names one of the measured requests
(its keys, or its submission inside an intake push or a stream entry) — commands inside scripts
included — so that the entry-life writes per request are held to :data:`MAX_COMMANDS_PER_REQUEST`
(reads and idle polling name no request and are left out: they depend on timing, not on the request).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from stageferry.broker.control.entry_records import (
    Admission,
    Admitted,
    EntryKeys,
    EntryRecords,
    Look,
    StatusOrder,
    StatusWrite,
    scripts,
)
from stageferry.broker.control.held import Held
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.record_loss import Loss, RecordLoss
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.embedded_redis import EmbeddedRedis, find_redis_server
from stageferry.schemas import Progress, RequestState, RequestStatus
from stageferry.trace.events import parse_events
from tests.procs import Services, write_pipeline

JOB_DIGEST = "d" * 64
#: What the entry-life writes of one T2VA-like request through two stages may cost, in Redis commands that
#: name it (the submission, admissions, statuses, hand-off, finish; see the module docstring): ≈ 30.5
#: measured when this bound was set (30.4, 30.5; the hand-off's cancel check and its queued event went; the
#: client's XREADs vary with timing by a few); ≈ 32 (31.2–32.6) before that, ≈ 33 before a first stage's
#: queued and running became one status event, ≈ 35–39 before a new submission's HGET of ``job_sha``, the
#: wait's ``job_sha`` HGET and the log sink's PEXPIRE per event batch went, 42 before the end's TTL refresh
#: and the wait's first status read went.  The whole count per request, reads and polling included, is
#: ``benchmarks/commands_compare.py``'s.
MAX_COMMANDS_PER_REQUEST = 34


@pytest.fixture
async def records(redis_url: str, prefix: str) -> AsyncIterator[tuple[EntryRecords, RequestStore, Keys]]:
    async with open_client(redis_url) as redis:
        keys = Keys(prefix)
        yield (
            EntryRecords(redis, keys, ttl_s=600),
            RequestStore(redis, keys, ttl_s=600, events_maxlen=100),
            keys,
        )


def run_keys(keys: Keys, rid: str, entry_id: str = "1-0", attempt: int = 0) -> EntryKeys:
    return EntryKeys.of(keys, rid, "diffusion", attempt, entry_id)


def queued_then_running(
    store: RequestStore, rid: str, then: Any = "update", first: Any = "any"
) -> tuple[StatusWrite, StatusWrite]:
    """A first stage's two starts of ``rid`` at stage diffusion: ``queued`` (mode ``first``), then
    ``running`` (mode ``then``)."""
    queued = store.status_write(RequestStatus(request_id=rid, state=RequestState.QUEUED, stage="diffusion"), mode=first)
    running = store.status_write(
        RequestStatus(request_id=rid, state=RequestState.RUNNING, stage="diffusion"), mode=then
    )
    return queued, running


@pytest.mark.anyio
async def test_a_first_delivery_s_start_comes_back_typed_and_writes_its_starts_in_order(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    entry_records, store, keys = records
    queued, running = queued_then_running(store, "e-1")
    assert isinstance(queued, StatusWrite) and queued.order.rank == 0 and running.order.rank == 1
    run = run_keys(keys, "e-1")
    admitted = await entry_records.admit_mark_and_look(run, JOB_DIGEST, "1-0", held=None, starts=(queued, running))
    assert admitted == Admitted(
        Admission.NEW, Look(status=None, cancelled=False, claimed=True, owner="1-0", started=True)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        admitted.look.started = False  # type: ignore[misc, union-attr]
    status = await store.get("e-1")
    assert status is not None and status.state is RequestState.RUNNING
    rows = await store.events("e-1")
    assert [fields["state"] for _, fields in rows] == ["running"]  # one event for both starts: the last one's,
    assert rows[0][1]["folded"]["state"] == "queued"  # carrying the first (a trace still shows the queue time)
    assert [ev.event for ev in parse_events(rows)] == ["status.queued", "status.running"]
    record = await entry_records.redis.hgetall(run.record)  # as the running write leaves it
    assert record[b"order"] == running.order.key().encode() == b"00000 000 1 0000000"  # compared as strings
    assert record[b"state"] == b"running" and record[b"status"] == running.status_json.encode()
    assert await entry_records.crashes(run.record, run.crash_field) == 1
    record_ttl, events_ttl = await entry_records.redis.ttl(run.record), await entry_records.redis.ttl(run.events)
    assert 600 < record_ttl <= 660 and 600 < events_ttl <= 660  # the TTL and its margin (a tenth, a minute at most)

    again = await entry_records.admit_mark_and_look(
        run_keys(keys, "e-1", "2-0"), JOB_DIGEST, "2-0", held=None, starts=(running,)
    )  # another entry of the same run: a duplicate, which writes no start
    assert again.admission is Admission.SAME_JOB and again.look is not None
    assert again.look.claimed is False and again.look.owner == "1-0" and again.look.started is False
    assert again.look.status is not None and b'"running"' in again.look.status
    assert len(await store.events("e-1")) == 1


@pytest.mark.anyio
async def test_a_start_that_is_not_replaced_keeps_its_own_event(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    entry_records, store, keys = records
    queued, refused = queued_then_running(store, "e-8", "unowned")  # admitted, the record has a job: refused
    await entry_records.admit_mark_and_look(
        run_keys(keys, "e-8"), JOB_DIGEST, "1-0", held=None, starts=(queued, refused)
    )
    rows = await store.events("e-8")
    assert [fields["state"] for _, fields in rows] == ["queued"] and "folded" not in rows[0][1]
    status = await store.get("e-8")
    assert status is not None and status.state is RequestState.QUEUED

    assert await store.set_status(RequestStatus(request_id="e-9", state=RequestState.QUEUED, stage="encoder"))
    queued, running = queued_then_running(store, "e-9", first="create")
    # the record exists: the 'create' start is refused, the running one written with an event of its own
    await entry_records.admit_mark_and_look(
        run_keys(keys, "e-9"), JOB_DIGEST, "1-0", held=None, starts=(queued, running)
    )
    rows = await store.events("e-9")
    assert [fields["state"] for _, fields in rows] == ["queued", "running"] and "folded" not in rows[1][1]
    assert [ev.stage for ev in parse_events(rows)] == ["encoder", "diffusion"]


@pytest.mark.anyio
async def test_a_taken_id_an_unheld_entry_and_a_cancelled_request(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    entry_records, store, keys = records
    assert await entry_records.admit("e-2", JOB_DIGEST) is Admission.NEW
    taken = await entry_records.admit_mark_and_look(run_keys(keys, "e-2"), "e" * 64, "1-0", held=None)
    assert taken == Admitted(Admission.TAKEN, None)
    assert (
        await entry_records.crashes(keys.request("e-2"), run_keys(keys, "e-2").crash_field) == 0
    )  # a taken id gets no mark

    gone = Held(keys.stage_stream("diffusion"), "diffusion", "diffusion-a", "9-0")  # no such group: not held
    unheld = await entry_records.admit_mark_and_look(run_keys(keys, "e-3"), JOB_DIGEST, "9-0", held=gone)
    assert unheld == Admitted(Admission.UNHELD, None)
    assert await store.owner("e-3") is None  # nothing written
    assert await entry_records.admit("e-3", JOB_DIGEST, held=gone) is Admission.UNHELD

    await entry_records.redis.set(keys.cancel("e-4"), b"1")
    running = store.status_write(
        RequestStatus(request_id="e-4", state=RequestState.RUNNING, stage="diffusion"), mode="any"
    )
    cancelled = await entry_records.admit_mark_and_look(
        run_keys(keys, "e-4"), JOB_DIGEST, "1-0", held=None, starts=(running,)
    )
    assert cancelled.look is not None and cancelled.look.cancelled and not cancelled.look.started
    assert await store.get("e-4") is None  # a cancelled request's start is not written


@pytest.mark.anyio
async def test_a_redelivery_s_look_and_its_crash_marks(records: tuple[EntryRecords, RequestStore, Keys]) -> None:
    entry_records, store, keys = records
    run = run_keys(keys, "e-5")
    assert await entry_records.admit("e-5", JOB_DIGEST) is Admission.NEW
    assert await entry_records.look(run, "1-0") == Look(status=None, cancelled=False, claimed=True, owner="1-0")
    assert await entry_records.look(run, "1-0") == Look(status=None, cancelled=False, claimed=False, owner="1-0")
    assert await entry_records.mark(run.record, run.crash_field, 2) == 1
    assert await entry_records.mark(run.record, run.crash_field, 3) == 2
    assert await entry_records.crashes(run.record, run.crash_field) == 2
    # the same delivery marked again (redis-py's retry after a lost reply): counted once
    assert await entry_records.mark(run.record, run.crash_field, 3) == 2
    assert await entry_records.crashes(run.record, run.crash_field) == 2
    await entry_records.clear_mark(run.record, run.crash_field)
    assert await entry_records.crashes(run.record, run.crash_field) == 0
    done = RequestStatus(request_id="e-5", state=RequestState.DONE, stage="diffusion")
    assert await store.set_status(done)
    looked = await entry_records.look(run, "1-0")
    assert looked.status is not None and b'"done"' in looked.status


@pytest.mark.anyio
async def test_a_request_ending_within_the_margin_pays_no_expire_and_still_lives_its_ttl_after_the_end(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    entry_records, store, keys = records
    redis, run = entry_records.redis, run_keys(keys, "e-7")
    queued = store.status_write(RequestStatus(request_id="e-7", state=RequestState.QUEUED, stage="diffusion"))
    await entry_records.admit_mark_and_look(run, JOB_DIGEST, "1-0", held=None, starts=(queued,))
    refreshed_at = await redis.hget(run.record, "ttl_at")
    assert refreshed_at is not None
    assert await store.set_status(RequestStatus(request_id="e-7", state=RequestState.DONE, stage="diffusion"))
    assert await redis.hget(run.record, "ttl_at") == refreshed_at  # the end set no TTL again
    for key in (run.record, run.events):  # yet both live at least the TTL (600 s) after the end
        assert 600_000 < await redis.pttl(key) <= 660_000
    status = await store.get("e-7")
    assert status is not None and status.state is RequestState.DONE


@pytest.mark.anyio
async def test_a_status_write_is_refused_when_older_or_after_the_end(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    _, store, _ = records
    running = RequestStatus(request_id="e-6", state=RequestState.RUNNING, stage="diffusion")
    assert await store.set_status(running, stage_index=1)
    queued_before = RequestStatus(request_id="e-6", state=RequestState.QUEUED, stage="encoder")
    assert not await store.set_status(queued_before, stage_index=0)  # older: the request never moves back
    assert await store.set_status(running.model_copy(update={"state": RequestState.FAILED}), stage_index=1)
    assert not await store.set_status(running, stage_index=1)  # terminal: written once
    got = await store.get("e-6")
    assert got is not None and got.state is RequestState.FAILED


@pytest.mark.anyio
async def test_orders_compare_field_by_field_in_either_form(records: tuple[EntryRecords, RequestStore, Keys]) -> None:
    """A status's order is four fixed-width fields (``StatusOrder.key``), compared as a string; a record
    written before that form (four numbers, space-separated) is compared number by number, so that a
    rolling upgrade never moves a request back (nor refuses a newer write)."""
    entry_records, store, keys = records
    redis, record = entry_records.redis, keys.request("e-9")
    step = RequestStatus(request_id="e-9", state=RequestState.RUNNING, stage="diffusion")

    def running_at(n: int) -> RequestStatus:
        return step.model_copy(update={"progress": Progress(stage="diffusion", step=n, total=20)})

    assert await store.set_status(running_at(9), stage_index=1)
    assert not await store.set_status(running_at(8), stage_index=1)  # 9 < 10 as numbers, not as text
    assert await store.set_status(running_at(10), stage_index=1)
    assert await redis.hget(record, "order") == b"00000 001 1 0000010"
    for old, refused, written in (("0 1 1 10", 9, 11), ("0 1 1 9", 8, 10), ("0 2 0 0", 19, None)):
        await redis.hset(record, "order", old)  # as a stage before this form wrote it
        assert not await store.set_status(running_at(refused), stage_index=1), old
        if written is not None:
            assert await store.set_status(running_at(written), stage_index=1), old
    assert await store.set_status(step, stage_index=2)  # a later stage: newer whatever its step


def test_an_order_key_is_fixed_width_and_ordered_as_its_fields() -> None:
    fields = [(a, s, r, p) for a in (0, 1, 12) for s in (0, 3, 10) for r in (0, 1, 2) for p in (0, 9, 10, 500)]
    orders = [StatusOrder(*f) for f in fields]
    keys = [o.key() for o in orders]
    assert {len(k) for k in keys} == {19}
    assert [[int(x) for x in k.split()] for k in keys] == [list(f) for f in fields]
    assert sorted(keys) == [o.key() for o in sorted(orders, key=lambda o: (o.attempt, o.stage_index, o.rank, o.step))]
    assert StatusOrder(0, 0, 0, 10**9).key() == "00000 000 0 9999999"  # cut to the width, never longer


def test_the_steps_are_one_library_defining_each_shared_function_once() -> None:
    """Every step is a function of :data:`scripts.ENTRY_LIBRARY`, whose shared functions are defined once,
    at load (a script defined them again on every call), and whose steps define none of their own."""
    code = scripts.ENTRY_LIBRARY.code
    shared = set(re.findall(r"^local function ([a-z_]+)", "".join(lua for _, lua in scripts.LIBRARY), re.M))
    assert {"held", "record", "save", "set_status", "emit", "admit"} <= shared
    for name in shared:
        assert len(re.findall(rf"^local function {name}\b", code, re.M)) == 1, name
    steps = re.findall(
        r"^redis\.register_function\('([a-z0-9_]+)', function\(keys, args\)\n(.*?)^end\)$", code, re.M | re.S
    )
    assert sorted(name for name, _ in steps) == sorted(scripts.ENTRY_LIBRARY.named().functions.values())
    for name, body in steps:
        assert body.startswith("KEYS, ARGV, clock = keys, args, nil\n"), name
        assert "local function" not in re.sub(r"--[^\n]*", "", body), name
    for constant in ("SET_STATUS", "ADMIT", "ADMIT_AND_MARK", "ADMIT_MARK_AND_LOOK", "LOOK", "MARK", "HAND_OFF",
                     "FINISH", "END_IF_LOST"):  # fmt: skip
        function = getattr(scripts, constant)
        assert function.source is scripts.ENTRY_LIBRARY and function.short == constant.lower()


@pytest.mark.anyio
async def test_no_call_reads_the_clock_an_earlier_call_left(records: tuple[EntryRecords, RequestStore, Keys]) -> None:
    """The library's locals outlive a call and are shared by every client: a write that adds no event does
    not know the clock, so it sets the TTLs again (with a stale clock from an earlier call it would find
    them fresh, and leave a record that expires early)."""
    entry_records, store, keys = records
    rid = "clock-1"
    assert await store.set_status(RequestStatus(request_id=rid, state=RequestState.QUEUED, stage="diffusion"))
    record = keys.request(rid)
    await entry_records.redis.pexpire(record, 5_000)  # as if its TTL had run down
    assert await entry_records.admit(rid, JOB_DIGEST) is Admission.NEW  # an HSET, no event: clock unknown
    assert await entry_records.redis.ttl(record) > 600, "refreshed: no clock of the earlier call was read"


def _names(line: str, rid: str) -> bool:
    """Whether a MONITOR line names request ``rid``: one of its keys, or its id as a value (an entry's
    ``request_id``) or inside JSON (a submission)."""
    return f":{rid}" in line or f'"{rid}"' in line or f'\\"{rid}\\"' in line


@pytest.fixture
def private_server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    import anyio

    find_redis_server()
    server = EmbeddedRedis(data_dir=tmp_path / "redis")
    anyio.run(server.start)
    try:
        yield server
    finally:
        anyio.run(server.stop)


def test_the_entry_life_writes_of_a_request_stay_within_the_bound(
    tmp_path: Path, private_server: EmbeddedRedis
) -> None:
    stages = [
        {"name": name, "model": "stageferry.stages.passthrough:factory", "tp": 1, "device": "cpu"}
        for name in ("encoder", "diffusion")
    ]
    path = write_pipeline(tmp_path / "pipeline.toml", stages, data_plane={"connector": "inline"})
    prefix = "cmds"
    lines: list[str] = []
    with Services(tmp_path, redis_url=private_server.url, prefix=prefix, pipeline=path, extra_env={}) as services:
        services.start("encoder", "a")
        services.start("diffusion", "a")
        services.wait_live("encoder", "encoder-a", timeout=180)
        services.wait_live("diffusion", "diffusion-a", timeout=180)
        client = services.client()
        client.wait(client.submit({"task": "t2va", "prompt": "warm-up"}), timeout=120)  # scripts loaded
        monitor = subprocess.Popen(
            ["redis-cli", "-p", str(private_server.port), "monitor"], stdout=subprocess.PIPE, text=True
        )
        assert monitor.stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(monitor.stdout or ()), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 30
            while not lines and time.monotonic() < deadline:  # MONITOR answers OK once it is on
                time.sleep(0.05)
            assert lines, "MONITOR never started"
            ids = [f"cmd-{i}" for i in range(10)]
            for rid in ids:
                client.submit({"task": "t2va", "prompt": f"p {rid}"}, request_id=rid)
            for rid in ids:
                assert client.wait(rid, timeout=120).state is RequestState.DONE
        finally:
            monitor.terminate()
            monitor.wait(timeout=10)
            reader.join(timeout=10)
    named = [line for line in lines if any(_names(line, rid) for rid in ids)]
    per_request = len(named) / len(ids)
    print(f"entry-life commands per request: {per_request:.1f}")

    if os.environ.get("DUMP_NAMED"):
        Path(os.environ["DUMP_NAMED"]).write_text("\n".join(named))
    if os.environ.get("DUMP_ALL"):
        Path(os.environ["DUMP_ALL"]).write_text("".join(lines))
    assert per_request > 10, f"MONITOR saw too little to count: {len(named)} lines"
    assert per_request <= MAX_COMMANDS_PER_REQUEST, f"{per_request:.1f} commands per request:\n" + "\n".join(
        named[: int(per_request) + 5]
    )


@pytest.mark.anyio
async def test_a_look_after_the_record_is_gone_makes_no_record_and_the_request_ends_lost(
    records: tuple[EntryRecords, RequestStore, Keys],
) -> None:
    """A redelivery's look comes two round trips after its admission: Redis may have come back empty in
    between.  The look then writes nothing (a record holding only the run would read as "recorded" to the
    loss check, and the request's waiters would wait for its TTL instead of hearing it was lost)."""
    entry_records, store, keys = records
    redis, run = entry_records.redis, run_keys(keys, "e-9")
    looked = await entry_records.look(run, "1-0")
    assert looked == Look(status=None, cancelled=False, claimed=False, owner=None)
    assert await redis.exists(run.record, run.events) == 0
    stream = keys.stage_stream("diffusion")
    held = Held(stream, "diffusion", "diffusion-a", "1-0")
    loss = await RecordLoss(redis, store).end_if_lost(held, "e-9", stage="diffusion", stage_index=1)
    assert loss is Loss.ENDED
    status = await store.get("e-9")
    assert status is not None and status.state is RequestState.FAILED and status.error is not None
    assert status.error.code == "request_lost"
    await redis.delete(run.record, run.events)
