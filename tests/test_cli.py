"""The CLI through typer's runner against a real Redis, and trace formatting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
import redis as sync_redis
import typer.main
from typer.testing import CliRunner

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_url import shown
from stageferry.cli import app, build_job
from stageferry.client import Client
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.schemas import OutputInfo, RequestState, RequestStatus, StageTiming, Transport
from stageferry.trace.events import format_trace, hops, parse_events, save_trace
from tests.procs import wait_for

ROOT = Path(__file__).resolve().parent.parent

runner = CliRunner()


def invoke(redis_url: str, prefix: str, *args: str, stdin: str | None = None) -> Any:
    return runner.invoke(app, ["--redis-url", redis_url, "--prefix", prefix, *args], input=stdin)


def test_schema_is_json_schema_with_prompt() -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema["type"] == "object"
    assert "prompt" in schema["properties"] and "prompt" in schema["required"]
    assert schema["additionalProperties"] is False


def test_schema_payload_prints_the_contract_as_json_and_as_the_docs_tables() -> None:
    from stageferry.schemas.payload_contract import CONDITIONING
    from stageferry.schemas.payload_contract_doc import contract_json, contract_markdown

    result = runner.invoke(app, ["schema", "payload"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == contract_json(CONDITIONING)
    result = runner.invoke(app, ["schema", "payload", "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert result.stdout == contract_markdown(CONDITIONING)
    assert "| `text.hidden_states` | bfloat16, float16, float32 | `[n, hidden]` | always |" in result.stdout


def test_submit_then_status(redis_url: str, prefix: str) -> None:
    result = invoke(redis_url, prefix, "submit", "--prompt", "a boat", "--width", "320", "--height", "192",
                    "--steps", "4", "--request-id", "cli-1")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "cli-1"
    result = invoke(redis_url, prefix, "status", "cli-1")
    assert result.exit_code == 0
    status = RequestStatus.model_validate_json(result.stdout)
    assert status.state is RequestState.QUEUED and status.stage == "encoder"


def test_submit_takes_a_negative_prompt(redis_url: str, prefix: str) -> None:
    result = invoke(redis_url, prefix, "submit", "--prompt", "a boat", "--negative-prompt", "blurry, text",
                    "--request-id", "cli-neg")  # fmt: skip
    assert result.exit_code == 0, result.output
    with sync_redis.Redis.from_url(redis_url) as r:  # what the first stage will read, on its intake
        (item,) = r.lrange(Keys(prefix).intake("encoder"), 0, -1)
    job = json.loads(item)["job"]
    assert job["prompt"] == "a boat" and job["negative_prompt"] == "blurry, text"


def test_submit_from_json_on_stdin_with_env_settings(redis_url: str, prefix: str) -> None:
    job = json.dumps({"prompt": "from stdin", "width": 320, "height": 192})
    env = {"STAGEFERRY_REDIS_URL": redis_url, "STAGEFERRY_PREFIX": prefix}
    result = runner.invoke(app, ["submit", "--json", "-", "--seed", "7"], input=job, env=env)
    assert result.exit_code == 0, result.output
    rid = result.stdout.strip()
    result = runner.invoke(app, ["status", rid], env=env)
    assert result.exit_code == 0
    assert RequestStatus.model_validate_json(result.stdout).state is RequestState.QUEUED
    items = sync_redis.Redis.from_url(redis_url).lrange(Keys(prefix).intake("encoder"), 0, -1)
    assert [json.loads(item)["job"]["seed"] for item in items] == [7]  # queued on the intake


def test_invalid_job_is_one_line_without_traceback(redis_url: str, prefix: str) -> None:
    result = invoke(redis_url, prefix, "submit", "--prompt", "x", "--steps", "0")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error [invalid_job]: num_inference_steps: Input should be greater than or equal to 1"
    ]
    result = invoke(redis_url, prefix, "submit", "--json", "-", stdin="{not json")
    assert result.exit_code == 1 and result.stderr.startswith("error [invalid_job]")
    assert "Traceback" not in result.output
    # a bound the deployment sets tighter than the schema is quoted as the deployment's
    result = invoke(redis_url, prefix, "submit", "--prompt", "x" * 9000)
    assert result.stderr.strip().splitlines() == [
        "error [invalid_job]: prompt: at most 4096 characters (this deployment's limits.max_prompt_chars)"
    ]
    result = invoke(redis_url, prefix, "submit", "--prompt", "x", "--steps", "201")
    assert "must be at most 100 (this deployment's limits.max_steps)" in result.stderr


def test_an_id_that_would_alias_another_requests_keys_is_refused(redis_url: str, prefix: str) -> None:
    victim = invoke(redis_url, prefix, "submit", "--prompt", "x", "--width", "320", "--height", "192").stdout.strip()
    for bad in (f"{victim}:cancel", f"{victim}:events", "a b*c?[d]", "x" * 5000):
        result = invoke(redis_url, prefix, "submit", "--prompt", "x", "--request-id", bad)
        assert result.exit_code == 1 and result.stderr.startswith("error [invalid_job]: request_id: must match"), bad
    assert not sync_redis.Redis.from_url(redis_url).exists(Keys(prefix).cancel(victim))
    acl = runner.invoke(app, ["--prefix", prefix, "acl", "--tenant", "acme"])
    client_line = acl.stdout.splitlines()[-1]
    assert acl.exit_code == 0 and client_line.startswith("user sfclient-acme on ")
    assert f"%R~{prefix}:req:acme.* " in client_line and "+eval" not in client_line


def test_unknown_request(redis_url: str, prefix: str) -> None:
    for command in ("status", "trace", "cancel"):
        result = invoke(redis_url, prefix, command, "nope")
        assert result.exit_code == 1, command
        assert result.stderr.startswith("error ["), command


def test_wait_times_out_with_a_typed_error(redis_url: str, prefix: str) -> None:
    assert invoke(redis_url, prefix, "submit", "--prompt", "x", "--width", "320", "--height", "192",
                  "--request-id", "w-1").exit_code == 0  # fmt: skip
    result = invoke(redis_url, prefix, "wait", "w-1", "--timeout", "0.2")
    assert result.exit_code == 1
    assert result.stderr.startswith("error [deadline_exceeded]")


def test_wait_on_an_unknown_id_ends_at_once(redis_url: str, prefix: str) -> None:
    """No timeout given, an id nobody submitted: one not_found line and exit 1, at once."""
    started = time.monotonic()
    result = invoke(redis_url, prefix, "wait", "never-submitted")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "error [not_found]: no request never-submitted (unknown id, or expired)"
    ]
    assert result.stdout == ""
    assert time.monotonic() - started < 5
    started = time.monotonic()
    result = invoke(redis_url, prefix, "wait", "never-submitted", "--appear-within", "1")
    assert result.exit_code == 1 and result.stderr.startswith("error [not_found]")
    assert 1 <= time.monotonic() - started < 15


def test_wait_has_a_default_timeout(redis_url: str, prefix: str, tmp_path: Path) -> None:
    """Without --timeout the pipeline's timeouts.request bounds the wait."""
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text("[timeouts]\nrequest = 1.0\n")
    assert invoke(redis_url, prefix, "submit", "--prompt", "x", "--width", "320", "--height", "192",
                  "--request-id", "w-2").exit_code == 0  # fmt: skip
    started = time.monotonic()
    result = invoke(redis_url, prefix, "--pipeline", str(pipeline), "wait", "w-2")
    assert result.exit_code == 1 and result.stderr.startswith("error [deadline_exceeded]")
    assert time.monotonic() - started < 15


def test_bad_settings_are_a_config_error_naming_the_setting() -> None:
    """The setting is named as its user set it: the flag on the command line, else the variable."""
    result = runner.invoke(app, ["--prefix", "bad prefix!", "status", "x"])
    assert result.exit_code == 1 and result.stderr.startswith("error [config]: bad settings: --prefix: ")
    result = runner.invoke(app, ["status", "x"], env={"STAGEFERRY_GATEWAY_TOKEN": "short"})
    assert result.stderr.startswith("error [config]: bad settings: STAGEFERRY_GATEWAY_TOKEN: "), result.stderr
    assert "8 characters" in result.stderr


def test_serve_unknown_stage_fails_before_starting(redis_url: str, prefix: str) -> None:
    result = invoke(redis_url, prefix, "serve", "no-such-stage")
    assert result.exit_code == 1 and "no stage named" in result.stderr


def test_build_job_media_paths_and_uploads(tmp_path: Path) -> None:
    job, uploads = build_job(
        {"prompt": "base", "seed": 1},
        {"task": "fl2va", "seed": 5, "width": None},
        {"first_frame": "/data/first.png", "last_frame": f"upload:{tmp_path}/last.png", "reference_video": None},
    )
    assert job == {"prompt": "base", "seed": 5, "task": "fl2va", "media": {"first_frame": {"path": "/data/first.png"}}}
    assert uploads == {"last_frame": tmp_path / "last.png"}


# -- trace formatting ----------------------------------------------------------------------------------------


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def status_row(t: float, state: RequestState, stage: str, **extra: Any) -> dict[str, Any]:
    status = RequestStatus(request_id="r", state=state, stage=stage, updated_at=t, **extra)
    return {"kind": "status", "state": state.value, "status": status.model_dump(mode="json")}


def log_row(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"kind": "log", "event": {"event": event, "timestamp": iso(t), "request_id": "r", **fields}}


def sample_rows() -> list[tuple[str, dict[str, Any]]]:
    t = 1_700_000_000.0
    timings = [
        StageTiming(stage="encoder", seconds=0.4),
        StageTiming(stage="diffusion", seconds=1.0, transport=Transport.NIXL, payload_bytes=359_024),
    ]
    rows = [
        status_row(t, RequestState.QUEUED, "encoder"),
        status_row(t + 0.1, RequestState.RUNNING, "encoder"),
        log_row(
            t + 0.45,
            "payload.put",
            service="encoder",
            stage="encoder",
            rank=0,
            transport="nixl",
            bytes=359_024,
            seconds=0.002,
        ),
        status_row(t + 0.5, RequestState.QUEUED, "diffusion"),
        status_row(t + 0.6, RequestState.RUNNING, "diffusion"),
        log_row(
            t + 0.7,
            "payload.get",
            service="diffusion",
            stage="diffusion",
            rank=0,
            transport="nixl",
            payload_bytes=359_024,
            transfer_seconds=0.004,
        ),
        status_row(t + 0.9, RequestState.RUNNING, "diffusion", progress={"stage": "diffusion", "step": 4, "total": 8}),
        status_row(t + 1.6, RequestState.DONE, "diffusion", timings=timings),
        {"kind": "mystery"},
    ]
    # Stored out of time order (services flush in batches): the trace sorts by time.
    rows[2], rows[3] = rows[3], rows[2]
    return [(f"{1_700_000_000_000 + i}-0", row) for i, row in enumerate(rows)]


def test_parse_events_orders_by_time_and_reads_fields() -> None:
    events = parse_events(sample_rows())
    names = [ev.event for ev in events]
    assert names == ["status.queued", "status.running", "payload.put", "status.queued", "status.running",
                     "payload.get", "status.running", "status.done"]  # fmt: skip
    get = events[5]
    assert (get.service, get.stage, get.rank, get.transport) == ("diffusion", "diffusion", 0, "nixl")
    assert get.bytes == 359_024 and get.seconds == pytest.approx(0.004)
    assert events[-1].status is not None and events[-1].status.state is RequestState.DONE


def test_hops_merge_progress_and_carry_transports() -> None:
    found = hops(parse_events(sample_rows()))
    assert [(h.state, h.stage) for h in found] == [
        ("queued", "encoder"), ("running", "encoder"), ("queued", "diffusion"), ("running", "diffusion"),
        ("done", "diffusion"),
    ]  # fmt: skip
    assert found[1].seconds == pytest.approx(0.4)
    assert found[1].transports == ("nixl",)
    assert found[3].seconds == pytest.approx(1.0) and found[3].transports == ("nixl",)
    assert found[-1].seconds is None


def test_a_start_folded_into_the_next_one_still_shows_in_the_trace() -> None:
    """A first stage's queued and running are one events row (written by one script): the row's ``folded``
    field, the queued status, still makes its own event and the queue's hop."""
    rows = sample_rows()
    queued, running = rows[0][1], rows[1][1]
    folded_rows = [(rows[1][0], {**running, "folded": json.dumps(queued["status"])}), *rows[2:]]
    assert parse_events(folded_rows) == parse_events([(rows[1][0], queued), (rows[1][0], running), *rows[2:]])
    found = hops(parse_events(folded_rows))
    assert [(h.state, h.stage) for h in found[:2]] == [("queued", "encoder"), ("running", "encoder")]
    assert found[0].seconds == pytest.approx(0.1)  # the time the entry waited for the first stage


def test_format_trace_table() -> None:
    text = format_trace(parse_events(sample_rows()))
    lines = text.splitlines()
    assert lines[0] == "8 events over 1.600 s"
    put = next(line for line in lines if "payload.put" in line)
    assert "encoder" in put and "nixl" in put and "359024" in put and "0.002" in put
    assert "step 4/8" in text
    assert "hops (between status changes):" in text
    assert any("running" in line and "0.400 s" in line and "via nixl" in line for line in lines)
    assert format_trace([]) == "(no events)"


def test_parse_row_accepts_raw_xread_strings() -> None:
    t = time.time()
    row = {"kind": "log", "event": json.dumps({"event": "x", "timestamp": iso(t), "nbytes": "12"})}
    (event,) = parse_events([("1-0", row)])
    assert event.bytes == 12 and event.timestamp == pytest.approx(t, abs=1e-3)
    undated = parse_events([("1700000000123-0", {"kind": "log", "event": "{}"})])[0]
    assert undated.timestamp == pytest.approx(1_700_000_000.123)


def test_trace_table_columns_fit_long_services_and_transports() -> None:
    rows = sample_rows()
    rows.append(("1700000000100-0", log_row(1_700_000_000.8, "nixl.transport", service="diffusion-rank0",
                 stage="diffusion", rank=0, transport="diffusion-vm-1 intra-node cfg#1 remote memory read by "
                 "ucp_get*(multi) into host memory from host: 0..inf zero-copy cma/memory")))  # fmt: skip
    lines = format_trace(parse_events(rows)).splitlines()
    line = next(ln for ln in lines if "nixl.transport" in ln)
    assert "diffusion-rank0 " in line and "intra-node cma/memory" in line and "…" not in line
    header = lines[1]
    assert line.index("intra-node") == header.index("transport")  # the column is as wide as its widest cell


# -- expected failures: one or two lines, a non-zero exit, never a traceback ----------------------------------

UNREACHABLE = "redis://127.0.0.1:1/0"


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a fresh process, with no STAGEFERRY_* from the caller's environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "stageferry", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_up_with_unreachable_redis_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    result = run_cli("--redis-url", UNREACHABLE, "up", cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "ExceptionGroup" not in result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error [")]
    assert len(errors) == 1 and errors[0].startswith("error [control_plane]: the configured Redis does not answer (")
    assert errors[0].endswith("; unset STAGEFERRY_REDIS_URL (or drop --redis-url) and up starts a private one")
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # "outputs: …" and the error
    assert "services:" not in result.stderr and not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize(
    "args",
    [("status", "x"), ("wait", "x", "--timeout", "1"), ("cancel", "x"), ("submit", "--prompt", "a boat"),
     ("health",), ("trace", "x")],
)  # fmt: skip
def test_client_commands_with_unreachable_redis_are_one_line(args: tuple[str, ...], tmp_path: Path) -> None:
    result = invoke(UNREACHABLE, "sf", *args)
    assert result.exit_code == 1, result.output
    # a wait retries the outage until its timeout, logging each retry; the error itself is one line
    lines = [ln for ln in result.stderr.strip().splitlines() if '"event": "request.status_retry"' not in ln]
    assert 1 <= len(lines) <= 2 and "Traceback" not in result.output, result.output
    assert lines[0].startswith(("error [control_plane]", "unhealthy: ")), lines


def test_a_missing_extra_is_named_in_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    (blocker / "uvicorn").mkdir(parents=True)
    (blocker / "uvicorn" / "__init__.py").write_text("raise ModuleNotFoundError('no uvicorn', name='uvicorn')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    result = run_cli("--redis-url", UNREACHABLE, "gateway", cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error [missing_extra]: this command needs uvicorn: pip install 'stageferry[gateway]'"
    ]


# -- trace after `up`: the saved trace, the HTML timeline, and where an unknown id was looked for ------------


def test_trace_reads_the_trace_up_saved_without_flags_and_draws_it(tmp_path: Path) -> None:
    save_trace(tmp_path / "out" / "r.trace.json", "r", sample_rows(), source="redis://127.0.0.1:9/0")
    page = tmp_path / "r.html"
    # No --redis-url and nothing on 6379's side is needed: up's private Redis is gone, the file is there.
    result = run_cli("trace", "r", "--html", str(page), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "payload.put" in result.stdout and "hops (between status changes):" in result.stdout
    text = page.read_text()
    assert "stage encoder" in text and "stage diffusion" in text and "hop encoder → diffusion" in text
    assert "nixl · 359,024 B" in text and "<svg" in text
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def test_trace_of_an_unknown_id_says_where_it_looked(redis_url: str, prefix: str, tmp_path: Path) -> None:
    result = run_cli("--redis-url", redis_url, "--prefix", prefix, "trace", "nope", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error [not_found]: no events for 'nope' in Redis {redis_url} (prefix {prefix!r}) "
        f"and {tmp_path / 'out' / 'nope.trace.json'}"
    )


# -- help ----------------------------------------------------------------------------------------------------


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return dict(group.commands)  # type: ignore[attr-defined]


def test_every_option_of_every_command_says_what_it_does() -> None:
    for name, command in _commands().items():
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert (param.help or "").strip(), f"{name} {param.opts[0]} has no help"


def test_help_shows_ranges_defaults_and_plain_usage() -> None:
    for name in _commands():
        text = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"}).stdout
        assert "<bool>" not in text, name
    status_help = runner.invoke(app, ["status", "--help"]).stdout
    assert "Usage: stageferry status [OPTIONS] REQUEST_ID" in status_help
    submit_help = runner.invoke(app, ["submit", "--help"], env={"COLUMNS": "200"}).stdout
    assert "Job default: 8. Allowed: 1–200." in " ".join(submit_help.split())  # --steps, from the job schema
    main_help = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}).stdout
    assert "redis://127.0.0.1:6379/0" in main_help


def test_hops_ignore_a_hand_off_queued_that_lands_after_the_next_stage_started() -> None:
    t = 1_700_000_000.0
    rows = [
        status_row(t, RequestState.RUNNING, "encoder"),
        status_row(t + 0.5, RequestState.RUNNING, "diffusion"),
        status_row(t + 0.5001, RequestState.QUEUED, "diffusion"),  # written by the encoder, a moment late
        status_row(t + 2.0, RequestState.DONE, "diffusion"),
    ]
    found = hops(parse_events([(f"{1_700_000_000_000 + i}-0", r) for i, r in enumerate(rows)]))
    assert [(h.state, h.stage) for h in found] == [
        ("running", "encoder"),
        ("running", "diffusion"),
        ("done", "diffusion"),
    ]
    assert found[1].seconds == pytest.approx(1.5)


def test_wait_started_while_redis_is_down_retries_until_its_timeout(tmp_path: Path) -> None:
    """``wait --timeout`` started while Redis is down rides the outage out (it gave up after 6 s with
    ``control_plane``): Redis comes back after 10 s, the request ends, and the wait prints it.

    The request is known before the outage (an AOF server, written then stopped): a wait that reconnects
    to a server with no record of it says ``not_found`` at once, which is right, and raced the test's
    write when the record was only written after the restart."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis", appendonly=True)

    async def known_then_down() -> None:
        await server.start()
        async with Client(server.url) as client:
            assert await client.store.set_status(RequestStatus(request_id="w-4", state=RequestState.RUNNING))
        await server.stop()

    anyio.run(known_then_down)
    base = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "stageferry", "--redis-url", server.url, "wait", "w-4", "--timeout", "120"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = time.monotonic()
        wait_for(lambda: proc.poll() is not None or time.monotonic() - started > 10, 30, "the wait to end or last")
        assert proc.poll() is None, proc.communicate()

        async def come_back_and_finish() -> None:
            await server.start()
            async with Client(server.url) as client:
                done = RequestStatus(request_id="w-4", state=RequestState.DONE, result=OutputInfo(location="redis:x"))
                assert await client.store.set_status(done)

        anyio.run(come_back_and_finish)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert json.loads(out)["state"] == "done"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        anyio.run(server.stop)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("submit", "--task", "foo", "--prompt", "x"), "'--task': 'foo' is not one of 't2va', 'fl2va', 'ref2va'"),
        (("submit", "--steps", "many"), "'--steps'"),
        (("no-such-command",), "No such command 'no-such-command'"),
    ],
)
def test_a_command_line_that_does_not_parse_is_one_line(args: tuple[str, ...], says: str, tmp_path: Path) -> None:
    """Not click's usage block: the one-line `error [code]` every other refusal prints."""
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("error [usage]: ") and says in line and "--help" in line, line


def test_a_typo_in_the_pipeline_file_says_what_was_meant(tmp_path: Path) -> None:
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text('[[stages]]\nname = "encoder"\nmodle = "x:factory"\n\n[limits]\nmax_stepz = 3\n')
    result = run_cli("--pipeline", str(pipeline), "plan", cwd=tmp_path)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()  # one line, not pydantic's dump
    assert line.startswith("error [config]: cannot load pipeline config")
    assert "stages.0.modle: unknown key; did you mean `model`?" in line
    assert "limits.max_stepz: unknown key; did you mean `max_steps`?" in line
    assert "pydantic.dev" not in line


def test_submit_timeout_without_wait_is_a_usage_error() -> None:
    """``--timeout`` bounds ``--wait`` only: alone it was accepted and did nothing."""
    done = subprocess.run(
        [sys.executable, "-m", "stageferry", "submit", "--prompt", "x", "--timeout", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith("error [usage]: "), done.stderr
    assert "--timeout bounds the --wait: give --wait too" in done.stderr


def test_status_of_an_unknown_id_says_where_it_looked(redis_url: str, prefix: str) -> None:
    """The Redis and prefix it read (a status asked of the wrong one read as "expired"), no password."""
    result = invoke(redis_url, prefix, "status", "never-submitted")
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"error [not_found]: no request 'never-submitted' in Redis {shown(redis_url)} (prefix {prefix!r}): "
        "unknown or expired"
    )
