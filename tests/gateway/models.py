"""The reference diffusion model, made slow on request: a prompt ``sleep:<seconds> ...`` waits that long
(in 0.1 s steps, reporting progress and stopping early when cancelled) before the real model runs;
``phase:<seconds> ...`` spends that long in a reported ``decode`` phase first.

Timeouts and cancellation need a job that is still running when the client gives up; everything else
runs the reference model unchanged.
"""

from __future__ import annotations

import time
from typing import Any

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext, StageModel
from stageferry.stages.reference import diffusion as reference_diffusion


class SlowOnRequest:
    def __init__(self, inner: StageModel) -> None:
        self.inner = inner

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        if job.prompt.startswith("phase:"):  # a long phase after the steps: 'phase:<seconds> ...'
            ctx.report_progress(1, 1, phase="decode")
            deadline = time.monotonic() + float(job.prompt.split(":", 1)[1].split()[0])
            while time.monotonic() < deadline and not ctx.is_cancelled():
                time.sleep(0.1)
        if job.prompt.startswith("sleep:"):
            steps = max(1, int(float(job.prompt.split(":", 1)[1].split()[0]) / 0.1))
            for step in range(1, steps + 1):
                if ctx.is_cancelled():
                    return FinalOutput(info={"stopped": "cancelled"})
                time.sleep(0.1)
                ctx.report_progress(step, steps)
        return self.inner(job, payload, ctx)


def diffusion(*, stage: StageConfig, pipeline: PipelineConfig) -> SlowOnRequest:
    return SlowOnRequest(reference_diffusion.factory(stage=stage, pipeline=pipeline))


class HeldBeforeLastChunk:
    """The reference decode stage, held before it takes its last chunk until ``<output_dir>/<id>.go``
    exists (at most 120 s): a test sees the MP4's first fragments while the request is surely running."""

    takes_chunks = True

    def __init__(self, inner: StageModel) -> None:
        self.inner = inner

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        from stageferry.schemas.payload_layout import Layout

        last = Layout.for_job(job).latent_frames - 1
        go = ctx.output_dir / f"{ctx.request_id}.go"

        def held() -> Any:
            assert payload is not None, "the decode stage always has an input"
            for index, chunk in enumerate(payload):
                yield chunk
                if index + 1 == last:  # the decode of this chunk is muxed once the next is asked for
                    deadline = time.monotonic() + 120
                    while not go.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)

        return self.inner(job, held(), ctx)


def held_decode(*, stage: StageConfig, pipeline: PipelineConfig) -> HeldBeforeLastChunk:
    from stageferry.stages.reference import decode

    return HeldBeforeLastChunk(decode.factory(stage=stage, pipeline=pipeline))
