"""Logging: configuration, request context, and forwarding of request events to Redis."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import structlog
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.errors import ConfigError
from stageferry.logs import EventSink, _EventQueue, bound_request, configure_logging

log = structlog.get_logger("test")
MERGE = [structlog.contextvars.merge_contextvars]


def test_bound_request_binds_and_unbinds() -> None:
    with capture_logs(processors=MERGE) as events:
        with bound_request("r-1", key="r-1_0_0", stage="encoder", rank=0):
            log.info("inside", n=1)
        log.info("outside")
    assert events[0] == {
        "event": "inside",
        "n": 1,
        "request_id": "r-1",
        "key": "r-1_0_0",
        "stage": "encoder",
        "rank": 0,
        "log_level": "info",
    }
    assert "request_id" not in events[1]


def test_bound_request_omits_unset_fields() -> None:
    with capture_logs(processors=MERGE) as events, bound_request("r-2"):
        log.info("x")
    assert events[0]["request_id"] == "r-2"
    assert "stage" not in events[0] and "rank" not in events[0]


def test_json_lines_with_service_pid_and_utc_time(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(fmt="json", level="info", service="encoder")
    log.debug("hidden")
    log.info("payload.put", bytes=12, transport="nixl")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "payload.put" and event["bytes"] == 12
    assert event["service"] == "encoder" and isinstance(event["pid"], int)
    assert event["level"] == "info"
    assert event["timestamp"].endswith("Z")


def test_library_loggers_and_warnings_become_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    nixl = logging.getLogger("nixl")  # as nixl sets itself up on import: its own stdout handler, no propagation
    nixl.addHandler(logging.StreamHandler(sys.stdout))
    nixl.propagate = False
    configure_logging(fmt="json", level="info", service="diffusion-rank0")
    logging.getLogger("nixl.api").info("Backend UCX was instantiated")
    logging.getLogger("some.library").debug("chatter below our level")
    logging.warning("a root warning")
    out = capsys.readouterr()
    assert out.out == ""
    events = [json.loads(line) for line in out.err.strip().splitlines()]
    assert [(e["event"], e["logger"], e["message"], e["level"]) for e in events] == [
        ("library.log", "nixl.api", "Backend UCX was instantiated", "info"),
        ("library.log", "root", "a root warning", "warning"),
    ]
    assert all(e["service"] == "diffusion-rank0" for e in events)


NATIVE_SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, warnings
    import structlog
    from stageferry.logs import configure_logging, flush_native_output
    configure_logging(fmt="json", level="info", service="encoder-rank0", capture_native=True)
    os.write(2, b"[1700000000.1] ucp_worker.c:1 UCX  WARN  a native warning\\n")
    os.write(1, b"50%|#####     | 5/10\\r100%|##########| 10/10\\n")
    print("a stray print")
    os.write(2, b"error [config]: cannot load the model x\\n")  # what _expected_errors prints for a serve
    os.write(2, b"some library: fatal: gone\\n")
    warnings.warn("careful")
    logging.getLogger("nixl").info("Initialized NIXL agent: x")
    structlog.get_logger().info("ours", n=1)
    flush_native_output()
    os._exit(0)
    """
)


def test_native_output_of_a_service_is_wrapped_into_json(tmp_path: Path) -> None:
    log_file = tmp_path / "service.log"
    with log_file.open("wb") as out:  # as `up` runs a service: stdout and stderr into one file
        subprocess.run([sys.executable, "-c", NATIVE_SCRIPT], stdout=out, stderr=out, check=True, timeout=60)
    events = [json.loads(line) for line in log_file.read_text().splitlines()]  # every line parses
    native = [e["line"] for e in events if e["event"] == "native.output"]
    assert any("UCX  WARN  a native warning" in line for line in native)
    assert any("10/10" in line for line in native) and "a stray print" in native
    assert next(e for e in events if "UCX  WARN" in e.get("line", ""))["level"] == "warning"
    assert next(e for e in events if "fatal: gone" in e.get("line", ""))["level"] == "error"
    (fatal,) = [e for e in events if e["event"] == "service.error"]  # a service that cannot start
    assert fatal["level"] == "error" and fatal["code"] == "config" and fatal["message"] == "cannot load the model x"
    assert not any("cannot load" in e.get("line", "") for e in events)
    library = {e["message"] for e in events if e["event"] == "library.log"}
    assert "Initialized NIXL agent: x" in library and any("careful" in m for m in library)
    assert any(e["event"] == "ours" and e["service"] == "encoder-rank0" for e in events)


def test_console_format(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(fmt="console", level="debug", service="cli")
    log.debug("shown", a=1)
    assert "shown" in capsys.readouterr().err


def test_unknown_level_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        configure_logging(level="chatty", service="x")


def test_queue_drops_oldest_and_counts() -> None:
    queue = _EventQueue(maxlen=3)
    for i in range(5):
        queue.put("r", {"i": i})
    assert queue.dropped == 2
    assert [e["i"] for _, e in queue.take(10)] == [2, 3, 4]
    assert len(queue) == 0


@pytest.mark.anyio
async def test_sink_forwards_request_events_to_redis(redis_url: str, prefix: str) -> None:
    configure_logging(fmt="json", level="info", service="encoder")
    async with open_client(redis_url) as redis:
        store = RequestStore(redis, Keys(prefix), ttl_s=60, events_maxlen=100)
        sink = EventSink(store)
        async with anyio.create_task_group() as tg:
            await tg.start(sink.run)
            with bound_request("rid-1", stage="encoder", rank=0):
                log.info("stage.step", step=1, total=4)
                try:
                    raise ValueError("boom")
                except ValueError:
                    log.exception("stage.oops")
            log.info("not.forwarded")
            await sink.flush()
            rows = await store.events("rid-1")
            tg.cancel_scope.cancel()
    assert [row["kind"] for _, row in rows] == ["log", "log"]
    first, second = (row["event"] for _, row in rows)
    assert first["event"] == "stage.step" and first["request_id"] == "rid-1"
    assert first["service"] == "encoder" and first["stage"] == "encoder" and first["rank"] == 0
    assert first["step"] == 1 and first["timestamp"].endswith("Z")
    assert "ValueError: boom" in second["exception"]
    assert sink.dropped == 0


@pytest.mark.anyio
async def test_sink_flushes_on_cancellation_and_allows_one_per_process(redis_url: str, prefix: str) -> None:
    configure_logging(fmt="json", level="info", service="diffusion")
    async with open_client(redis_url) as redis:
        store = RequestStore(redis, Keys(prefix), ttl_s=60, events_maxlen=100)
        async with anyio.create_task_group() as tg:
            await tg.start(EventSink(store, interval=60).run)
            with pytest.raises(RuntimeError):
                await EventSink(store).run()
            with bound_request("rid-2"):
                log.info("last.words")
            tg.cancel_scope.cancel()
        rows = await store.events("rid-2")
        assert [row["event"]["event"] for _, row in rows] == ["last.words"]
        # The sink unregistered: a new one may start, and events without a sink are not queued.
        async with anyio.create_task_group() as tg:
            await tg.start(EventSink(store).run)
            tg.cancel_scope.cancel()
        with bound_request("rid-3"):
            log.info("nobody.listens")
        assert await store.events("rid-3") == []


@pytest.mark.anyio
async def test_a_batch_of_events_is_one_round_trip_and_only_a_new_stream_pays_an_expire(
    redis_url: str, prefix: str
) -> None:
    """Five events of two requests whose streams do not exist yet: five XADDs that make no stream
    (``NOMKSTREAM``), then the five again with one PEXPIRE per stream, each stream in order; five more
    to the streams that exist now: one pipeline of five XADDs, no PEXPIRE (the TTL stays as it was set)."""
    configure_logging(fmt="json", level="info", service="encoder")
    async with open_client(redis_url) as redis:
        store = RequestStore(redis, Keys(prefix), ttl_s=60, events_maxlen=100)
        sent: list[list[str]] = []
        real_pipeline = redis.pipeline

        def counting_pipeline(*args: object, **kwargs: object) -> object:
            pipe = real_pipeline(*args, **kwargs)  # type: ignore[arg-type]
            real_execute = pipe.execute

            async def execute(*a: object, **k: object) -> object:
                sent.append([str(cmd[0][0]) for cmd in pipe.command_stack])
                return await real_execute(*a, **k)  # type: ignore[arg-type]

            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        redis.pipeline = counting_pipeline  # type: ignore[method-assign]
        sink = EventSink(store, interval=60)
        async with anyio.create_task_group() as tg:
            await tg.start(sink.run)
            for batch in (range(5), range(5, 10)):
                for i in batch:
                    with bound_request(f"rid-{i % 2}"):
                        log.info("stage.step", step=i)
                await sink.flush()
            tg.cancel_scope.cancel()
        assert sent == [["XADD"] * 5, ["XADD"] * 5 + ["PEXPIRE"] * 2, ["XADD"] * 5]
        for rid, steps in (("rid-0", [0, 2, 4, 6, 8]), ("rid-1", [1, 3, 5, 7, 9])):
            assert [row["event"]["step"] for _, row in await store.events(rid)] == steps
            assert 60 < await redis.ttl(Keys(prefix).events(rid)) <= 66  # the scripts' refresh: 60 s and a tenth
        assert sink.dropped == 0
