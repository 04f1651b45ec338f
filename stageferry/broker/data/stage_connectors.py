"""Choosing and running the connectors of one stage process, from the pipeline configuration."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.data.connector_contract import Connector
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.config import ConnectorKind, PipelineConfig, StageConfig


@dataclass
class StageConnectors:
    """The consumer side of the stage's input edge and the producer side of its output edge.

    With NIXL both are the same object: one agent and one pool set per process."""

    input: Connector | None
    output: Connector | None
    nixl: NixlConnector | None = None

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        if self.nixl is not None:
            await tg.start(self.nixl.run)

    async def aclose(self) -> None:
        if self.nixl is not None:
            await self.nixl.aclose()


async def build_connectors(
    *,
    pipeline: PipelineConfig,
    stage: StageConfig,
    redis: aioredis.Redis,
    keys: Keys,
    replica: str,
    device: torch.device,
    address: str | None = None,
) -> StageConnectors:
    """Connectors for ``stage``: none on the input of the first stage, none on the output of the last."""
    previous = pipeline.previous_stage(stage.name)
    has_input = previous is not None
    has_output = pipeline.next_stage(stage.name) is not None
    if not (has_input or has_output):  # a one-stage (e.g. aggregated) pipeline moves no payload
        return StageConnectors(input=None, output=None)
    cuda = device if device.type == "cuda" else None
    dp = pipeline.data_plane
    connector: Connector
    nixl = None
    if dp.connector is ConnectorKind.NIXL:
        nixl = NixlConnector(
            redis=redis,
            keys=keys,
            stage=stage.name,
            replica=replica,
            config=dp,
            timeouts=pipeline.timeouts,
            cuda_device=cuda,
            address=address,
            upstream=previous.name if previous is not None else None,
        )
        await anyio.to_thread.run_sync(nixl.open)
        connector = nixl
    else:
        connector = InlineConnector(
            max_bytes=dp.inline_fallback_max_bytes, max_payload_bytes=dp.max_payload_bytes, cuda_device=cuda
        )
    return StageConnectors(input=connector if has_input else None, output=connector if has_output else None, nixl=nixl)
