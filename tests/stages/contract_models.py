"""Encoders for the payload-contract tests, built on the example plug-in (``examples/plugin_encoder`` must
be on ``PYTHONPATH``), plugged in by ``module:factory`` as a user's model would be.  The prompt picks:

* ``wide …`` — the example encoder at 1024 features (the reference encoder sends 5120, the example 384;
  at 1024 a prompt of 30 bytes or more makes a payload above the inline threshold: it travels over NIXL),
  then the rules below on the rest of the prompt;
* ``rank3 …`` — the example's payload with ``text.hidden_states`` as [1, n, 384]: a contract violation;
* ``nan …`` — the example's payload with NaN hidden states: a violation of the values only, which a
  model's structural ``read`` lets through (the runtime's full check does not);
* anything else — the example encoder as it ships (384 features).
"""

from __future__ import annotations

from typing import Any

import torch
from tiny_encoder import TinyTextEncoder

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import StageContext


class PickedByPrompt:
    def __init__(self) -> None:
        self.narrow = TinyTextEncoder(hidden=384)
        self.wide = TinyTextEncoder(hidden=1024)

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> dict[str, Any]:
        wide = job.prompt.startswith("wide")
        out = (self.wide if wide else self.narrow)(job, payload, ctx)
        prompt = job.prompt.removeprefix("wide ")
        if prompt.startswith("rank3"):
            out["text"]["hidden_states"] = out["text"]["hidden_states"][None]
        if prompt.startswith("nan"):
            out["text"]["hidden_states"] = torch.full_like(out["text"]["hidden_states"], float("nan"))
        return out


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> PickedByPrompt:
    return PickedByPrompt()
