"""A plug-in text encoder for the reference diffusion stage: its own tiny text model, no downloads.

Run it (from the repository root)::

    PYTHONPATH=examples/plugin_encoder stageferry --pipeline examples/plugin_encoder/pipeline.toml up

The pipeline file names this module's factory for the encoder stage (``model = "tiny_encoder:factory"``)
and the reference diffusion model for the next stage.  What makes the two fit is the conditioning
payload contract (``stageferry schema payload``, ``docs/payload-contract.md``): this encoder makes the
two required text entries itself and lets :func:`~stageferry.schemas.payload_contract.build_payload` add
the layout and the optional media entries.  Its hidden size (384) is not the reference encoder's (5120):
the contract leaves it free, and the reference diffusion stage projects whatever width it gets.

It serves t2va only (it has no image or audio encoder): the pipeline file says so in ``limits.tasks``,
so other tasks are refused on submission, before this model runs; the model refuses them too, for a
pipeline file that does not.  Its text model reads at most :data:`MAX_TOKENS` tokens: a longer prompt
(in utf-8 bytes) is refused naming the field, never silently cut (``limits.max_prompt_chars`` refuses
most of them on submission already).
"""

from __future__ import annotations

from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import JobValidationError, field_error
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.payload_contract import ROLE_NEGATIVE, ROLE_SPECIAL, ROLE_TEXT, build_payload
from stageferry.stages.model import StageContext

BOS, EOS, VOCAB = 256, 257, 258
MAX_TOKENS = 256


class TinyTextEncoder:
    """Byte embeddings + positions through one tanh MLP; weights drawn from a fixed seed, so every rank
    (and every run) computes the same states."""

    def __init__(self, hidden: int = 384, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hidden = hidden
        self.embed = torch.randn(VOCAB, hidden, generator=g) * 0.5
        self.position = torch.randn(MAX_TOKENS, hidden, generator=g) * 0.1
        self.w1 = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.w2 = torch.randn(hidden, hidden, generator=g) / hidden**0.5

    def states(self, text: str, device: torch.device) -> torch.Tensor:
        """[tokens, hidden]: BOS, the text's utf-8 bytes, EOS (:func:`check_tokens` keeps it in bounds)."""
        data = list(text.encode("utf-8"))
        tokens = torch.tensor([BOS, *data, EOS], dtype=torch.int64)
        x = self.embed[tokens] + self.position[: tokens.shape[0]]
        return (torch.tanh(x @ self.w1) @ self.w2).to(device)

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> dict[str, Any]:
        """Called on every rank with the same job (``payload`` is ``None``: this is the first stage)."""
        if job.task is not Task.T2VA:
            error = field_error("task", "this encoder serves t2va only", "unsupported_task")
            raise JobValidationError("invalid job: task: this encoder serves t2va only", [error])
        check_tokens(job)
        with torch.inference_mode():
            prompt = self.states(job.prompt, ctx.device)
            roles = torch.full((prompt.shape[0],), ROLE_TEXT, dtype=torch.int64)
            roles[0] = roles[-1] = ROLE_SPECIAL
            parts, role_parts = [prompt], [roles]
            ctx.report_progress(1, 2)
            if job.negative_prompt:  # the unconditional context for guidance
                negative = self.states(job.negative_prompt, ctx.device)
                parts.append(negative)
                role_parts.append(torch.full((negative.shape[0],), ROLE_NEGATIVE, dtype=torch.int64))
            ctx.report_progress(2, 2)
        hidden_states = torch.cat(parts).to(torch.bfloat16)
        return build_payload(
            job,
            hidden_states,
            torch.cat(role_parts).to(hidden_states.device),
            meta={"encoder": "examples.tiny_encoder/1", "hidden": self.hidden},
        )


def check_tokens(job: JobRequest) -> None:
    """Refuse a prompt longer than the text model reads (a model that truncates would quietly drop its end)."""
    errors = [
        field_error(name, f"{n} tokens; this encoder reads at most {MAX_TOKENS - 2}", "too_many_tokens")
        for name, text in (("prompt", job.prompt), ("negative_prompt", job.negative_prompt))
        if (n := len(text.encode("utf-8"))) > MAX_TOKENS - 2
    ]
    if errors:
        raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors)


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> TinyTextEncoder:
    """Called once per rank at start-up; the rank's place and device come with each job's ``ctx``."""
    return TinyTextEncoder(hidden=384)
