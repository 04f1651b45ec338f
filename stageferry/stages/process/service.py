"""One replica of a stage at work — a single process, or one rank of a group in the stage's layout (TP,
TP × SP, HSDP; an aggregated stage is such a group too).  Which of them a ``serve`` process is, or whether
it is a group's supervisor, is decided first (:mod:`stageferry.stages.process.serve`), before this module,
torch and the stage's code are imported.

A replica runs until SIGTERM/SIGINT (it then drains: finishes the entry in hand and exits 0), or until
Redis has been unreachable for longer than ``timeouts.redis_unreachable`` (it then exits non-zero so that
a supervisor restarts it; it never hangs silently).  Under torchrun (``WORLD_SIZE`` set) each process is
one rank.
"""

from __future__ import annotations

import os
import signal
from typing import Any, NoReturn

import anyio
import structlog
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client, wait_until_reachable
from stageferry.broker.data.stage_connectors import build_connectors
from stageferry.config import PipelineConfig, Settings, StageConfig
from stageferry.logs import EventSink, configure_logging
from stageferry.stages.entry.worker import StageWorker
from stageferry.stages.group.group import (
    GroupCompute,
    cpu_threads,
    die_with_parent,
    follow,
    init_group,
    rank_device,
    settle_heap,
)
from stageferry.stages.group.group_channel import GroupChannel
from stageferry.stages.model import input_contract_of, load_model
from stageferry.stages.process.placement import Plan, StagePlacement
from stageferry.stages.process.serve import exit_now, log_placement

log = structlog.get_logger(__name__)


def run_replica(
    settings: Settings,
    pipeline: PipelineConfig,
    stage: StageConfig,
    the_plan: Plan,
    placement: StagePlacement,
    *,
    in_group: bool,
) -> NoReturn:
    """A one-process replica (alone, or the one rank of a supervised replica: ``in_group``) until it
    drains."""
    if in_group:  # the one rank of a supervised replica: dies with its supervisor
        die_with_parent(follower=False)
    configure_logging(fmt=settings.log_format, level=settings.log_level, service=stage.name, capture_native=True)
    log_placement(the_plan, placement)
    stop = StopRequest.install()
    device = rank_device(placement, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    compute = GroupCompute(load_model(stage, pipeline), stage, pipeline, GroupChannel.solo(device))
    anyio.run(serve_leader, settings, pipeline, stage, compute, stop)
    exit_now(0)


def run_rank(
    settings: Settings, pipeline: PipelineConfig, stage: StageConfig, placement: StagePlacement, *, rank: int
) -> int:
    if os.environ.get("STAGEFERRY_GROUP_CHILD"):
        die_with_parent(follower=rank != 0)
    configure_logging(
        fmt=settings.log_format, level=settings.log_level, service=f"{stage.name}-rank{rank}", capture_native=True
    )
    stop = StopRequest.install() if rank == 0 else None  # followers ignore signals (die_with_parent)
    device = rank_device(placement, rank)
    if device.type == "cpu":  # ranks share the host's cores; oversubscribed threads only slow every rank
        torch.set_num_threads(cpu_threads(stage.world_size))
    code = 1
    try:
        channel = init_group(rank, stage.layout, device)
        model = load_model(stage, pipeline)
        if rank == 0:
            compute = GroupCompute(model, stage, pipeline, channel)
            anyio.run(serve_leader, settings, pipeline, stage, compute, stop or StopRequest.install())
        else:
            follow(model, stage, pipeline, channel)
        code = 0
    except Exception:
        log.exception("group.rank_failed", stage=stage.name, rank=rank)
    finally:
        exit_now(code)


class StopRequest:
    """SIGTERM/SIGINT over the leader's whole life, installed before anything slow starts.

    A plain handler that only records the signal (and tells the worker, once there is one, to drain), so
    that a stop during start-up — the group forming, the model loading, Redis unreachable — ends the
    service cleanly instead of killing the leader with -15 and leaving its followers in a broken
    collective.  Later signals are absorbed: a group's supervisor forwards the one its terminal already
    sent, and the entry in hand still finishes."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._worker: StageWorker | None = None

    @classmethod
    def install(cls) -> StopRequest:
        stop = cls()
        signal.signal(signal.SIGTERM, stop._received)
        signal.signal(signal.SIGINT, stop._received)
        return stop

    def _received(self, signum: int, _frame: object) -> None:
        self.signal = self.signal or signal.Signals(signum).name
        if self._worker is not None:
            self._worker.stop()  # sets a flag: safe inside a signal handler

    def attach(self, worker: StageWorker) -> None:
        """From now on a stop drains ``worker`` (at once if one came during start-up)."""
        self._worker = worker
        if self.signal is not None:
            worker.stop()

    async def wait(self) -> str:
        """Return the signal's name once one has come (polled: nothing async runs in the handler)."""
        while self.signal is None:  # noqa: ASYNC110 - set in a signal handler, which must not touch the loop
            await anyio.sleep(0.1)
        return self.signal

    async def cancel_on_stop(self, scope: anyio.CancelScope) -> None:
        await self.wait()
        scope.cancel()


async def _reachable_unless_stopped(redis: Any, pipeline: PipelineConfig, stop: StopRequest) -> bool:
    """Wait for Redis (up to ``timeouts.redis_unreachable``); False when a stop came first."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(stop.cancel_on_stop, tg.cancel_scope)
        await wait_until_reachable(redis, timeout=pipeline.timeouts.redis_unreachable)
        tg.cancel_scope.cancel()
    return stop.signal is None


async def serve_leader(
    settings: Settings,
    pipeline: PipelineConfig,
    stage: StageConfig,
    compute: GroupCompute,
    stop: StopRequest | None = None,
) -> None:
    """The leader: Redis, connectors, the worker loop; the only rank that touches the control and data
    planes.  On exit it releases its followers."""
    assert settings.redis_url is not None
    stop = stop or StopRequest.install()
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    keys = Keys(settings.prefix)
    try:
        async with open_client(settings.redis_url) as redis:
            if not await _reachable_unless_stopped(redis, pipeline, stop):
                log.info("service.stopped_before_start", stage=stage.name, signal=stop.signal)
                return
            connectors = await build_connectors(
                pipeline=pipeline,
                stage=stage,
                redis=redis,
                keys=keys,
                replica=settings.replica,
                device=compute.channel.device,
                address=settings.advertise_address,
            )
            worker = StageWorker(
                redis=redis,
                keys=keys,
                pipeline=pipeline,
                stage=stage,
                replica=settings.replica,
                compute=compute,
                input_connector=connectors.input,
                output_connector=connectors.output,
                input_contract=input_contract_of(compute.model),
            )
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(EventSink(worker.store).run)
                    stop.attach(worker)
                    tg.start_soon(_log_draining, stop)
                    await connectors.start(tg)
                    settle_heap()  # start-up is done: no full collection walks it mid-hop
                    await worker.run()
                    tg.cancel_scope.cancel()
            finally:
                with anyio.CancelScope(shield=True):
                    await connectors.aclose()
    finally:
        with anyio.CancelScope(shield=True):
            await compute.close()
            log.info(
                "group.stopped",
                stage=stage.name,
                layout=stage.layout.describe(),
                rank_calls=compute.rank_calls,
                rank_receipts=compute.rank_receipts,
            )


async def _log_draining(stop: StopRequest) -> None:
    log.info("service.draining", signal=await stop.wait())
