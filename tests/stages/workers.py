"""An in-process leader for tests: the first stage's :class:`StageWorker` over a solo CPU group."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.data.connector import Connector
from stageferry.config import PipelineConfig
from stageferry.stages.group import GroupCompute
from stageferry.stages.group_channel import GroupChannel
from stageferry.stages.worker import StageWorker


def first_stage_worker(
    redis: aioredis.Redis, prefix: str, pipeline: PipelineConfig, model: Any, output: Connector | None = None
) -> StageWorker:
    """Replica ``a`` of ``pipeline``'s first stage running ``model`` on one CPU rank, handing on through
    ``output`` (None: no output connector)."""
    stage = pipeline.stages[0]
    return StageWorker(
        redis=redis,
        keys=Keys(prefix),
        pipeline=pipeline,
        stage=stage,
        replica="a",
        compute=GroupCompute(model, stage, pipeline, GroupChannel.solo(torch.device("cpu"))),
        input_connector=None,
        output_connector=output,
    )
