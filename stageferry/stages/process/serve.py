"""``stageferry serve <stage>``: which process this one is — a group's supervisor, one rank of a group, or
a one-process replica — decided from the stage's placement before anything heavy is imported.

A supervisor plans, logs the placement and supervises its ranks
(:func:`~stageferry.stages.process.supervisor.supervise`); it imports neither torch nor the stage's code
(:mod:`~stageferry.stages.process.service`), which a rank imports for itself.  So a group's start is its
ranks' start: its supervisor spawned them 2.2 s after its own exec when it imported both (its CPU time on
the 2-core CPU box), about 0.6 s now.  Ranks and one-process replicas run in
:mod:`~stageferry.stages.process.service`.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import structlog

from stageferry.config import PipelineConfig, Settings
from stageferry.errors import ConfigError
from stageferry.logs import configure_logging, flush_native_output
from stageferry.stages.process.placement import Plan, StagePlacement, host_gpus, plan, with_overrides
from stageferry.stages.process.supervisor import RestartPolicy, supervise

log = structlog.get_logger(__name__)


def run_service(
    settings: Settings,
    pipeline: PipelineConfig,
    stage_name: str,
    *,
    tp: int | None = None,
    devices: tuple[int, ...] | None = None,
    gpus: int | None = None,
    supervised: bool = False,
    policy: RestartPolicy | None = None,
) -> int:
    """The ``serve`` command: returns the process exit code.  ``tp``/``devices`` override the stage's
    (``--tp``/``--devices``); ``gpus`` is the host's GPU count (default: the GPUs this process sees).
    A group of several ranks is always supervised (restarted when a rank dies, see :mod:`.supervisor`);
    ``supervised`` puts a one-rank replica under one too.

    The placement is planned here, in the supervisor and again in every rank (the same pure function of
    the same inputs, so they agree): a stage this host cannot run is refused before any rank starts."""
    pipeline = with_overrides(pipeline, stage_name, tp=tp, devices=devices)
    stage = pipeline.stage(stage_name)
    if settings.redis_url is None:
        raise ConfigError("no Redis configured: set STAGEFERRY_REDIS_URL (or use `stageferry up`)")
    # Only this stage must fit here: in a deployment over several hosts the others may run elsewhere.
    the_plan = plan(pipeline, host_gpus() if gpus is None else gpus, strict=False)
    placement = the_plan.stage(stage.name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        if world != stage.world_size:
            raise ConfigError(
                f"WORLD_SIZE={world} but stage {stage.name} has {stage.world_size} ranks ({stage.layout.describe()})"
            )
        from stageferry.stages.process.service import run_rank

        return run_rank(settings, pipeline, stage, placement, rank=int(os.environ["RANK"]))
    in_group = bool(os.environ.get("STAGEFERRY_GROUP_CHILD"))
    if stage.world_size > 1 or (supervised and not in_group):
        configure_logging(
            fmt=settings.log_format, level=settings.log_level, service=f"{stage.name}-group", capture_native=True
        )
        log_placement(the_plan, placement)
        child_env = {
            "STAGEFERRY_REDIS_URL": settings.redis_url,
            "STAGEFERRY_PREFIX": settings.prefix,
            "STAGEFERRY_REPLICA": settings.replica,
            **({"STAGEFERRY_PIPELINE": str(settings.pipeline)} if settings.pipeline else {}),
        }
        args = (*(("--tp", str(tp)) if tp else ()), *(("--devices", ",".join(map(str, devices))) if devices else ()))
        exit_now(supervise(stage.name, stage.world_size, env=child_env, args=args, policy=policy))
    from stageferry.stages.process.service import run_replica

    run_replica(settings, pipeline, stage, the_plan, placement, in_group=in_group)


def log_placement(the_plan: Plan, placement: StagePlacement) -> None:
    """Where this stage's ranks run, and (a warning) which GPUs it shares with other stages."""
    log.info(
        "placement.stage",
        stage=placement.name,
        layout=placement.layout,
        devices=list(placement.devices),
        placed_by=placement.placed_by.value,
        gpus=the_plan.gpus,
        cuda_mps=os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),  # the MPS daemon this process's CUDA reaches, if any
    )
    mine = {gpu: ranks for gpu, ranks in the_plan.shared.items() if gpu in placement.gpus}
    if mine:
        log.warning("placement.shared", stage=placement.name, gpus={str(g): list(r) for g, r in mine.items()})


def exit_now(code: int) -> NoReturn:
    """End a stage process (a rank, or the supervisor once its ranks are reaped) whose own resources (NIXL
    agent, pools, Redis, the report pipe) are closed by now: flush the logs, then skip the interpreter's
    teardown.  That teardown is torch's, UCX's and NIXL's module and C++ clean-up: it can abort (SIGABRT)
    once a peer rank has gone, and it is what kept an idle stage alive for seconds after ``worker.stopped``
    (issue 34 item 15; 1.5-3.3 s on a loaded 2-core box for the imports alone, see docs/reliability.md)."""
    flush_native_output()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


__all__ = ["exit_now", "log_placement", "run_service"]
