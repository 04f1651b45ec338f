"""A byte-level text encoder: prompt bytes → text hidden states [tokens, hidden] (bf16) and role ids.

Tokens are ``BOS, utf-8 bytes…, EOS`` (capped at ``max_tokens``), so a 33-byte prompt is 35 tokens.  A
non-empty negative prompt is encoded as a second, separate sequence and appended; the two never attend
to each other, so the prompt's states do not depend on the negative prompt.

Role ids (int64, one per token): 0 the prompt's BOS/EOS, 1 the prompt's bytes, 2 every token of the
negative prompt (its BOS/EOS included), so that ``role_ids == 2`` selects the unconditional context.

The transformer is small (``dim`` wide, default 256) and tensor-parallel — heads and MLP sharded, one
all_reduce per sublayer — with a final column-parallel projection to ``hidden`` (default 5120, the real
model's width) whose shards are all_gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stageferry.schemas.payload_contract import ROLE_NEGATIVE, ROLE_SPECIAL, ROLE_TEXT
from stageferry.stages.reference.tp import (
    TP,
    ColumnParallelLinear,
    Linear,
    ParallelAttention,
    ParallelMLP,
    full_weight,
    norm,
    sinusoid,
)

BOS = 256
EOS = 257
VOCAB = 258


@dataclass(frozen=True, slots=True)
class TextEncoderConfig:
    hidden: int = 5120  #: width of the emitted hidden states
    dim: int = 256  #: the transformer's own width
    heads: int = 8
    layers: int = 2
    mlp_ratio: int = 4
    max_tokens: int = 512  #: per sequence, BOS and EOS included
    seed: int = 0  #: weight seed


def tokenize(text: str, max_tokens: int) -> torch.Tensor:
    """``[BOS, bytes…, EOS]`` as int64, the bytes cut so that the whole fits in ``max_tokens``."""
    data = text.encode("utf-8")[: max(0, max_tokens - 2)]
    return torch.tensor([BOS, *data, EOS], dtype=torch.int64)


def role_ids(tokens: torch.Tensor, *, negative: bool) -> torch.Tensor:
    if negative:
        return torch.full_like(tokens, ROLE_NEGATIVE)
    roles = torch.full_like(tokens, ROLE_TEXT)
    roles[(tokens == BOS) | (tokens == EOS)] = ROLE_SPECIAL
    return roles


class TextEncoder:
    """One rank's shard of the encoder; every rank returns the same full hidden states."""

    def __init__(self, cfg: TextEncoderConfig, tp: TP) -> None:
        self.cfg = cfg
        self.tp = tp
        s, d = cfg.seed, cfg.dim
        self.embed = full_weight(s, "text.embed", VOCAB, d, std=1.0).to(tp.device)
        self.blocks = [
            (
                ParallelAttention(s, f"text.{i}.attn", d, cfg.heads, tp),
                ParallelMLP(s, f"text.{i}.mlp", d, cfg.mlp_ratio * d, tp),
            )
            for i in range(cfg.layers)
        ]
        self.out: ColumnParallelLinear | Linear
        if cfg.hidden % tp.world_size == 0:
            self.out = ColumnParallelLinear(s, "text.out", d, cfg.hidden, tp, gather=True)
        else:  # a width the group cannot split evenly: every rank computes all of it
            self.out = Linear(s, "text.out", d, cfg.hidden, tp)

    def encode_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[n] int64 → [n, hidden] fp32."""
        tokens = tokens.to(self.tp.device)
        pos = torch.arange(tokens.shape[0], device=self.tp.device)
        x = self.embed[tokens] + sinusoid(pos, self.cfg.dim)
        for attn, mlp in self.blocks:
            x = x + attn(norm(x))
            x = x + mlp(norm(x))
        return self.out(norm(x))

    def encode(self, prompt: str, negative_prompt: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states [n, hidden] bf16, role ids [n] int64) for the prompt (+ negative prompt)."""
        seqs = [(tokenize(prompt, self.cfg.max_tokens), False)]
        if negative_prompt:
            seqs.append((tokenize(negative_prompt, self.cfg.max_tokens), True))
        states = torch.cat([self.encode_tokens(tok) for tok, _ in seqs])
        roles = torch.cat([role_ids(tok, negative=neg) for tok, neg in seqs])
        return states.to(torch.bfloat16), roles.to(self.tp.device)
