"""Client commands: build and submit jobs; follow, wait for, cancel and trace requests."""

from __future__ import annotations

import importlib.resources
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core

from stageferry.broker.control.liveness import unheld_note
from stageferry.broker.control.redis_url import shown
from stageferry.cli.app import _expected_errors, _print_status, _settings, _with_client, app, stderr
from stageferry.cli.display import follow, render_status
from stageferry.client import DEFAULT_REDIS_URL, Client
from stageferry.docgen import allowed
from stageferry.errors import (
    ConfigError,
    ControlPlaneError,
    JobValidationError,
    field_error,
)
from stageferry.schemas import JobRequest, MediaInputs, RequestState, RequestStatus, Task
from stageferry.trace.events import TraceEvent, format_trace, load_saved_trace, saved_trace_path

_JOB_SCHEMA = JobRequest.model_json_schema()


def _job_help(field: str, what: str | None = None) -> str:
    """An option's help from the job schema: what it means, the schema's default and range."""
    prop = _JOB_SCHEMA["properties"][field]
    text = what or prop.get("description", "")
    default = prop.get("default")
    if default not in (None, ""):
        text += f" Job default: {default}."
    if allowed_range := allowed(_JOB_SCHEMA, field):
        text += f" Allowed: {allowed_range}."
    return text.strip()


TaskOpt = Annotated[Task | None, typer.Option("--task", help=_job_help("task"))]
PromptOpt = Annotated[str | None, typer.Option("--prompt", metavar="TEXT", help=_job_help("prompt"))]
WidthOpt = Annotated[int | None, typer.Option("--width", metavar="PX", help=_job_help("width"))]
HeightOpt = Annotated[int | None, typer.Option("--height", metavar="PX", help=_job_help("height"))]
FpsOpt = Annotated[int | None, typer.Option("--fps", help=_job_help("fps"))]
DurationOpt = Annotated[float | None, typer.Option("--duration", metavar="SECONDS", help=_job_help("duration"))]
StepsOpt = Annotated[
    int | None, typer.Option("--steps", help="num_inference_steps: " + _job_help("num_inference_steps"))
]
SeedOpt = Annotated[int | None, typer.Option("--seed", help=_job_help("seed"))]
FlowShiftOpt = Annotated[float | None, typer.Option("--flow-shift", help=_job_help("flow_shift"))]
AudioFlowShiftOpt = Annotated[float | None, typer.Option("--audio-flow-shift", help=_job_help("audio_flow_shift"))]
GuidanceOpt = Annotated[float | None, typer.Option("--guidance", help=_job_help("guidance"))]
NegativePromptOpt = Annotated[
    str | None, typer.Option("--negative-prompt", metavar="TEXT", help=_job_help("negative_prompt"))
]
LoraOpt = Annotated[str | None, typer.Option("--lora", metavar="NAME", help=_job_help("lora"))]
_MEDIA_HELP = (
    "upload:LOCAL_FILE to upload the bytes, or a path the encoder stage reads (only under the deployment's "
    "limits.media_roots) (fl2va: {})."
)
FirstFrameOpt = Annotated[
    str | None, typer.Option("--first-frame", metavar="PATH", help=_MEDIA_HELP.format("required, an image"))
]
LastFrameOpt = Annotated[
    str | None, typer.Option("--last-frame", metavar="PATH", help=_MEDIA_HELP.format("required, an image"))
]
_REF_HELP = (
    "upload:LOCAL_FILE to upload the bytes, or a path the encoder stage reads (only under the deployment's "
    "limits.media_roots) (ref2va: {} or both)."
)
RefVideoOpt = Annotated[
    str | None, typer.Option("--reference-video", metavar="PATH", help=_REF_HELP.format("this, --reference-audio"))
]
RefAudioOpt = Annotated[
    str | None, typer.Option("--reference-audio", metavar="PATH", help=_REF_HELP.format("this, --reference-video"))
]
RequestIdArg = Annotated[
    str, typer.Argument(metavar="REQUEST_ID", help="The id `submit` printed (or X-Request-Id from the gateway).")
]

UPLOAD_SCHEME = "upload:"


def build_job(
    base: dict[str, Any], fields: dict[str, Any], media: dict[str, str | None]
) -> tuple[dict[str, Any], dict[str, Path]]:
    """Job data from a base (``--json``) plus option overrides; media given as ``upload:`` become uploads."""
    job = dict(base)
    job.update({k: v.value if isinstance(v, Task) else v for k, v in fields.items() if v is not None})
    job_media = dict(job.get("media") or {})
    uploads: dict[str, Path] = {}
    for name, value in media.items():
        if value is None:
            continue
        if value.startswith(UPLOAD_SCHEME):
            uploads[name] = Path(value.removeprefix(UPLOAD_SCHEME))
        else:
            job_media[name] = {"path": value}
    if job_media:
        job["media"] = job_media
    return job, uploads


def read_job_json(source: str | None) -> dict[str, Any]:
    """``--json FILE`` (or ``-`` for stdin) as a dict; malformed input is a job validation error."""
    if source is None:
        return {}
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
        data = json.loads(text)
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc.strerror}") from exc
    except ValueError as exc:
        raise JobValidationError(f"malformed JSON in {source}", [field_error("job", str(exc), "json_invalid")]) from exc
    if not isinstance(data, dict):
        raise JobValidationError("the job must be a JSON object", [field_error("job", "not an object", "dict_type")])
    return data


def sample_media(task: Task) -> dict[str, Path]:
    """The bundled sample inputs for ``task`` (none for t2va)."""
    names = {
        Task.FL2VA: ("first_frame", "last_frame"),
        Task.I2VA: ("first_frame",),
        Task.REF2VA: ("reference_video", "reference_audio"),
    }
    root = Path(str(importlib.resources.files("stageferry") / "samples"))
    suffix = {"first_frame": ".png", "last_frame": ".png", "reference_video": ".mp4", "reference_audio": ".wav"}
    return {name: root / f"{name}{suffix[name]}" for name in names.get(task, ())}


def _media(first: str | None, last: str | None, video: str | None, audio: str | None) -> dict[str, str | None]:
    names = list(MediaInputs.model_fields)
    return dict(zip(names, (first, last, video, audio), strict=True))


# -- commands ------------------------------------------------------------------------------------------------


@app.command()
@_expected_errors
def submit(
    ctx: typer.Context,
    task: TaskOpt = None,
    prompt: PromptOpt = None,
    negative_prompt: NegativePromptOpt = None,
    width: WidthOpt = None,
    height: HeightOpt = None,
    fps: FpsOpt = None,
    duration: DurationOpt = None,
    steps: StepsOpt = None,
    seed: SeedOpt = None,
    flow_shift: FlowShiftOpt = None,
    audio_flow_shift: AudioFlowShiftOpt = None,
    guidance: GuidanceOpt = None,
    lora: LoraOpt = None,
    first_frame: FirstFrameOpt = None,
    last_frame: LastFrameOpt = None,
    reference_video: RefVideoOpt = None,
    reference_audio: RefAudioOpt = None,
    json_source: Annotated[
        str | None,
        typer.Option(
            "--json", metavar="FILE", help="Job JSON file, or - for stdin; options given as well override it."
        ),
    ] = None,
    request_id: Annotated[
        str | None,
        typer.Option(
            "--request-id",
            metavar="ID",
            help="Your own request id (a resubmitted id runs once). Default: "
            "generated. Allowed: 1-128 of A-Z a-z 0-9 . _ - (first alphanumeric; no colon).",
        ),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow progress, then print the result.")] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            help="With --wait: give up after this. Default: the pipeline's timeouts.request.",
        ),
    ] = None,
) -> None:
    """Submit a job; prints its request id (with --wait: follows it and prints the final status)."""
    if timeout is not None and not wait:  # it bounds the wait only: without one it would do nothing, silently
        raise typer.BadParameter("--timeout bounds the --wait: give --wait too", param_hint="--timeout")
    fields = {
        "task": task, "prompt": prompt, "negative_prompt": negative_prompt, "width": width, "height": height,
        "fps": fps, "duration": duration,
        "num_inference_steps": steps, "seed": seed, "flow_shift": flow_shift,
        "audio_flow_shift": audio_flow_shift, "guidance": guidance, "lora": lora,
    }  # fmt: skip
    job, uploads = build_job(
        read_job_json(json_source), fields, _media(first_frame, last_frame, reference_video, reference_audio)
    )

    async def act(client: Client) -> RequestStatus | None:
        rid = await client.submit(job, request_id=request_id, uploads=uploads)
        typer.echo(rid)
        if not wait:
            return None
        limit = timeout if timeout is not None else client.pipeline.timeouts.request
        return await follow(client, rid, timeout=limit, console=stderr)

    status = _with_client(ctx, act)
    if status is not None:
        _print_status(status)
        stderr.print(render_status(status), highlight=False)
        if status.state is not RequestState.DONE:
            raise typer.Exit(1)


@app.command()
@_expected_errors
def status(ctx: typer.Context, request_id: RequestIdArg) -> None:
    """Print a request's status as JSON."""

    async def act(client: Client) -> tuple[RequestStatus | None, str | None]:
        found = await client.status(request_id)
        return found, (await unheld_note(client.redis, client.keys, found) if found is not None else None)

    found, note = _with_client(ctx, act)
    if found is None:
        settings = _settings(ctx)
        where = f"Redis {shown(settings.redis_url or DEFAULT_REDIS_URL)} (prefix {settings.prefix!r})"
        typer.echo(f"error [not_found]: no request {request_id!r} in {where}: unknown or expired", err=True)
        raise typer.Exit(1)
    _print_status(found)
    if note is not None:  # stdout stays the status's JSON
        typer.echo(f"note: {note}", err=True)


@app.command("wait")
@_expected_errors
def wait_cmd(
    ctx: typer.Context,
    request_id: RequestIdArg,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", metavar="SECONDS", min=0, help="Give up after this. Default: the pipeline's timeouts.request."
        ),
    ] = None,
    appear_within: Annotated[
        float,
        typer.Option(
            "--appear-within",
            metavar="SECONDS",
            min=0,
            help="How long an unknown id may take to appear (a raw XADD has no status until the first stage "
            "reads it). Default 0: an unknown id ends the wait at once.",
        ),
    ] = 0.0,
) -> None:
    """Block until the request ends; print its status (exit 1 unless it is done).

    Ends at once with ``not_found`` on an id that does not exist, and with ``deadline_exceeded`` after
    the timeout: a wait never blocks forever."""
    final = _with_client(
        ctx,
        lambda c: c.wait(
            request_id,
            timeout=timeout if timeout is not None else c.pipeline.timeouts.request,
            exists_within=appear_within,
        ),
    )
    _print_status(final)
    if final.state is not RequestState.DONE:
        raise typer.Exit(1)


@app.command()
@_expected_errors
def cancel(ctx: typer.Context, request_id: RequestIdArg) -> None:
    """Cancel a request: it stops at the next stage boundary and ends as cancelled."""
    if _with_client(ctx, lambda c: c.cancel(request_id)):
        typer.echo(f"cancel requested for {request_id}")
        return
    typer.echo(f"error [not_cancellable]: {request_id} is unknown or already finished", err=True)
    raise typer.Exit(1)


@app.command()
@_expected_errors
def trace(
    ctx: typer.Context,
    request_id: RequestIdArg,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html", metavar="FILE", help="Also draw the request as a timeline into FILE (self-contained HTML)."
        ),
    ] = None,
) -> None:
    """Print a request's events across all services in time order, with per-hop timings and transports.

    Looks in Redis, and in the trace `stageferry up` saved beside its outputs (<output_dir>/REQUEST_ID.trace.json)."""
    events = _find_trace(ctx, request_id)
    table = format_trace(events)
    typer.echo(table)
    if html is not None:
        from stageferry.trace.html import render_html

        try:
            html.write_text(render_html(events, request_id=request_id, table=table))
        except OSError as exc:
            raise ConfigError(f"cannot write {html}: {exc.strerror}") from exc
        typer.echo(f"timeline: {html}", err=True)


def _find_trace(ctx: typer.Context, request_id: str) -> list[TraceEvent]:
    """The trace from Redis or from the file ``up`` saved; a not_found line saying where it looked.

    With no Redis configured the saved file comes first: ``up``'s private Redis is gone, and the default
    one may not run at all."""
    settings = _settings(ctx)
    saved = saved_trace_path(Path(settings.load_pipeline().output_dir).resolve(), request_id)
    from_file = load_saved_trace(saved) if saved is not None else None
    if from_file and settings.redis_url is None:
        return from_file
    url = settings.redis_url or DEFAULT_REDIS_URL
    try:
        events = _with_client(ctx, lambda c: c.trace(request_id))
    except ControlPlaneError:
        if from_file:
            return from_file
        raise
    if events or from_file:
        return events or from_file or []
    looked = f"Redis {shown(url)} (prefix {settings.prefix!r})" + (f" and {saved}" if saved is not None else "")
    typer.echo(f"error [not_found]: no events for {request_id!r} in {looked}", err=True)
    raise typer.Exit(1)
