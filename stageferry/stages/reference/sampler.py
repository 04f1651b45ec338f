"""Flow-matching Euler sampling of joint video + audio latents, with classifier-free guidance.

Flow matching interpolates ``x_t = (1 − t)·x₀ + t·ε``; the velocity is ``v = ε − x₀ = (x_t − x̂₀)/t``.
Each of ``num_inference_steps`` Euler steps goes from t to t' on a shifted schedule
``σ' = s·σ / (1 + (s − 1)·σ)`` — video with ``flow_shift``, audio with ``audio_flow_shift`` — so
``x ← x + (t' − t)·v = x̂₀ + (t'/t)·(x − x̂₀)``, and the last step lands on x̂₀.

Guidance mixes the conditional and unconditional predictions ``u + g·(c − u)`` and rescales the result
towards the conditional prediction's standard deviation (factor 0.7, as in "Common Diffusion Noise
Schedules and Sample Steps are Flawed"), which keeps large ``guidance`` from saturating; ``g = 1``
skips the unconditional pass.  The initial noise comes from a CPU generator seeded by ``job.seed``:
the same on every rank and on every device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stageferry.errors import CancelledRequestError
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_layout import Layout
from stageferry.stages.reference import audio
from stageferry.stages.reference.dit import Context, DiT, patchify, unpatchify
from stageferry.stages.reference.tp import TP

GUIDANCE_RESCALE = 0.7


@dataclass(frozen=True, slots=True)
class Conditioning:
    cond: Context
    uncond: Context | None  #: None: no unconditional pass (guidance 1)
    video_prior: torch.Tensor  #: [16, T', h, w]
    audio_prior: torch.Tensor  #: [1, 64, n]
    pins: list[tuple[int, torch.Tensor]]  #: (latent frame, clean latent [16, h, w])


def shifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The timestep shift: a larger ``shift`` spends more of the steps at high noise."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance with std rescaling."""
    mixed = uncond + scale * (cond - uncond)
    rescaled = mixed * (cond.std() / mixed.std().clamp_min(1e-6))
    return GUIDANCE_RESCALE * rescaled + (1 - GUIDANCE_RESCALE) * mixed


def sample(
    dit: DiT,
    job: JobRequest,
    layout: Layout,
    cond: Conditioning,
    tp: TP,
    *,
    report: Callable[[int, int], None],
    cancelled: Callable[[], bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Denoise from pure noise → (video latents [16, T', h, w], audio latents [1, 64, n]).

    Every rank calls this in step (the transformer's collectives); all ranks stop together on cancel.
    """
    dev, steps = tp.device, job.num_inference_steps
    vshape, ashape = layout.video_latent_shape, layout.audio_latent_shape
    positions = (
        dit.video_positions(vshape, job.fps),
        dit.audio_positions(ashape[2], audio.HOP / audio.SAMPLE_RATE),
    )
    gen = torch.Generator().manual_seed(job.seed)
    noise_v = torch.randn(vshape, generator=gen).to(dev)
    noise_a = torch.randn(ashape, generator=gen).to(dev)
    prior_v = patchify(cond.video_prior.to(dev))
    prior_a = cond.audio_prior.to(dev)[0].T
    sig = torch.linspace(1.0, 0.0, steps + 1)
    sig_v, sig_a = shifted(sig, job.flow_shift).tolist(), shifted(sig, job.audio_flow_shift).tolist()

    xv, xa = patchify(noise_v), noise_a[0].T.contiguous()  # [Nv, 64], [Na, 64]
    for i in range(steps):
        x0v, x0a = dit(xv, xa, sig_v[i], sig_a[i], cond.cond, positions, vshape)
        if cond.uncond is not None:
            u0v, u0a = dit(xv, xa, sig_v[i], sig_a[i], cond.uncond, positions, vshape)
            x0v, x0a = guide(x0v, u0v, job.guidance), guide(x0a, u0a, job.guidance)
        x0v, x0a = x0v + prior_v, x0a + prior_a
        xv = x0v + (sig_v[i + 1] / sig_v[i]) * (xv - x0v)
        xa = x0a + (sig_a[i + 1] / sig_a[i]) * (xa - x0a)
        if cond.pins:
            z = unpatchify(xv, vshape)
            for index, latent in cond.pins:
                z[:, index] = (1 - sig_v[i + 1]) * latent.to(dev) + sig_v[i + 1] * noise_v[:, index]
            xv = patchify(z)
        report(i + 1, steps)
        if tp.any(cancelled()):
            raise CancelledRequestError("cancelled during denoising", step=i + 1)
    return unpatchify(xv, vshape), xa.T.contiguous()[None]
