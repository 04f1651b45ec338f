"""A small VAE-style video autoencoder: ×8 spatial, ×4 temporal compression, 16 latent channels.

Encoding: each frame [3, H, W] in [-1, 1] gives 3 colour channels (8×8 average pool) and 13 feature
channels (three stride-2 convolutions, a 1×1 projection, tanh); a fixed orthogonal 16×16 mix turns the
16 channels into the latent.  Frames are grouped in time like causal video VAEs: frame 0 alone, then
groups of 4, so F frames give ``1 + ceil((F - 1) / 4)`` latent frames; a group's latent is the mean of
its frames' latents (the posterior mean: no sampling, so encoding is deterministic).

Decoding inverts the mix, interpolates latents back to F frames along time, upsamples the colour
channels bilinearly and adds a small texture from the feature channels through three upsampling
convolutions.  Because the colour path is an (approximate) inverse, a decoded first/last-frame latent
looks like a blurred version of the image it came from.

Weights are drawn from fixed seeds; the module is replicated (not sharded) on every rank.  The geometry
(channels, compression, frame grouping) is the payload contract's (``schemas/payload_layout.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from stageferry.schemas.payload_layout import LATENT_CHANNELS as CHANNELS
from stageferry.schemas.payload_layout import SPATIAL, TEMPORAL
from stageferry.stages.reference.tp import full_weight

_COLOUR = 3
_COLOUR_GAIN = 2.0
_TEXTURE = 0.15


def _mix(seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(full_weight(seed, "vae.mix", CHANNELS, CHANNELS, std=1.0))
    return q * torch.sign(torch.diagonal(r))[None, :]


def _positions(frames: int, total_latents: int) -> np.ndarray:
    """Each frame's position on the latent time axis (frame 0 at latent 0, then groups of 4 centred)."""
    centres = np.array([0.0] + [TEMPORAL * k - 1.5 for k in range(1, total_latents)])
    return np.interp(np.arange(frames, dtype=np.float64), centres, np.arange(total_latents, dtype=np.float64))


def decodable(frames: int, total_latents: int, have: int) -> int:
    """How many of the first frames the first ``have`` of ``total_latents`` latent frames decode (a frame
    interpolates between the two latents around it)."""
    if have >= total_latents:
        return frames
    pos = _positions(frames, total_latents)
    hi = np.minimum(np.floor(pos).astype(np.int64) + 1, total_latents - 1)
    return int(np.searchsorted(hi, have, side="left"))


class VideoVAE:
    """Encoder and decoder; ``device`` is where they compute."""

    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        def w(name: str, *shape: int) -> torch.Tensor:
            return full_weight(seed, name, *shape).to(device)

        self.device = torch.device(device)
        self.mix = _mix(seed).to(device)
        self.enc = [w("vae.enc0", 16, 3, 3, 3), w("vae.enc1", 32, 16, 3, 3), w("vae.enc2", 32, 32, 3, 3)]
        self.enc_out = w("vae.enc_out", CHANNELS - _COLOUR, 32, 1, 1)
        self.dec_in = w("vae.dec_in", 16, CHANNELS - _COLOUR, 1, 1)
        self.dec = [w("vae.dec0", 16, 16, 3, 3), w("vae.dec1", 8, 16, 3, 3), w("vae.dec2", 3, 8, 3, 3)]

    def encode(self, frames: torch.Tensor, *, batch: int = 16, out: torch.Tensor | None = None) -> torch.Tensor:
        """[F, 3, H, W] in [-1, 1] → latents [16, latent_frames(F), H/8, W/8] (fp32), written into ``out``
        if given (e.g. the payload's output tensor: no copy afterwards)."""
        per_frame = torch.cat([self._encode_frames(chunk) for chunk in frames.split(batch)])  # [F, 16, h, w]
        groups = [per_frame[:1], *(per_frame[1:].split(TEMPORAL) if per_frame.shape[0] > 1 else ())]
        return torch.stack([g.mean(dim=0) for g in groups], dim=1, out=out)

    def _encode_frames(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, torch.float32)
        colour = F.avg_pool2d(x, SPATIAL) * _COLOUR_GAIN
        h = x
        for weight in self.enc:
            h = F.silu(F.conv2d(h, weight, stride=2, padding=1))
        feats = torch.tanh(F.conv2d(F.group_norm(h, 1), self.enc_out))
        return torch.einsum("ij,fjhw->fihw", self.mix, torch.cat([colour, feats], dim=1))

    def decode(self, latents: torch.Tensor, frames: int, *, batch: int = 16) -> torch.Tensor:
        """Latents [16, T', h, w] → ``frames`` RGB frames [frames, H, W, 3] uint8 (H = 8h, W = 8w)."""
        return self.decode_range(latents, frames, int(latents.shape[1]), 0, frames, batch=batch)

    def decode_range(
        self, latents: torch.Tensor, frames: int, total_latents: int, start: int, stop: int, *, batch: int = 16
    ) -> torch.Tensor:
        """Frames ``start:stop`` of the ``frames`` that ``total_latents`` latent frames decode to, from the
        first latent frames only (``latents`` [16, k, h, w], k ≤ ``total_latents``: a temporal chunk's
        worth so far) — the same frames :meth:`decode` gives, when :func:`decodable` says they are had."""
        pos = _positions(frames, total_latents)[start:stop]
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, total_latents - 1)
        if stop > start and int(hi.max()) >= latents.shape[1]:
            raise ValueError(f"frames {start}:{stop} need latent frame {int(hi.max())}; {latents.shape[1]} given")
        z = latents.to(self.device, torch.float32)
        frac = torch.tensor(pos - lo, dtype=torch.float32, device=z.device)[:, None, None, None]
        zt = z.transpose(0, 1)  # [k, 16, h, w]
        per_frame = zt[torch.from_numpy(lo)] * (1 - frac) + zt[torch.from_numpy(hi)] * frac
        if stop <= start:
            return torch.empty(0, *self._frame_shape(z), dtype=torch.uint8)
        return torch.cat([self._decode_frames(chunk) for chunk in per_frame.split(batch)])

    @staticmethod
    def _frame_shape(z: torch.Tensor) -> tuple[int, int, int]:
        return (z.shape[2] * SPATIAL, z.shape[3] * SPATIAL, 3)

    def _decode_frames(self, z: torch.Tensor) -> torch.Tensor:
        u = torch.einsum("ji,fjhw->fihw", self.mix, z)
        colour = F.interpolate(u[:, :_COLOUR] / _COLOUR_GAIN, scale_factor=SPATIAL, mode="bilinear")
        h = F.silu(F.conv2d(u[:, _COLOUR:], self.dec_in))
        for i, weight in enumerate(self.dec):
            h = F.conv2d(F.interpolate(h, scale_factor=2, mode="nearest"), weight, padding=1)
            h = F.silu(h) if i < len(self.dec) - 1 else torch.tanh(h)
        rgb = (colour + _TEXTURE * h).clamp(-1.0, 1.0)
        return ((rgb + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()  # HWC on the device
