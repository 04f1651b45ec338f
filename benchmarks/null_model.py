"""Payload-only stage models for throughput benchmarks: no compute, a task-sized payload between stages.

The first stage returns the payload of ``STAGEFERRY_BENCH_TASK`` (T2VA, FL2VA or Ref2VA; built once per
process, so a request costs the data plane and nothing else); the last stage checks it received that
many bytes and stores a tiny result.  Plugged in like any model: ``model = "benchmarks.null_model:factory"``.

``STAGEFERRY_BENCH_OUTPUT`` says how the first stage hands its payload over:

* ``copy`` (the default): it returns its ready-made payload, and the put copies it into a pool slot — a
  model that built its output in memory of its own;
* ``in-place``: it asks for ``ctx.output_tensors`` (the zero-copy put, docs/plugins.md) and returns them
  as they are — a model whose last ops wrote its output into the slot, with their compute, like every
  other, left out (the bytes are whatever the slot held; the last stage checks the byte count only).
"""

from __future__ import annotations

import os
from typing import Any

from benchmarks.step_timer import STEPS_ENV, entry_steps
from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import ConfigError
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.testing import TASKS, tensor_bytes

OUTPUTS = ("copy", "in-place")


class NullModel:
    def __init__(self, *, final: bool, task: str, output: str = "copy") -> None:
        if output not in OUTPUTS:
            raise ConfigError(f"STAGEFERRY_BENCH_OUTPUT must be one of {OUTPUTS}, not {output!r}")
        self.final = final
        self.output = output
        self.make, self.nbytes = TASKS[task]
        self.payload: Any = None

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        if not self.final:
            if self.payload is None:
                self.payload = self.make()
            if self.output == "in-place":
                return ctx.output_tensors(self.payload)  # the template's tensors are not read
            return self.payload
        got = tensor_bytes(payload) if payload is not None else 0
        if got != self.nbytes:
            raise ValueError(f"received {got} payload bytes, expected {self.nbytes}")
        return FinalOutput(data=b"ok", info={"payload_bytes": got})


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> NullModel:
    steps = os.environ.get(STEPS_ENV)
    if steps:  # throughput.py --steps: time this leader's steps of each entry
        entry_steps(stage.name, steps)
    return NullModel(
        final=pipeline.stages[-1].name == stage.name,
        task=os.environ.get("STAGEFERRY_BENCH_TASK", "T2VA"),
        output=os.environ.get("STAGEFERRY_BENCH_OUTPUT", "copy"),
    )
