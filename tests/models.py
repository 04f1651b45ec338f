"""Models for tests, plugged in by ``module:factory`` exactly as a user's model would be.

Behaviour is driven by the job's prompt, so one pipeline config serves every test:

* ``sleep:<seconds>`` — sleep that long (in steps, reporting progress) before producing the output;
* ``poison`` — kill the whole process at once (a request that crashes its worker every time);
* ``fail`` — raise an ordinary exception (the request fails with ``stage_failed``).

With ``STAGEFERRY_TEST_PAYLOAD_ON_DEVICE`` set, the producer's payload lives on its rank's device (GPU).

Every completed run appends ``<stage> <request_id>`` (rank 0 only) to the file named by
``STAGEFERRY_TEST_RECORD``, so tests can count executions across processes; with
``STAGEFERRY_TEST_DIGESTS`` every rank appends ``<stage> <request_id> <rank> <sha256>`` of the payload it
holds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import StageContext
from stageferry.stages.passthrough import Passthrough, payload_digest


class Scripted(Passthrough):
    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        prompt = job.prompt
        if prompt.startswith("poison"):
            os._exit(17)
        if prompt.startswith("fail"):
            raise RuntimeError("scripted failure")
        if prompt.startswith("sleep:") and ctx.stage == os.environ.get("STAGEFERRY_TEST_SLOW_STAGE", ctx.stage):
            seconds = float(prompt.split(":", 1)[1].split()[0])
            steps = max(1, int(seconds / 0.1))
            for step in range(1, steps + 1):
                time.sleep(seconds / steps)
                ctx.report_progress(step, steps)
                if ctx.is_cancelled():
                    break
        result = super().__call__(job, payload, ctx)
        if isinstance(result, dict) and os.environ.get("STAGEFERRY_TEST_PAYLOAD_ON_DEVICE"):
            result = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in result.items()}
        record = os.environ.get("STAGEFERRY_TEST_RECORD")
        if record and ctx.rank == 0:
            with open(record, "a") as fh:
                fh.write(f"{ctx.stage} {ctx.request_id}\n")
        digests = os.environ.get("STAGEFERRY_TEST_DIGESTS")
        if digests:  # what every rank holds: the input payload (consumers) or the output (producers)
            held = payload if payload is not None else result
            with open(digests, "a") as fh:
                fh.write(f"{ctx.stage} {ctx.request_id} {ctx.rank} {payload_digest(held)}\n")
        return result


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> Scripted:
    hidden = int(os.environ.get("STAGEFERRY_TEST_HIDDEN", "256"))
    return Scripted(final=pipeline.stages[-1].name == stage.name, hidden=hidden, delay_s=0.0)
