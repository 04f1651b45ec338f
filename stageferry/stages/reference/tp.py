"""Tensor-parallel building blocks over one stage group's process group (Megatron-style).

* :class:`TP` wraps the group with the three collectives the models use (all_reduce, all_gather,
  broadcast) — tensor collectives only, never pickle-based object collectives.  With one rank (group
  ``None``) every collective is the identity.
* :class:`ColumnParallelLinear` keeps a slice of the output features (its output stays sharded unless
  ``gather``); :class:`RowParallelLinear` keeps a slice of the input features and ends with an
  all_reduce, so a column → row pair costs one collective.
* Attention shards heads, the MLP shards its inner width.

Every weight is drawn WHOLE from its own seed (:func:`layer_seed` of the model seed and the layer's
name) on a CPU generator, and each rank keeps its shard.  TP1, TP2 and TP4 therefore compute the same
function; they differ only in float reduction order (partial sums added by the all_reduce).  Within one
group every rank ends a row-parallel layer with the same all_reduced tensor, so replicated activations
stay bit-identical across ranks.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stageferry.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TP:
    """This rank's place in its stage group: ``group`` is ``None`` when the stage has one rank."""

    group: Any
    rank: int
    world_size: int
    device: torch.device

    @property
    def single(self) -> bool:
        return self.world_size == 1 or self.group is None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; the result is the same tensor on every rank."""
        if not self.single:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``t`` (same shape on all ranks) along ``dim``, in rank order."""
        if self.single:
            return t
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not self.single:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank (ranks must agree to stop together)."""
        if self.single:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item() > 0)

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous slice of ``n`` items (``n`` must divide evenly)."""
        if n % self.world_size:
            raise ConfigError(f"{what} ({n}) is not divisible by the stage's TP size ({self.world_size})", tp=n)
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


def layer_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (model seed, layer name): the same on every rank, host and run."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_weight(seed: int, name: str, *shape: int, std: float | None = None) -> torch.Tensor:
    """The whole weight of layer ``name``: normal with ``std`` (default fan-in scaled), CPU, fp32."""
    gen = torch.Generator().manual_seed(layer_seed(seed, name))
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return torch.randn(*shape, generator=gen) * (std if std is not None else fan_in**-0.5)


class Linear:
    """A replicated linear layer (every rank holds and computes all of it): for small projections."""

    def __init__(self, seed: int, name: str, d_in: int, d_out: int, tp: TP, *, std: float | None = None) -> None:
        self.weight = full_weight(seed, name, d_out, d_in, std=std).to(tp.device)
        self.bias = full_weight(seed, name + ".bias", d_out, std=0.02).to(tp.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear:
    """``y = x Wᵀ + b`` with W's rows (output features) split across ranks.

    ``fused`` > 1 treats the output as that many equal blocks (e.g. K and V) and shards each block, so
    that a rank keeps matching heads of every block.  With ``gather`` the shards are all_gathered and
    every rank gets the full output.
    """

    def __init__(
        self, seed: int, name: str, d_in: int, d_out: int, tp: TP, *, fused: int = 1, gather: bool = False
    ) -> None:
        self.tp = tp
        self.gather = gather
        weight = full_weight(seed, name, d_out, d_in)
        bias = full_weight(seed, name + ".bias", d_out, std=0.02)
        part = tp.shard(d_out // fused, name)
        self.weight = weight.view(fused, d_out // fused, d_in)[:, part].reshape(-1, d_in).contiguous().to(tp.device)
        self.bias = bias.view(fused, d_out // fused)[:, part].reshape(-1).contiguous().to(tp.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return self.tp.all_gather(y, dim=-1) if self.gather else y


class RowParallelLinear:
    """``y = x Wᵀ + b`` with W's columns (input features) split across ranks; ends with all_reduce.

    The input is this rank's shard of the features (the output of a column-parallel layer), or — with
    ``scatter`` — a replicated input that each rank slices itself.
    """

    def __init__(self, seed: int, name: str, d_in: int, d_out: int, tp: TP, *, scatter: bool = False) -> None:
        self.tp = tp
        self.scatter = scatter
        self.part = tp.shard(d_in, name)
        self.weight = full_weight(seed, name, d_out, d_in)[:, self.part].contiguous().to(tp.device)
        self.bias = full_weight(seed, name + ".bias", d_out, std=0.02).to(tp.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scatter:
            x = x[..., self.part]
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias


class ParallelAttention:
    """Multi-head attention with heads sharded: Q (and K/V) column-parallel, output row-parallel.

    Self-attention when ``context`` is ``None``, else cross-attention to ``context`` ([M, d_ctx]).
    Inputs are unbatched token sequences [N, d].
    """

    def __init__(self, seed: int, name: str, dim: int, heads: int, tp: TP, *, d_ctx: int | None = None) -> None:
        if dim % heads:
            raise ConfigError(f"{name}: width {dim} is not divisible by {heads} heads")
        self.head_dim = dim // heads
        self.local_heads = len(range(heads)[tp.shard(heads, f"{name} heads")])
        self.q = ColumnParallelLinear(seed, f"{name}.q", dim, dim, tp)
        self.kv = ColumnParallelLinear(seed, f"{name}.kv", d_ctx or dim, 2 * dim, tp, fused=2)
        self.out = RowParallelLinear(seed, f"{name}.out", dim, dim, tp)

    def __call__(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        src = x if context is None else context
        q = self.q(x).view(x.shape[0], self.local_heads, self.head_dim).transpose(0, 1)
        k, v = self.kv(src).view(src.shape[0], 2, self.local_heads, self.head_dim).permute(1, 2, 0, 3)
        y = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)).squeeze(0)
        return self.out(y.transpose(0, 1).reshape(x.shape[0], -1))


class ParallelMLP:
    """GELU MLP with its inner width sharded: column-parallel in, row-parallel out."""

    def __init__(self, seed: int, name: str, dim: int, inner: int, tp: TP) -> None:
        self.fc1 = ColumnParallelLinear(seed, f"{name}.fc1", dim, inner, tp)
        self.fc2 = RowParallelLinear(seed, f"{name}.fc2", inner, dim, tp)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free layer norm over the last dimension."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


def sinusoid(positions: torch.Tensor, dim: int, *, max_period: float = 10_000.0) -> torch.Tensor:
    """Sinusoidal embedding [N, dim] of (possibly fractional) positions [N]; ``dim`` must be even."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=positions.device) / half)
    angles = positions.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
