"""Payload-only stage models for throughput benchmarks: no compute, a task-sized payload between stages.

The first stage returns the payload of ``STAGEFERRY_BENCH_TASK`` (T2VA, FL2VA or Ref2VA; built once per
process, so a request costs the data plane and nothing else); the last stage checks it received that
many bytes and stores a tiny result.  Plugged in like any model: ``model = "benchmarks.null_model:factory"``.
"""

from __future__ import annotations

import os
from typing import Any

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.testing import TASKS, tensor_bytes


class NullModel:
    def __init__(self, *, final: bool, task: str) -> None:
        self.final = final
        self.make, self.nbytes = TASKS[task]
        self.payload: Any = None

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        if not self.final:
            if self.payload is None:
                self.payload = self.make()
            return self.payload
        got = tensor_bytes(payload) if payload is not None else 0
        if got != self.nbytes:
            raise ValueError(f"received {got} payload bytes, expected {self.nbytes}")
        return FinalOutput(data=b"ok", info={"payload_bytes": got})


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> NullModel:
    return NullModel(final=pipeline.stages[-1].name == stage.name, task=os.environ.get("STAGEFERRY_BENCH_TASK", "T2VA"))
