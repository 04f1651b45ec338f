"""Operator commands: schemas, ACL files, health, serving a stage, planning placement, ``up``, the
gateway and the chaos soak."""

from __future__ import annotations

import enum
import functools
import json
from pathlib import Path
from typing import Annotated, Any

import anyio
import typer
import typer.core

from stageferry.acl import acl_file, default_maxmemory, redis_db
from stageferry.cli.app import _expected_errors, _settings, app, stderr
from stageferry.cli.jobs import (
    DurationOpt,
    FirstFrameOpt,
    FpsOpt,
    HeightOpt,
    LastFrameOpt,
    PromptOpt,
    RefAudioOpt,
    RefVideoOpt,
    SeedOpt,
    StepsOpt,
    TaskOpt,
    WidthOpt,
    _media,
    build_job,
    sample_media,
)
from stageferry.client import DEFAULT_REDIS_URL
from stageferry.logs import configure_logging
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.job import REQUEST_ID_PATTERN, TENANT_PATTERN, TENANT_SEPARATOR
from stageferry.schemas.submission import TICKET_PATTERN, Submission
from stageferry.stages.process.mps import MpsMode


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
        "ticket": {"type": "string", "pattern": TICKET_PATTERN, "description": "128 random bits, hex"},
        "submission": Submission.model_json_schema(),
        "intake": "RPUSH <prefix>:stage:<first stage>:submit <submission JSON> (tenant: ...:submit:<tenant>)",
        "refusal": "HGETALL <prefix>:refused:<ticket> (tenant: <prefix>:refused:<tenant>.<ticket>)",
    }
    return out


@app.command()
@_expected_errors
def acl(
    ctx: typer.Context,
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", help="A tenant (repeatable); default: the pipeline's.")
    ] = None,
    maxmemory: Annotated[
        int | None,
        typer.Option("--maxmemory", metavar="BYTES", help="Redis's memory bound; default: sized from the limits."),
    ] = None,
    scaler: Annotated[
        bool, typer.Option("--scaler", help="Also an autoscaler's user (KEDA): the stage streams' backlog only.")
    ] = False,
    sentinel: Annotated[
        bool, typer.Option("--sentinel", help="Also the replicas' and the sentinels' users (a Sentinel group).")
    ] = False,
) -> None:
    """Print the Redis config for this deployment (redis.conf syntax; passwords CHANGE-ME): maxmemory with
    noeviction, the services' user and least-privilege client users, one per tenant, held to the
    database of STAGEFERRY_REDIS_URL (0 by default); with ``--sentinel``, the users a Sentinel group's
    replicas and sentinels log in as (load the file on every data node)."""
    settings = _settings(ctx)
    pipeline = settings.load_pipeline()
    tenants = tenant if tenant else list(pipeline.security.tenants)
    db = redis_db(settings.redis_url or DEFAULT_REDIS_URL)
    limits = pipeline.limits
    memory = maxmemory or default_maxmemory(
        max_upload_bytes=limits.max_upload_bytes, max_entry_bytes=limits.max_entry_bytes
    )
    first = pipeline.stages[0].name
    text = acl_file(settings.prefix, first, tenants=tenants, db=db, maxmemory=memory, scaler=scaler, sentinel=sentinel)
    typer.echo(text, nl=False)


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
    from stageferry.cli.health import check_health

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
    from stageferry.stages.process.placement import host_gpus, parse_devices, pipeline_for_host

    gpus = host_gpus()
    pipeline = pipeline_for_host(settings.pipeline, gpus)
    pipeline.stage(stage)  # an unknown stage is a config error before anything starts
    from stageferry.stages.process.serve import run_service
    from stageferry.stages.process.supervisor import RestartPolicy

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
    from stageferry.stages.process.placement import host_gpus, pipeline_for_host, plan

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
    warm_runs: Annotated[
        int,
        typer.Option(
            "--warm-runs",
            min=0,
            max=20,
            help="Run the job this many times more and show each hop's first transfer beside the warm ones "
            "(from 2 on, the later half with longer prompts: payloads of another structure, as varied prompts send).",
        ),
    ] = 1,
    mps: Annotated[
        MpsMode,
        typer.Option(
            "--mps",
            case_sensitive=False,
            help="CUDA MPS for stages placed on one GPU: auto starts a private daemon when the plan shares a GPU "
            "and nvidia-cuda-mps-control is on PATH (the same-GPU copy then skips the context switch).",
        ),
    ] = MpsMode.AUTO,
) -> None:
    """Run the whole pipeline here (a private Redis if none is configured) and one job through it."""
    settings = _settings(ctx)
    if settings.pipeline is not None:  # the services run with the same file wherever they start
        settings = settings.model_copy(update={"pipeline": settings.pipeline.resolve()})
    # up's own events (embedded_redis.started, ...) would interleave raw log lines with its console
    # output: only warnings and errors show, unless a log level was asked for (the services log to files)
    level = settings.log_level if "log_level" in settings.model_fields_set else "warning"
    configure_logging(fmt=settings.log_format, level=level, service="up")
    fields = {
        "task": task, "prompt": prompt, "width": width, "height": height, "fps": fps, "duration": duration,
        "num_inference_steps": steps, "seed": seed,
    }  # fmt: skip
    media = _media(first_frame, last_frame, reference_video, reference_audio)
    if not any(media.values()):  # fl2va and ref2va need media: the bundled samples, uploaded
        media = {name: f"upload:{path}" for name, path in sample_media(Task(task or Task.T2VA)).items()}
    job, uploads = build_job({}, fields, media)
    from stageferry.cli.launcher import run_up

    code = anyio.run(
        functools.partial(
            run_up, settings, job, uploads, serve=serve_forever, startup_timeout=startup_timeout,
            job_timeout=timeout, log_dir=log_dir, console=stderr, warm_runs=warm_runs, mps=mps,
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
    faults: Annotated[
        int | None, typer.Option("--faults", min=0, help="Faults of each kind (default 2; empty_restart 1).")
    ] = None,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Logs and Redis data (kept).")] = None,
    sentinel: Annotated[
        bool,
        typer.Option(
            "--sentinel",
            help="Redis as a Sentinel group (1 primary, 2 replicas, 3 sentinels) under failover faults: kill -9 "
            "the primary, SENTINEL FAILOVER, a network cut of the primary (iptables; needs root).",
        ),
    ] = False,
    wait_replicas: Annotated[
        int | None, typer.Option("--wait-replicas", min=0, max=2, help="With --sentinel: replicas a write waits for.")
    ] = None,
    streamed: Annotated[
        float,
        typer.Option(
            "--streamed",
            min=0.0,
            max=0.9,
            help="Share of jobs whose encoder streams chunks into the diffusion stage (docs/streaming.md).",
        ),
    ] = 0.15,
) -> None:
    """Fault-injection soak: the pipeline on a private AOF Redis under random SIGKILLs, Redis restarts
    and stalls (with ``--sentinel``: on a Sentinel group under failovers, timed); prints the summary table
    and exits 1 if anything was lost, duplicated or stuck, 2 if nothing was but a planned fault was missed
    (it had nothing to hit: the run did not test it)."""
    from stageferry.chaos.faults import FAILOVER_KINDS, FaultKind
    from stageferry.chaos.soak import FAILOVER_FAULTS, SoakConfig, render, run_soak

    configure_logging(fmt="auto", level="warning", service="chaos")
    cfg = SoakConfig(
        requests=requests, seed=seed, replicas=replicas, enc_tp=enc_tp, dif_tp=dif_tp, window_s=window,
        sentinel=sentinel, wait_replicas=wait_replicas, streamed=streamed,
    )  # fmt: skip
    if sentinel:
        cfg.faults = dict(FAILOVER_FAULTS) if faults is None else {kind: faults for kind in FAILOVER_KINDS}
    elif faults is not None:
        cfg.faults = {kind: faults for kind in FaultKind if kind not in FAILOVER_KINDS}
    cfg.work_dir = work_dir
    typer.echo(f"chaos soak: {requests} requests, seed {cfg.seed if seed is not None else '(drawn)'}", err=True)
    result = anyio.run(run_soak, cfg)
    typer.echo(render(result))
    if result.verdict == "FAIL":
        typer.echo(f"soak FAILED; logs in {result.work_dir}", err=True)
        raise typer.Exit(1)
    if result.verdict == "INCOMPLETE":
        typer.echo(f"soak INCOMPLETE: {len(result.faults.misses)} faults had nothing to hit; logs in {result.work_dir}",
                   err=True)  # fmt: skip
        raise typer.Exit(2)


from stageferry.cli import kube as _kube  # noqa: E402,F401 - registers `stageferry kube`, after these commands
