"""A payload-only model for control- and data-plane tests and benchmarks.

On a non-final stage it produces a deterministic payload shaped like a conditioning payload (bf16 text
states, int64 layout) whose size follows ``job.width``: ``tokens = width // 16`` rows of ``hidden``
bf16 values; on the last stage it returns a digest of what it received, so tests can check that the
bytes crossed intact.  The hidden width comes from the factory (``hidden=``) and defaults to 5120.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext


def make_payload(job: JobRequest, hidden: int = 5120) -> dict[str, Any]:
    """The deterministic payload for ``job`` (same seed → same bytes on every rank and replica)."""
    gen = torch.Generator().manual_seed(job.seed)
    tokens = max(1, job.width // 16)
    text = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    layout = torch.tensor([job.width, job.height, job.fps, job.frame_count, tokens], dtype=torch.int64)
    return {"text_states": text, "layout": layout, "task": job.task.value, "seed": job.seed}


def payload_digest(payload: Any) -> str:
    """sha256 over every tensor's bytes in a stable order."""
    h = hashlib.sha256()
    for name in sorted(k for k in payload if isinstance(payload[k], torch.Tensor)):
        t = payload[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Passthrough:
    def __init__(self, *, final: bool, hidden: int, delay_s: float) -> None:
        self.final = final
        self.hidden = hidden
        self.delay_s = delay_s

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        total = max(1, job.num_inference_steps) if self.delay_s else 1
        for step in range(1, total + 1):
            if self.delay_s:
                time.sleep(self.delay_s / total)
            ctx.report_progress(step, total)
        if not self.final:
            return make_payload(job, self.hidden)
        digest = payload_digest(payload) if payload is not None else ""
        return FinalOutput(data=digest.encode(), info={"payload_sha256": digest, "stage": ctx.stage})


def factory(*, stage: StageConfig, pipeline: PipelineConfig, hidden: int = 5120, delay_s: float = 0.0) -> Passthrough:
    return Passthrough(final=pipeline.stages[-1].name == stage.name, hidden=hidden, delay_s=delay_s)
