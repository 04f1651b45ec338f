"""``stageferry up``: the whole pipeline on one machine — Redis, one service per stage, one job.

With no Redis configured a private one is started for the run.  Each stage runs as its own
``python -m stageferry serve <stage>`` process (own session, logs in ``<log_dir>/<stage>.log``), as it
would in a deployment; ``up`` waits until every stage has a live worker heartbeat, submits the job,
shows its progress, prints where the output is with each hop's transport and each stage's time, then
stops everything in order: services (SIGTERM, SIGKILL after a bound), then Redis.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import anyio
import redis.asyncio as aioredis
from anyio.abc import Process
from rich.console import Console

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import live_by_stage
from stageferry.broker.control.redis_conn import is_connection_error, ping
from stageferry.cli.display import follow, render_hops, render_status
from stageferry.cli_hints import cli_command, submit_command
from stageferry.client import Client, validate_job, with_upload_refs
from stageferry.config import DEFAULT_STAGES, Limits, PipelineConfig, Settings
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.errors import ControlPlaneError, JobValidationError, StageFailedError, StageferryError
from stageferry.procs import astop
from stageferry.schemas import RequestState, RequestStatus
from stageferry.schemas.validation import check_job_limits
from stageferry.stages.process.mps import MpsMode, decide, start_mps
from stageferry.stages.process.placement import REFERENCE_GPUS, host_gpus, pipeline_for_host, plan
from stageferry.trace.events import save_trace, saved_trace_path

#: The address ``up``'s stages advertise to each other (``STAGEFERRY_ADVERTISE_ADDRESS``): they share this host.
LOOPBACK = "127.0.0.1"


class ServiceGroup:
    """Child service processes, each in its own session (so its TP followers stop with it)."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, *, stop_timeout: float = 15.0) -> None:
        self._env = dict(env)
        self.log_dir = log_dir
        self._stop_timeout = stop_timeout
        self._procs: dict[str, Process] = {}
        self._logs: list[IO[Any]] = []
        self._stopping = False
        self.failure: StageFailedError | None = None

    async def start(self, name: str, argv: Sequence[str]) -> None:
        log_file = await anyio.to_thread.run_sync(self._open_log, name)
        self._procs[name] = await anyio.open_process(
            list(argv), stdin=None, stdout=log_file, stderr=log_file, env=self._env, start_new_session=True
        )

    def _open_log(self, name: str) -> IO[Any]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path(name), "ab")  # noqa: SIM115 - closed in stop()
        self._logs.append(log_file)
        return log_file

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 5) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    async def watch(self, name: str, on_exit: anyio.CancelScope) -> None:
        """Wait for ``name`` to exit; an exit before :meth:`stop` records a failure and cancels ``on_exit``."""
        code = await self._procs[name].wait()
        if not self._stopping:
            self.failure = StageFailedError(
                f"service {name} exited with code {code}; see {self.log_path(name)}:\n{self.log_tail(name)}",
                service=name,
                returncode=code,
            )
            on_exit.cancel()

    async def stop(self) -> None:
        """SIGTERM every service's process group, wait, SIGKILL what is left; shielded; idempotent."""
        if self._stopping:
            return
        self._stopping = True
        with anyio.CancelScope(shield=True):
            await astop(list(self._procs.values()), grace_s=self._stop_timeout, group=True)
            for proc in self._procs.values():
                await proc.aclose()
            for log_file in self._logs:
                log_file.close()


async def _save_trace(client: Client, request_id: str, output_dir: Path, url: str, console: Console) -> None:
    """Keep the request's trace beside the outputs: a private Redis is gone once ``up`` returns, and
    ``stageferry trace`` finds the file there."""
    path = saved_trace_path(output_dir, request_id)
    if path is None:
        return
    try:
        with anyio.fail_after(10):
            rows = await client.store.events(request_id)
        await anyio.to_thread.run_sync(functools.partial(save_trace, path, request_id, rows, source=url))
    except (StageferryError, OSError, TimeoutError) as exc:
        console.print(f"trace not saved: {exc}")
        return
    console.print(f"trace: {cli_command()} trace {request_id}  (saved in {path})", soft_wrap=True, highlight=False)


def precheck(job: dict[str, Any], limits: Limits, uploads: Iterable[str]) -> None:
    """Hold ``job`` (its media the named ``uploads``) to the deployment's ``limits`` as a submission is
    held, before anything is sent: :class:`JobValidationError` naming what is wrong."""
    checked = validate_job(with_upload_refs(job, {name: "precheck" for name in uploads}), limits)
    check_job_limits(checked, limits, upload_prefix="")


#: What a reprompted warm run appends to the job's prompt, once more per run (each run another length).
REPROMPT = " again"


def reprompted(job: dict[str, Any], n: int) -> dict[str, Any]:
    """``job`` with its prompt ``n`` times :data:`REPROMPT` longer: a payload of another structure (the text
    states' length follows the prompt), as a stage serving varied prompts receives on most hops."""
    return {**job, "prompt": f"{job.get('prompt') or ''}{REPROMPT * n}"}


def warm_jobs(
    job: dict[str, Any], runs: int, limits: Limits, uploads: Iterable[str]
) -> tuple[list[dict[str, Any]], int]:
    """The jobs of ``runs`` warm runs and how many of them, first, are the very same job: the first half
    (rounded up), then each :func:`reprompted` once more; all the same job when the longest prompt would be
    past the deployment's ``limits`` (checked as a submission is, before anything is sent)."""
    same = runs - runs // 2
    try:
        precheck(reprompted(job, runs - same), limits, uploads)
    except JobValidationError:
        same = runs
    return [job if i < same else reprompted(job, i - same + 1) for i in range(runs)], same


async def _run_warm(
    client: Client,
    job: dict[str, Any],
    uploads: Mapping[str, Path],
    runs: int,
    first: RequestStatus,
    *,
    timeout: float | None,
    console: Console,
) -> None:
    """Run the job ``runs`` times more and print each hop's first transfer beside the warm ones: the first
    half (rounded up) the very same job, then the rest each with a longer prompt (:func:`reprompted`,
    :func:`~stageferry.cli.display.render_hops`).  A run that does not end done is reported, not counted."""
    console.print(f"running the job {runs} more time{'s' if runs > 1 else ''} (warm hops)")
    jobs, same = warm_jobs(job, runs, client.pipeline.limits, uploads)
    if runs // 2 and same == runs:
        console.print("  (a longer prompt would be past the deployment's limits: every run the same job)")
    warm: list[RequestStatus] = []
    other: list[RequestStatus] = []
    for i, again in enumerate(jobs):
        status = await client.wait(await client.submit(again, uploads=uploads), timeout=timeout)
        if status.state is RequestState.DONE:
            (warm if i < same else other).append(status)
        else:
            console.print(f"  {status.request_id}: {status.state.value}")
    table = render_hops(first, warm, other)
    if table:
        print(table)


async def wait_for_workers(redis: aioredis.Redis, keys: Keys, stages: Sequence[str], *, timeout: float) -> None:
    """Return once every stage has a live worker; :class:`StageFailedError` naming those without."""
    deadline = time.monotonic() + timeout
    while True:
        live = await live_by_stage(redis, keys, stages)
        missing = [s for s in stages if not live[s]]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise StageFailedError(f"no live worker after {timeout:.0f}s for: {', '.join(missing)}", stages=missing)
        await anyio.sleep(0.2)


@dataclass
class _Outcome:
    """What `up` knows of its job so far: its request id once submitted, and the exit status."""

    request_id: str | None = None
    exit_code: int = 1


async def _serve_job(
    client: Client,
    services: ServiceGroup,
    pipeline: PipelineConfig,
    job: dict[str, Any],
    uploads: Mapping[str, Path],
    url: str,
    settings: Settings,
    *,
    serve: bool,
    startup_timeout: float,
    job_timeout: float | None,
    warm_runs: int,
    console: Console,
    on_exit: anyio.CancelScope,
    outcome: _Outcome,
) -> None:
    """Start the services, run the job (and its warm runs), then serve until cancelled if asked; what is
    known of the job goes into ``outcome`` as it comes (a cancelled run keeps it).  A service that exits
    cancels ``on_exit``."""
    async with anyio.create_task_group() as tg:
        for stage in pipeline.stages:
            argv = [sys.executable, "-m", "stageferry", "serve", stage.name]
            await services.start(stage.name, argv)
            tg.start_soon(services.watch, stage.name, on_exit)
        console.print(f"services: {', '.join(s.name for s in pipeline.stages)} (logs in {services.log_dir})")
        await wait_for_workers(client.redis, client.keys, [s.name for s in pipeline.stages], timeout=startup_timeout)
        request_id = outcome.request_id = await client.submit(job, uploads=uploads)
        console.print(f"submitted {request_id}")
        try:
            status = await follow(client, request_id, timeout=job_timeout, console=console)
            print(render_status(status))
            outcome.exit_code = 0 if status.state is RequestState.DONE else 1
            if warm_runs and status.state is RequestState.DONE:
                await _run_warm(client, job, uploads, warm_runs, status, timeout=job_timeout, console=console)
            if serve:
                console.print(f"serving at {url} with prefix {settings.prefix!r}; Ctrl-C to stop")
                hint = submit_command(
                    cli_command(), redis_url=url, prefix=settings.prefix, pipeline=settings.pipeline, job=job
                )
                console.print(f"submit another job: {hint}", soft_wrap=True, markup=False, highlight=False)
                await anyio.sleep_forever()
        finally:
            tg.cancel_scope.cancel()


async def run_up(
    settings: Settings,
    job: dict[str, Any],
    uploads: Mapping[str, Path],
    *,
    serve: bool,
    startup_timeout: float,
    job_timeout: float | None,
    log_dir: Path | None,
    console: Console,
    warm_runs: int = 0,
    mps: MpsMode = MpsMode.AUTO,
) -> int:
    """Run the pipeline and one job; the exit status (0 done, 1 not done, 130 interrupted).

    The placement is planned (and a layout this host cannot run refused) before anything starts; each
    ``serve`` child plans the same from the same file and GPU count.  With ``warm_runs``, the job is run
    that many times more once it is done (the later half with longer prompts: :func:`_run_warm`), and each
    hop's first transfer is shown beside the warm ones.
    Stages placed on one GPU get a private CUDA MPS daemon as ``mps`` says (``stages/process/mps.py``)."""
    gpus = host_gpus()
    pipeline = pipeline_for_host(settings.pipeline, gpus)
    the_plan = plan(pipeline, gpus)
    use_mps = decide(mps, the_plan.shared, os.environ)  # a refusal (--mps on, no daemon) before anything starts
    precheck(job, pipeline.limits, uploads)  # e.g. a task it does not serve: before any start
    output_dir = Path(await anyio.Path(pipeline.output_dir).resolve())  # the services run here too: the same dir
    console.print(f"outputs: {output_dir}")
    outcome = _Outcome()
    # SIGINT and SIGTERM are ours from here to the last clean-up, however many come: the first stops the run
    # (start-up included); later ones wait for the clean-up, which a signal's default action would cut short,
    # leaving the services, the private Redis and the MPS daemon (each in its own session) running.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as guard:
            run = anyio.CancelScope()
            interrupted = False

            async def on_signal() -> None:
                nonlocal interrupted
                async for _ in signals:
                    if interrupted:
                        console.print("still stopping: the services are given their time to end")
                    interrupted = True
                    run.cancel()

            guard.start_soon(on_signal)
            async with contextlib.AsyncExitStack() as stack:
                services: ServiceGroup | None = None
                client: Client | None = None
                with run:
                    url = settings.redis_url
                    if url is None:
                        redis_server = await stack.enter_async_context(EmbeddedRedis())
                        url = redis_server.url
                        console.print(f"redis: private server at {url} (stopped on exit)")
                    env = {
                        **os.environ,
                        "STAGEFERRY_REDIS_URL": url,
                        "STAGEFERRY_PREFIX": settings.prefix,
                        "STAGEFERRY_LOG_FORMAT": "json",
                        "STAGEFERRY_LOG_LEVEL": settings.log_level,
                    }
                    # Every stage is on this host: peers reach each other on loopback (UCX held to `lo`;
                    # shared memory and CUDA IPC are not network devices and still carry the bytes).
                    # Otherwise each agent advertises every interface up when it started, and one that a
                    # container runtime removes meanwhile fails every later handshake with it.
                    env.setdefault("STAGEFERRY_ADVERTISE_ADDRESS", LOOPBACK)
                    if settings.pipeline is not None:
                        env["STAGEFERRY_PIPELINE"] = str(settings.pipeline)  # made absolute by the caller
                    logs = log_dir or output_dir / "logs"
                    # the daemon stops after the services; what it prints goes beside their logs
                    use_mps, mps_env = await start_mps(stack, mps, use_mps, env, logs / "mps-control.txt")
                    env.update(mps_env)
                    if the_plan.shared or mps is MpsMode.ON:
                        console.print(f"cuda mps: {use_mps.reason}")
                    client = await stack.enter_async_context(Client(url, prefix=settings.prefix, pipeline=pipeline))
                    try:  # an unreachable Redis is one line before any service starts
                        await ping(client.redis)
                    except ControlPlaneError as exc:
                        if settings.redis_url is None or not is_connection_error(exc):
                            raise
                        hint = "unset STAGEFERRY_REDIS_URL (or drop --redis-url) and up starts a private one"
                        raise ControlPlaneError(
                            f"the configured Redis does not answer ({exc.message}); {hint}"
                        ) from exc
                    if settings.pipeline is None and gpus and pipeline.stages != DEFAULT_STAGES:
                        console.print(
                            f"pipeline: built-in default fitted to {gpus} GPU{'s' if gpus > 1 else ''} "
                            f"(the reference TP2 → TP4 needs {REFERENCE_GPUS}; give --pipeline to choose)"
                        )
                    console.print(f"placement: {the_plan.summary()}")  # planned (or refused) above
                    services = ServiceGroup(env, logs)
                    stack.push_async_callback(services.stop)
                    await _serve_job(
                        client, services, pipeline, job, uploads, url, settings, serve=serve,
                        startup_timeout=startup_timeout, job_timeout=job_timeout, warm_runs=warm_runs,
                        console=console, on_exit=run, outcome=outcome,
                    )  # fmt: skip
                if services is not None:
                    await services.stop()  # their last events reach the trace before it is saved
                if outcome.request_id is not None and client is not None:
                    await _save_trace(client, outcome.request_id, output_dir, str(client.url), console)
                if services is not None and services.failure is not None:
                    raise services.failure
                if interrupted:
                    console.print("interrupted: stopping services")
                    outcome.exit_code = 130 if not serve else outcome.exit_code
            guard.cancel_scope.cancel()
    return outcome.exit_code


__all__ = ["ServiceGroup", "run_up", "wait_for_workers"]
