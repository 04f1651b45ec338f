"""``stageferry serve <stage>``: one stage service — model, connectors, worker loop, signals.

The service runs until SIGTERM/SIGINT (it then drains: finishes the entry in hand and exits 0), or
until Redis has been unreachable for longer than ``timeouts.redis_unreachable`` (it then exits
non-zero so that a supervisor restarts it; it never hangs silently).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch

from stageferry.broker.connectors import build_connectors
from stageferry.broker.keys import Keys
from stageferry.broker.redis_conn import open_client, wait_until_reachable
from stageferry.config import PipelineConfig, Settings, StageConfig
from stageferry.errors import ConfigError, StageFailedError, StageferryError
from stageferry.logs import EventSink, configure_logging
from stageferry.stages.model import StageContext, StageModel, load_model
from stageferry.stages.worker import Compute, ProgressSink, StageWorker, WorkItem

log = structlog.get_logger(__name__)


def local_compute(model: StageModel, stage: StageConfig, pipeline: PipelineConfig, device: torch.device) -> Compute:
    """A single-rank group: run the model in a worker thread, model errors become ``stage_failed``."""

    async def compute(item: WorkItem, progress: ProgressSink) -> Any:
        ctx = StageContext(
            stage=stage.name,
            rank=0,
            world_size=1,
            device=device,
            request_id=item.request_id,
            key=item.key,
            output_dir=Path(pipeline.output_dir),
            report_progress=progress.report,
            is_cancelled=lambda: progress.cancelled,
            media=item.media,
        )
        try:
            return await anyio.to_thread.run_sync(model, item.job, item.payload, ctx)
        except StageferryError:
            raise
        except Exception as exc:
            raise StageFailedError(f"{stage.name} model failed: {type(exc).__name__}: {exc}") from exc

    return compute


async def serve(settings: Settings, pipeline: PipelineConfig, stage_name: str, *, tp: int | None = None) -> None:
    """Run one replica of ``stage_name`` until signalled."""
    configure_logging(fmt=settings.log_format, level=settings.log_level, service=f"{stage_name}")
    stage = pipeline.stage(stage_name)
    if tp is not None and tp != stage.tp:
        stage = stage.model_copy(update={"tp": tp})
    if settings.redis_url is None:
        raise ConfigError("no Redis configured: set STAGEFERRY_REDIS_URL (or use `stageferry up`)")
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    device = torch.device("cpu")
    model = await anyio.to_thread.run_sync(load_model, stage, pipeline)
    keys = Keys(settings.prefix)
    async with open_client(settings.redis_url) as redis:
        await wait_until_reachable(redis, timeout=pipeline.timeouts.redis_unreachable)
        connectors = await build_connectors(
            pipeline=pipeline, stage=stage, redis=redis, keys=keys, replica=settings.replica, device=device
        )
        worker = StageWorker(
            redis=redis,
            keys=keys,
            pipeline=pipeline,
            stage=stage,
            replica=settings.replica,
            compute=local_compute(model, stage, pipeline, device),
            input_connector=connectors.input,
            output_connector=connectors.output,
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(EventSink(worker.store).run)
                tg.start_soon(_drain_on_signal, worker)
                await connectors.start(tg)
                await worker.run()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await connectors.aclose()


async def _drain_on_signal(worker: StageWorker) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("service.draining", signal=signal.Signals(signum).name)
            worker.stop()
            return
