"""A small tensor-parallel diffusion transformer over joint video + audio latent tokens.

Tokens: video latents [16, T', h, w] in 1×2×2 patches (64 values each) and audio latents [1, 64, n]
one per latent frame, embedded to ``dim`` with positional codes that share one time axis (seconds), so
a video token and the audio tokens of the same instant are near in position.  Each block:

    x += gate₁ · SelfAttention(adaLN₁(x))        heads sharded, row-parallel output (all_reduce)
    x += CrossAttention(norm(x), context)        heads sharded; context = text (+ reference) tokens
    x += gate₂ · MLP(adaLN₂(x))                  inner width sharded (all_reduce)

adaLN (shift, scale, gate) comes from the timestep embedding — video and audio have their own
timesteps, since they are shifted differently — plus the pooled text context, plus for audio the
reference audio style.  The heads predict clean latents (x̂₀, bounded by tanh; the video head one value
per patch, upsampled bilinearly), which the sampler adds to the media's prior (``conditioning.py``) and
turns into the flow-matching velocity.  The text projection (hidden → dim) is row-parallel: each rank
multiplies its slice of the 5120 features, one all_reduce sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stageferry.errors import ConfigError
from stageferry.stages.reference import audio, vae
from stageferry.stages.reference.tp import (
    TP,
    Linear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    full_weight,
    norm,
    sinusoid,
)

PATCH = 2
PATCH_DIM = vae.CHANNELS * PATCH * PATCH
TIME_UNITS_PER_S = 25.0  #: positional time resolution (one unit per 40 ms)
_T_FREQ = 256
_VIDEO_X0_SCALE = 1.0  #: bounds of the predicted clean latents (tanh)
_AUDIO_X0_SCALE = 0.6
_VIDEO, _AUDIO, _REF_VIDEO, _REF_AUDIO = range(4)


@dataclass(frozen=True, slots=True)
class DiTConfig:
    dim: int = 128
    heads: int = 8
    layers: int = 2
    mlp_ratio: int = 4
    max_attention_tokens: int = 4096  #: above this, self-attention keys/values are pooled spatially
    seed: int = 0  #: weight seed


@dataclass(frozen=True, slots=True)
class Context:
    """What the tokens attend to (text, then reference tokens) and the pooled vectors for adaLN."""

    tokens: torch.Tensor  # [M, dim]
    pooled: torch.Tensor  # [dim]
    style: torch.Tensor  # [dim]


def patchify(z: torch.Tensor) -> torch.Tensor:
    """[16, T, h, w] → [T·h/2·w/2, 64]."""
    c, t, h, w = z.shape
    z = z.reshape(c, t, h // PATCH, PATCH, w // PATCH, PATCH)
    return z.permute(1, 2, 4, 0, 3, 5).reshape(t * (h // PATCH) * (w // PATCH), PATCH_DIM)


def unpatchify(tokens: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    c, t, h, w = shape
    z = tokens.reshape(t, h // PATCH, w // PATCH, c, PATCH, PATCH)
    return z.permute(3, 0, 1, 4, 2, 5).reshape(c, t, h, w)


def latent_frame_seconds(t_lat: int, fps: int) -> torch.Tensor:
    """The time (s) at the centre of each latent frame's group of video frames."""
    k = torch.arange(t_lat, dtype=torch.float32)
    return torch.where(k == 0, k, vae.TEMPORAL * k - 1.5) / fps


class DiT:
    """One rank's shard; every rank returns the same predictions."""

    def __init__(self, cfg: DiTConfig, tp: TP, hidden: int) -> None:
        if cfg.dim % 8 or cfg.dim % cfg.heads:
            raise ConfigError(f"diffusion width {cfg.dim} must be a multiple of 8 and of heads ({cfg.heads})")
        self.cfg, self.tp = cfg, tp
        s, d = cfg.seed, cfg.dim
        self.split = (2 * (d // 8), 2 * ((d - 2 * (d // 8)) // 4))
        self.t_in, self.t_out = Linear(s, "dit.t_in", _T_FREQ, d, tp), Linear(s, "dit.t_out", d, d, tp)
        self.text_in: RowParallelLinear | Linear
        if hidden % tp.world_size == 0:
            self.text_in = RowParallelLinear(s, "dit.text_in", hidden, d, tp, scatter=True)
        else:  # a width the group cannot split evenly: replicated
            self.text_in = Linear(s, "dit.text_in", hidden, d, tp)
        self.pool = Linear(s, "dit.pool", d, d, tp)
        self.style = Linear(s, "dit.style", audio.BANDS, d, tp)
        self.roles = full_weight(s, "dit.roles", 3, d, std=0.5).to(tp.device)
        self.modality = full_weight(s, "dit.modality", 4, d, std=0.5).to(tp.device)
        self.video_in = Linear(s, "dit.video_in", PATCH_DIM, d, tp)
        self.audio_in = Linear(s, "dit.audio_in", audio.BANDS, d, tp)
        ada_std = 0.5 * d**-0.5
        self.blocks = [
            (
                Linear(s, f"dit.{i}.ada", d, 6 * d, tp, std=ada_std),
                ParallelAttention(s, f"dit.{i}.self", d, cfg.heads, tp),
                ParallelAttention(s, f"dit.{i}.cross", d, cfg.heads, tp),
                ParallelMLP(s, f"dit.{i}.mlp", d, cfg.mlp_ratio * d, tp),
            )
            for i in range(cfg.layers)
        ]
        self.ada_out = Linear(s, "dit.ada_out", d, 2 * d, tp, std=ada_std)
        self.video_out = Linear(s, "dit.video_out", d, vae.CHANNELS, tp)
        self.audio_out = Linear(s, "dit.audio_out", d, audio.BANDS, tp)

    def _pos(self, seconds: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        dt, dy = self.split
        dx = self.cfg.dim - dt - dy
        return torch.cat([sinusoid(seconds * TIME_UNITS_PER_S, dt), sinusoid(y, dy), sinusoid(x, dx)], dim=-1).to(
            self.tp.device
        )

    def video_positions(self, shape: tuple[int, ...], fps: int, *, modality: int = _VIDEO) -> torch.Tensor:
        """Positional + modality codes [T·h·w/4, dim] for video latents of ``shape`` [16, T, h, w]."""
        _, t, h, w = shape
        tt, yy, xx = torch.meshgrid(
            latent_frame_seconds(t, fps),
            torch.arange(h // PATCH, dtype=torch.float32),
            torch.arange(w // PATCH, dtype=torch.float32),
            indexing="ij",
        )
        return self._pos(tt.reshape(-1), yy.reshape(-1), xx.reshape(-1)) + self.modality[modality]

    def audio_positions(self, n: int, seconds_per_token: float, *, modality: int = _AUDIO) -> torch.Tensor:
        """Positional + modality codes [n, dim] for n audio latent frames."""
        seconds = torch.arange(n, dtype=torch.float32) * seconds_per_token
        return self._pos(seconds, torch.full((n,), -1.0), torch.full((n,), -1.0)) + self.modality[modality]

    def reference_tokens(
        self, video: torch.Tensor | None, audio_latents: torch.Tensor | None, fps: int
    ) -> list[torch.Tensor]:
        """Reference video latents [16, T, h, w] and audio latents [1, 64, m] as context tokens."""
        refs = []
        if video is not None:
            pos = self.video_positions(tuple(video.shape), fps, modality=_REF_VIDEO)
            refs.append(self.video_in(patchify(video.to(self.tp.device))) + pos)
        if audio_latents is not None:
            n, full = audio_latents.shape[2], audio.HOP / audio.SAMPLE_RATE
            pos = self.audio_positions(n, full, modality=_REF_AUDIO)
            refs.append(self.audio_in(audio_latents[0].T.to(self.tp.device)) + pos)
        return refs

    def context(
        self, hidden: torch.Tensor, roles: torch.Tensor, refs: list[torch.Tensor], style: torch.Tensor
    ) -> Context:
        """Text states [n, hidden] (bf16) with their roles, reference tokens, audio style [1, 64]."""
        text = self.text_in(hidden.to(self.tp.device, torch.float32)) + self.roles[roles.to(self.tp.device)]
        return Context(
            tokens=torch.cat([text, *refs]),
            pooled=self.pool(text.mean(dim=0)),
            style=self.style(style.to(self.tp.device, torch.float32)[0]),
        )

    def null_text(self, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The unconditional text when there is no negative prompt: one all-zero token."""
        return torch.zeros(1, hidden, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int64)

    def timestep(self, t: float) -> torch.Tensor:
        emb = sinusoid(torch.tensor([t * 1000.0], device=self.tp.device), _T_FREQ)[0]
        return self.t_out(F.silu(self.t_in(emb)))

    def __call__(
        self,
        video: torch.Tensor,
        audio_latents: torch.Tensor,
        t_video: float,
        t_audio: float,
        ctx: Context,
        positions: tuple[torch.Tensor, torch.Tensor],
        shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy patches (video [Nv, 64] of latents ``shape``, audio [Na, 64]) → predicted clean x̂₀.

        The video head predicts one 16-channel value per patch, upsampled bilinearly to the latent grid
        (a smooth field rather than a per-patch pattern).
        """
        nv = video.shape[0]
        x = torch.cat([self.video_in(video) + positions[0], self.audio_in(audio_latents) + positions[1]])
        cond = torch.stack(
            [
                self.timestep(t_video) + ctx.pooled + self.modality[_VIDEO],
                self.timestep(t_audio) + ctx.pooled + ctx.style + self.modality[_AUDIO],
            ]
        )
        which = torch.cat([torch.zeros(nv, dtype=torch.int64), torch.ones(x.shape[0] - nv, dtype=torch.int64)])
        which = which.to(self.tp.device)
        for ada, attn, cross, mlp in self.blocks:
            sh1, sc1, g1, sh2, sc2, g2 = ada(F.silu(cond))[which].chunk(6, dim=-1)
            y = norm(x) * (1 + sc1) + sh1
            x = x + g1 * attn(y, self._pooled_keys(y, nv, shape))
            x = x + cross(norm(x), ctx.tokens)
            x = x + g2 * mlp(norm(x) * (1 + sc2) + sh2)
        shift, scale = self.ada_out(F.silu(cond))[which].chunk(2, dim=-1)
        h = norm(x) * (1 + scale) + shift
        c, t, lh, lw = shape
        grid = self.video_out(h[:nv]).reshape(t, lh // PATCH, lw // PATCH, c).permute(0, 3, 1, 2)
        video_x0 = F.interpolate(grid, scale_factor=PATCH, mode="bilinear").permute(1, 0, 2, 3)
        return _VIDEO_X0_SCALE * torch.tanh(patchify(video_x0)), _AUDIO_X0_SCALE * torch.tanh(self.audio_out(h[nv:]))

    def _pooled_keys(self, y: torch.Tensor, nv: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Keys/values for self-attention: ``None`` (all tokens) up to ``max_attention_tokens``; above it
        the video tokens average-pooled r×r per latent frame (r as small as fits), the audio tokens as
        they are — attention then costs N·N/r² instead of N², so large jobs stay tractable on CPU."""
        if y.shape[0] <= self.cfg.max_attention_tokens:
            return None
        _, t, lh, lw = shape
        gh, gw = lh // PATCH, lw // PATCH
        budget = max(1, self.cfg.max_attention_tokens - (y.shape[0] - nv))
        r = 2
        while t * math.ceil(gh / r) * math.ceil(gw / r) > budget and r < max(gh, gw):
            r += 1
        grid = y[:nv].reshape(t, gh, gw, -1).permute(0, 3, 1, 2)
        pooled = F.adaptive_avg_pool2d(grid, (math.ceil(gh / r), math.ceil(gw / r)))
        pooled = pooled.permute(0, 2, 3, 1).reshape(-1, y.shape[1])
        return torch.cat([pooled, y[nv:]])
