"""The ``stageferry`` command: submit and follow jobs, read traces, run stage services or a whole pipeline.

Global options (``--redis-url``, ``--prefix``, ``--pipeline``) override the ``STAGEFERRY_*`` environment.
Expected errors (every :class:`StageferryError`) print one ``error [code]: message`` line on stderr and
exit 1; stdout carries only results (request ids, JSON, tables), so that scripts can use it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.resources
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import anyio
import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console

from stageferry.acl import acl_file
from stageferry.client import DEFAULT_REDIS_URL, Client
from stageferry.config import Settings
from stageferry.console import error_line, follow, render_status
from stageferry.docgen import allowed
from stageferry.errors import (
    ConfigError,
    ControlPlaneError,
    JobValidationError,
    expected_error,
    field_error,
    leaf_errors,
)
from stageferry.logs import configure_logging
from stageferry.schemas import JobRequest, MediaInputs, RequestState, RequestStatus, Task
from stageferry.schemas.job import REQUEST_ID_PATTERN, TENANT_PATTERN, TENANT_SEPARATOR
from stageferry.trace import TraceEvent, format_trace, load_saved_trace, saved_trace_path


class _Command(typer.core.TyperCommand):
    """Usage lines name arguments plainly (``REQUEST_ID``), not in typer's braces (``{REQUEST_ID}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in pieces]


class _App(typer.Typer):
    """Every command, whoever adds it, gets :class:`_Command`."""

    def command(self, *args: Any, cls: type[typer.core.TyperCommand] | None = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    name="stageferry",
    help="Disaggregated multimodal generation: Redis Streams control plane, NIXL data plane.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # plain help: flags show no `<bool>` value, defaults and ranges in brackets
)
stderr = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class _Overrides:
    redis_url: str | None
    prefix: str | None
    pipeline: Path | None


@app.callback()
def _global_options(
    ctx: typer.Context,
    redis_url: Annotated[
        str | None,
        typer.Option(
            "--redis-url",
            metavar="URL",
            help=f"Redis URL, redis:// or rediss:// (env STAGEFERRY_REDIS_URL). Default: {DEFAULT_REDIS_URL} for"
            " client commands; `up` starts a private server; `serve` and `gateway` need one.",
        ),
    ] = None,
    prefix: Annotated[
        str | None,
        typer.Option(
            "--prefix",
            metavar="P",
            help="Key prefix (env STAGEFERRY_PREFIX). Default: sf. Allowed: 1-64 of A-Z a-z 0-9 _ . { } -.",
        ),
    ] = None,
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline",
            metavar="FILE",
            help="Pipeline TOML file (env STAGEFERRY_PIPELINE). Default: the built-in encoder TP2 ->"
            " diffusion TP4, fitted to this host's GPUs by up/serve/plan (docs/placement.md).",
        ),
    ] = None,
) -> None:
    ctx.obj = _Overrides(redis_url, prefix, pipeline)


def _settings(ctx: typer.Context) -> Settings:
    """Environment settings with the command line's overrides applied."""
    given = ctx.obj if isinstance(ctx.obj, _Overrides) else _Overrides(None, None, None)
    overrides = {k: v for k, v in dataclasses.asdict(given).items() if v is not None}
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(f"bad settings: {exc.errors(include_url=False)[0]['msg']}") from exc


def _expected_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn expected errors into one line on stderr and a non-zero exit, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BaseException as exc:
            leaves = leaf_errors(exc)  # a task group wraps what its tasks raised
            if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
                typer.echo("interrupted", err=True)
                raise typer.Exit(130) from None
            if (error := expected_error(exc)) is not None:
                typer.echo(error_line(error), err=True)
                raise typer.Exit(1) from None
            if (missing := _missing_extra(leaves)) is not None:
                typer.echo(missing, err=True)
                raise typer.Exit(1) from None
            raise

    return wrapper


#: Top-level modules of the optional extras, and the extra that brings each.
_EXTRA_OF = {
    "torch": "stage", "nixl": "stage", "av": "stage", "numpy": "stage", "PIL": "stage",
    "prometheus_client": "stage", "fastapi": "gateway", "uvicorn": "gateway", "multipart": "gateway",
    "python_multipart": "gateway", "starlette": "gateway",
}  # fmt: skip


def _missing_extra(leaves: list[BaseException]) -> str | None:
    """One line naming the extra to install, when a command needs a module that is not installed."""
    for leaf in leaves:
        if isinstance(leaf, ModuleNotFoundError) and (root := (leaf.name or "").split(".")[0]) in _EXTRA_OF:
            extra = _EXTRA_OF[root]
            return f"error [missing_extra]: this command needs {root}: pip install 'stageferry[{extra}]'"
    return None


def _with_client(ctx: typer.Context, action: Callable[[Client], Awaitable[R]]) -> R:
    """Run ``action`` with a client for the configured deployment, in a fresh event loop."""
    settings = _settings(ctx)
    configure_logging(fmt=settings.log_format, level=settings.log_level, service="cli")

    async def run() -> R:
        async with Client.from_settings(settings) as client:
            return await action(client)

    return anyio.run(run)


def _print_status(status: RequestStatus) -> None:
    typer.echo(status.model_dump_json(indent=2))


# -- job options, shared by `submit` and `up` -------------------------------------------------------------

_JOB_SCHEMA = JobRequest.model_json_schema()


def _job_help(field: str, what: str | None = None) -> str:
    """An option's help from the job schema: what it means, the schema's default and range."""
    prop = _JOB_SCHEMA["properties"][field]
    text = what or prop.get("description", "")
    default = prop.get("default")
    if default is not None:
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
    names = {Task.FL2VA: ("first_frame", "last_frame"), Task.REF2VA: ("reference_video", "reference_audio")}
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
    fields = {
        "task": task, "prompt": prompt, "width": width, "height": height, "fps": fps, "duration": duration,
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
    found = _with_client(ctx, lambda c: c.status(request_id))
    if found is None:
        typer.echo(f"error [not_found]: no request {request_id!r} (unknown or expired)", err=True)
        raise typer.Exit(1)
    _print_status(found)


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


class SchemaName(enum.StrEnum):
    JOB = "job"
    PAYLOAD = "payload"


class SchemaFormat(enum.StrEnum):
    JSON = "json"
    MARKDOWN = "markdown"


@app.command()
def schema(
    name: Annotated[
        SchemaName,
        typer.Argument(
            help="job: a job request (the job field of a raw XADD); payload: the encoder → diffusion payload contract."
        ),
    ] = SchemaName.JOB,
    fmt: Annotated[SchemaFormat, typer.Option("--format", help="payload only: json, or the docs' markdown tables.")] = (
        SchemaFormat.JSON
    ),
) -> None:
    """Print a wire format: the JSON Schema of a job request (what the job field of a raw XADD must
    satisfy; its ``x-stageferry-entry`` member gives the rule for the entry's ``request_id`` and tenant
    prefixes), or the conditioning payload contract."""
    if name is SchemaName.JOB:
        typer.echo(json.dumps(job_schema(), indent=2))
        return
    from stageferry.schemas.payload_contract import CONDITIONING
    from stageferry.schemas.payload_contract_doc import contract_json, contract_markdown

    if fmt is SchemaFormat.MARKDOWN:
        typer.echo(contract_markdown(CONDITIONING), nl=False)
    else:
        typer.echo(json.dumps(contract_json(CONDITIONING), indent=2))


def job_schema() -> dict[str, Any]:
    """The job's JSON Schema, plus (as an extension member) the rules for the rest of a raw entry."""
    out = JobRequest.model_json_schema()
    out["x-stageferry-entry"] = {
        "request_id": {
            "type": "string",
            "pattern": REQUEST_ID_PATTERN,
            "description": "letters, digits, '_', '.', '-'; no ':'; 1-128 characters, starting alphanumeric",
        },
        "tenant": {
            "type": "string",
            "pattern": TENANT_PATTERN,
            "description": f"a tenant's request ids are '<tenant>{TENANT_SEPARATOR}<rest>'",
        },
        "refusal": "HGETALL <prefix>:refused:<entry id> (tenant: <prefix>:refused:<tenant>.<entry id>)",
    }
    return out


@app.command()
@_expected_errors
def acl(
    ctx: typer.Context,
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", help="A tenant (repeatable); default: the pipeline's.")
    ] = None,
) -> None:
    """Print the Redis ACL users for this deployment (redis.conf syntax; passwords CHANGE-ME): the
    services' user and least-privilege client users, one per tenant."""
    settings = _settings(ctx)
    pipeline = settings.load_pipeline()
    tenants = tenant if tenant else list(pipeline.security.tenants)
    typer.echo(acl_file(settings.prefix, pipeline.stages[0].name, tenants=tenants), nl=False)


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
        from stageferry.trace_html import render_html

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
    looked = f"Redis {url} (prefix {settings.prefix!r})" + (f" and {saved}" if saved is not None else "")
    typer.echo(f"error [not_found]: no events for {request_id!r} in {looked}", err=True)
    raise typer.Exit(1)


@app.command()
@_expected_errors
def health(
    ctx: typer.Context,
    stage: Annotated[
        str | None, typer.Option("--stage", help="Also require this replica's worker heartbeat for STAGE.")
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", metavar="SECONDS", help="Wait this long for Redis.")] = 5.0,
) -> None:
    """Container health check: exit 0 when Redis answers and, with --stage, this replica's heartbeat is fresh.

    The replica is STAGEFERRY_REPLICA (the hostname by default), as for `serve`.
    """
    settings = _settings(ctx)
    from stageferry.health import check_health

    problem = anyio.run(functools.partial(check_health, settings, stage=stage, timeout=timeout))
    if problem is not None:
        typer.echo(f"unhealthy: {problem}", err=True)
        raise typer.Exit(1)
    typer.echo("ok")


DevicesOpt = Annotated[
    str | None,
    typer.Option("--devices", help="GPU indices for the ranks, e.g. 2,3,4,5 or 2-5 (overrides the stage's devices)."),
]


@app.command()
@_expected_errors
def serve(
    ctx: typer.Context,
    stage: Annotated[
        str, typer.Argument(metavar="STAGE", help="A stage of the pipeline file (default: encoder, diffusion).")
    ],
    tp: Annotated[
        int | None, typer.Option("--tp", min=1, max=64, help="Run the stage as TP N instead of its layout in the file.")
    ] = None,
    devices: DevicesOpt = None,
    supervise: Annotated[
        bool,
        typer.Option(
            "--supervise/--no-supervise",
            help="Run a one-rank replica under a supervisor that restarts it when it dies (groups always are).",
        ),
    ] = False,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            min=0,
            help="Consecutive group restarts (backoff 1 s doubling to 30 s; reset after 60 s healthy) before "
            "giving up with exit 1; 0 never restarts.",
        ),
    ] = 5,
) -> None:
    """Run one replica of a stage service until SIGTERM/SIGINT; a group restarts itself when a rank dies."""
    settings = _settings(ctx)
    from stageferry.stages.placement import host_gpus, parse_devices, pipeline_for_host

    gpus = host_gpus()
    pipeline = pipeline_for_host(settings.pipeline, gpus)
    pipeline.stage(stage)  # an unknown stage is a config error before anything starts
    from stageferry.stages.service import run_service
    from stageferry.stages.supervisor import RestartPolicy

    gpu_list = parse_devices(devices) if devices is not None else None
    policy = RestartPolicy(max_restarts=max_restarts)
    raise typer.Exit(
        run_service(settings, pipeline, stage, tp=tp, devices=gpu_list, gpus=gpus, supervised=supervise, policy=policy)
    )


@app.command("plan")
@_expected_errors
def plan_cmd(
    ctx: typer.Context,
    gpus: Annotated[
        int | None, typer.Option("--gpus", min=0, max=1024, help="Plan for this many GPUs (default: this host's).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Print where `up` and `serve` would run every rank of every stage, without starting anything:
    devices, process groups and pools.  A layout this host cannot run exits 1 with the reason."""
    settings = _settings(ctx)
    from stageferry.stages.placement import host_gpus, pipeline_for_host, plan

    count = host_gpus() if gpus is None else gpus
    pipeline = pipeline_for_host(settings.pipeline, count)
    the_plan = plan(pipeline, count)
    source = str(settings.pipeline) if settings.pipeline is not None else f"built-in default for {count} GPUs"
    if as_json:
        typer.echo(json.dumps({"pipeline": source, **the_plan.to_json()}, indent=2))
    else:
        typer.echo(f"pipeline: {source}\n{the_plan.render()}")


@app.command()
@_expected_errors
def up(
    ctx: typer.Context,
    task: TaskOpt = Task.T2VA,
    prompt: PromptOpt = "a paper boat drifting down a rain-soaked street, rain drumming on tin roofs",
    width: WidthOpt = 320,
    height: HeightOpt = 192,
    fps: FpsOpt = None,
    duration: DurationOpt = None,
    steps: StepsOpt = None,
    seed: SeedOpt = None,
    first_frame: FirstFrameOpt = None,
    last_frame: LastFrameOpt = None,
    reference_video: RefVideoOpt = None,
    reference_audio: RefAudioOpt = None,
    serve_forever: Annotated[bool, typer.Option("--serve", help="Keep running after the job, until Ctrl-C.")] = False,
    startup_timeout: Annotated[
        float, typer.Option("--startup-timeout", metavar="SECONDS", help="Wait this long for every stage's heartbeat.")
    ] = 120.0,
    timeout: Annotated[
        float | None, typer.Option("--timeout", metavar="SECONDS", help="Wait this long for the job to end.")
    ] = 600.0,
    log_dir: Annotated[
        Path | None, typer.Option("--log-dir", metavar="DIR", help="Service logs. Default: <output_dir>/logs.")
    ] = None,
) -> None:
    """Run the whole pipeline here (a private Redis if none is configured) and one job through it."""
    settings = _settings(ctx)
    if settings.pipeline is not None:  # the services run with the same file wherever they start
        settings = settings.model_copy(update={"pipeline": settings.pipeline.resolve()})
    configure_logging(fmt=settings.log_format, level=settings.log_level, service="up")
    fields = {
        "task": task, "prompt": prompt, "width": width, "height": height, "fps": fps, "duration": duration,
        "num_inference_steps": steps, "seed": seed,
    }  # fmt: skip
    media = _media(first_frame, last_frame, reference_video, reference_audio)
    if not any(media.values()):  # fl2va and ref2va need media: the bundled samples, uploaded
        media = {name: f"upload:{path}" for name, path in sample_media(Task(task or Task.T2VA)).items()}
    job, uploads = build_job({}, fields, media)
    from stageferry.launcher import run_up

    code = anyio.run(
        functools.partial(
            run_up, settings, job, uploads, serve=serve_forever, startup_timeout=startup_timeout,
            job_timeout=timeout, log_dir=log_dir, console=stderr,
        )
    )  # fmt: skip
    raise typer.Exit(code)


@app.command()
@_expected_errors
def gateway(
    ctx: typer.Context,
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port to listen on.")] = 8091,
    sync_timeout: Annotated[
        float | None, typer.Option("--sync-timeout", help="Seconds /v1/videos/sync waits (default: timeouts.request).")
    ] = None,
    model_name: Annotated[str, typer.Option("--model-name", help="`model` in answers.")] = "stageferry",
    metrics_url: Annotated[
        list[str] | None,
        typer.Option("--metrics-url", help="A stage's /metrics URL for the console's counters (repeatable)."),
    ] = None,
    output_dir: Annotated[
        str | None,
        typer.Option("--output-dir", help="Result files served from here only (default: the pipeline's output_dir)."),
    ] = None,
) -> None:
    """Serve the vLLM-Omni compatible HTTP API (/v1/videos, /v1/videos/sync, /health, /metrics) and the web
    console at /.  Set STAGEFERRY_GATEWAY_TOKEN to require a bearer token."""
    settings = _settings(ctx)
    configure_logging(fmt=settings.log_format, level=settings.log_level, service="gateway")
    from stageferry.gateway import GatewayConfig, serve

    config = GatewayConfig.from_settings(
        settings,
        sync_timeout_s=sync_timeout,
        model_name=model_name,
        metrics_urls=tuple(metrics_url or ()),
        output_dir=output_dir,
    )
    serve(config, host=host, port=port, log_level=settings.log_level)


@app.command()
@_expected_errors
def chaos(
    requests: Annotated[int, typer.Option("--requests", min=1, help="Jobs to submit (mixed tasks).")] = 200,
    seed: Annotated[int | None, typer.Option("--seed", help="Fault plan and job mix (random if unset).")] = None,
    replicas: Annotated[int, typer.Option("--replicas", min=1, help="Replicas per stage.")] = 2,
    enc_tp: Annotated[int, typer.Option("--enc-tp", min=1, max=64, help="TP size of each encoder replica.")] = 2,
    dif_tp: Annotated[int, typer.Option("--dif-tp", min=1, max=64, help="TP size of each diffusion replica.")] = 4,
    window: Annotated[float | None, typer.Option("--window", help="Seconds to submit over (0.6 s/job).")] = None,
    faults: Annotated[int | None, typer.Option("--faults", min=0, help="Faults of each kind (default 2).")] = None,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Logs and Redis data (kept).")] = None,
) -> None:
    """Fault-injection soak: the pipeline on a private AOF Redis under random SIGKILLs, Redis restarts
    and stalls; prints the summary table and exits 1 if anything was lost, duplicated or stuck."""
    from stageferry.chaos.faults import FaultKind
    from stageferry.chaos.soak import SoakConfig, render, run_soak

    configure_logging(fmt="auto", level="warning", service="chaos")
    cfg = SoakConfig(requests=requests, seed=seed, replicas=replicas, enc_tp=enc_tp, dif_tp=dif_tp, window_s=window)
    if faults is not None:
        cfg.faults = {kind: faults for kind in FaultKind}
    cfg.work_dir = work_dir
    typer.echo(f"chaos soak: {requests} requests, seed {cfg.seed if seed is not None else '(drawn)'}", err=True)
    result = anyio.run(run_soak, cfg)
    typer.echo(render(result))
    if not result.audit.ok:
        typer.echo(f"soak FAILED; logs in {result.work_dir}", err=True)
        raise typer.Exit(1)


def main() -> None:
    """Console entry point (``stageferry`` and ``python -m stageferry``)."""
    app(prog_name="stageferry")


__all__ = ["app", "build_job", "main", "read_job_json"]
