"""A spectral audio autoencoder at 32 kHz: 20 ms windows → 64-dim latents, and back to stereo.

Encoding: 32 kHz mono samples (``media_input.load_audio`` decodes and resamples them) go through a
Hann-windowed STFT (1280-point, hop 640), pooled into 64 log-spaced bands, log-compressed, normalised
and mixed by a fixed orthogonal 64×64 matrix, giving latents [1, 64, n] with ``n = samples // 640 + 1``;
decoding a reference's latents gives back audio of about the same loudness and spectral envelope.

Decoding inverts the mix and the compression, spreads each band's energy over its FFT bins, gives each
channel its own deterministic random phase (so left and right are decorrelated) and overlap-adds with
the inverse STFT to exactly the requested number of samples, soft-clipped to [-1, 1].  Rate, hop and
bands are the payload contract's (``schemas/payload_layout.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from stageferry.schemas.payload_layout import AUDIO_BANDS as BANDS
from stageferry.schemas.payload_layout import AUDIO_HOP as HOP
from stageferry.schemas.payload_layout import AUDIO_SAMPLE_RATE as SAMPLE_RATE
from stageferry.stages.reference.tp import full_weight, layer_seed

N_FFT = 2 * HOP
_LOG_GAIN = 10.0
_LOG_MEAN = 1.5  #: latents are (log-band energy − mean) / std; a zero latent is a quiet noise floor
_LOG_STD = 2.0


def _filterbank() -> torch.Tensor:
    """[BANDS, N_FFT // 2 + 1] triangular bands, log-spaced from 40 Hz to Nyquist."""
    bins = N_FFT // 2 + 1
    freqs = np.linspace(0.0, SAMPLE_RATE / 2, bins)
    edges = np.geomspace(40.0, SAMPLE_RATE / 2, BANDS + 2)
    bank = np.zeros((BANDS, bins), dtype=np.float32)
    for b in range(BANDS):
        lo, mid, hi = edges[b], edges[b + 1], edges[b + 2]
        up = (freqs - lo) / (mid - lo)
        down = (hi - freqs) / (hi - mid)
        bank[b] = np.clip(np.minimum(up, down), 0.0, None)
    bank[:, 0] = 0.0
    return torch.from_numpy(bank)


class AudioCodec:
    """Encoder and decoder; ``device`` is where they compute."""

    def __init__(self, *, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.seed = seed
        q, r = torch.linalg.qr(full_weight(seed, "audio.mix", BANDS, BANDS, std=1.0))
        self.mix = (q * torch.sign(torch.diagonal(r))[None, :]).to(device)
        self.bank = _filterbank().to(device)
        # each bin takes its bands' values, weighted by how much each band covers it
        self.spread = (self.bank / self.bank.sum(dim=0, keepdim=True).clamp_min(1e-6)).T.contiguous()
        self.window = torch.hann_window(N_FFT, device=device)

    def encode(self, wave: torch.Tensor) -> torch.Tensor:
        """Mono 32 kHz samples [S] → latents [1, 64, S // 640 + 1] (fp32)."""
        spec = torch.stft(
            wave.to(self.device, torch.float32), N_FFT, HOP, window=self.window, center=True, return_complex=True
        )
        bands = self.bank @ spec.abs()  # [64, n]
        return (self.mix @ ((torch.log1p(_LOG_GAIN * bands) - _LOG_MEAN) / _LOG_STD))[None]

    def decode(self, latents: torch.Tensor, samples: int, *, seed: int) -> torch.Tensor:
        """Latents [1, 64, n] → stereo waveform [2, samples] fp32 in [-1, 1]."""
        z = latents.to(self.device, torch.float32)[0]
        log_bands = (self.mix.T @ z) * _LOG_STD + _LOG_MEAN
        bands = torch.expm1(log_bands.clamp(-20.0, 20.0)).clamp_min(0.0) / _LOG_GAIN
        mag = self.spread @ bands  # [bins, n]
        gen = torch.Generator().manual_seed(layer_seed(seed, "audio.phase"))
        phase = (torch.rand(2, *mag.shape, generator=gen) * 2 * torch.pi).to(self.device)
        spec = torch.polar(mag.expand(2, -1, -1).contiguous(), phase)
        wave = torch.istft(spec, N_FFT, HOP, window=self.window, center=True, length=samples)
        return torch.tanh(wave).cpu()
