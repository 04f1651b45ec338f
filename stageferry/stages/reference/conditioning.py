"""What the payload's visual and audio latents contribute to sampling, per task.

* **Pins** (fl2va): the first and last frame latents are held at their keyframes' latent frames.
* **Priors**: a clean-latent guess the transformer's prediction is added to — fl2va interpolates its
  first and last frame latents along time, ref2va repeats the reference video latents (resampled in
  time) and the reference audio latents (tiled); t2va has none (zeros).  This is what makes the
  untrained reference model visibly follow its media inputs.
* **Reference tokens** (ref2va): a few evenly spaced reference video latent frames and the average-
  pooled reference audio latents, for the cross-attention context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stageferry.schemas import JobRequest, Task
from stageferry.schemas.payload_layout import Layout, latent_index


def pins(job: JobRequest, layout: Layout, visual: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """fl2va: (latent frame, clean latent [16, h, w]) for the first and last frame; else none."""
    if job.task is not Task.FL2VA:
        return []
    return [(latent_index(f), visual[i, :, 0].float()) for i, f in enumerate(layout.keyframes)]


def video_prior(job: JobRequest, layout: Layout, visual: torch.Tensor) -> torch.Tensor:
    """[16, T', h, w]: the clean video latents the media suggest (zeros without media)."""
    shape = layout.video_latent_shape
    t_lat = shape[1]
    if job.task is Task.FL2VA:
        first, last = visual[0, :, 0].float(), visual[1, :, 0].float()
        w = torch.linspace(0.0, 1.0, t_lat, device=visual.device) if t_lat > 1 else first.new_zeros(1)
        return first[:, None] * (1 - w)[None, :, None, None] + last[:, None] * w[None, :, None, None]
    if job.task is Task.REF2VA and visual.shape[0] and visual.shape[2]:
        ref = visual[0].float()
        index = torch.linspace(0, ref.shape[1] - 1, t_lat, device=ref.device).round().long()
        return ref[:, index]
    return torch.zeros(shape, device=visual.device)


def audio_prior(layout: Layout, reference: torch.Tensor) -> torch.Tensor:
    """[1, 64, n]: the reference audio latents tiled to the output length (zeros without reference)."""
    shape = layout.audio_latent_shape
    m = reference.shape[2]
    if m == 0:
        return torch.zeros(shape, device=reference.device)
    repeats = -(-shape[2] // m)
    return reference.float().repeat(1, 1, repeats)[:, :, : shape[2]]


def reference_video(job: JobRequest, visual: torch.Tensor, limit: int) -> torch.Tensor | None:
    """ref2va: up to ``limit`` evenly spaced latent frames of the reference video [16, t, h, w]."""
    if job.task is not Task.REF2VA or visual.shape[0] == 0 or visual.shape[2] == 0 or limit < 1:
        return None
    ref = visual[0].float()
    index = torch.linspace(0, ref.shape[1] - 1, min(limit, ref.shape[1]), device=ref.device).round().long()
    return ref[:, index]


def reference_audio(latents: torch.Tensor, limit: int) -> torch.Tensor | None:
    """Reference audio latents average-pooled to at most ``limit`` tokens [1, 64, m]."""
    if latents.shape[2] == 0 or limit < 1:
        return None
    lat = latents.float()
    return F.adaptive_avg_pool1d(lat, limit) if lat.shape[2] > limit else lat
