"""The reference diffusion stage: conditioning payload → MP4 (H.264 + AAC), tensor-parallel.

Plug in with ``model = "stageferry.stages.reference.diffusion:factory"``.  Called on every rank with
the same job and payload (see ``encoder.py`` for its keys), it:

1. checks the payload (layout version, layout = the job's, tensor shapes) — a mismatch is an
   ``EnvelopeError`` (rejected), raised alike on every rank;
2. draws the initial noise from a CPU generator seeded by ``job.seed`` (the same on every rank), then
   runs ``num_inference_steps`` flow-matching Euler steps from t = 1 to 0 over joint video + audio
   latents, video and audio on their own shifted schedules (``flow_shift`` / ``audio_flow_shift``),
   with classifier-free guidance (``guidance``; 1 skips the unconditional pass, whose text is the
   negative prompt or a null token) — see ``sampler.py``; fl2va first/last latents are pinned at
   their keyframes, and the media set the prior and the reference tokens (``conditioning.py``);
3. reports progress after every step (all ranks), and stops together when any rank sees a cancel;
4. decodes frames (VAE decoder) and a stereo 32 kHz waveform of exactly the video's duration, and on
   rank 0 writes ``<output_dir>/<request_id>.mp4`` and returns :class:`FinalOutput` with the probed
   media facts.  Followers return ``None``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import EnvelopeError
from stageferry.schemas import JobRequest, Task
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.stages.reference import audio, conditioning, vae
from stageferry.stages.reference.audio import AudioCodec
from stageferry.stages.reference.dit import DiT, DiTConfig
from stageferry.stages.reference.layout import Layout
from stageferry.stages.reference.mp4 import probe_mp4, write_mp4
from stageferry.stages.reference.sampler import Conditioning, sample
from stageferry.stages.reference.text_encoder import ROLE_NEGATIVE
from stageferry.stages.reference.tp import TP
from stageferry.stages.reference.vae import VideoVAE

MODEL_NAME = "stageferry.reference.diffusion/1"
MAX_HIDDEN = 65_536  #: text hidden width accepted from a payload (it sizes a weight)
MAX_TEXT_TOKENS = 16_384


@dataclass(frozen=True, slots=True)
class Generated:
    """What every rank computes: frames [F, H, W, 3] uint8, audio [2, S] fp32, and the final latents."""

    frames: torch.Tensor
    audio: torch.Tensor
    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    timings: dict[str, float]


@dataclass(frozen=True, slots=True)
class DiffusionConfig:
    dit: DiTConfig
    max_reference_frames: int = 4  #: reference video latent frames used as context
    max_reference_audio: int = 64  #: reference audio tokens used as context (average-pooled)
    qp: int = 23
    preset: str = "veryfast"


class _Nets:
    def __init__(self, cfg: DiffusionConfig, tp: TP, hidden: int) -> None:
        self.tp = tp
        self.dit = DiT(cfg.dit, tp, hidden)
        self.vae = VideoVAE(seed=cfg.dit.seed, device=tp.device)
        self.audio = AudioCodec(seed=cfg.dit.seed, device=tp.device)


class ReferenceDiffusion:
    def __init__(self, cfg: DiffusionConfig) -> None:
        self.cfg = cfg
        self._nets: dict[tuple[int, int, str, int, int], _Nets] = {}

    def nets(self, ctx: StageContext, hidden: int) -> _Nets:
        """This rank's shard, built on first use: the factory does not know the rank."""
        key = (ctx.tp_rank, ctx.tp_size, str(ctx.device), id(ctx.process_group), hidden)
        if key not in self._nets:
            self._nets[key] = _Nets(self.cfg, TP(ctx.process_group, ctx.tp_rank, ctx.tp_size, ctx.device), hidden)
        return self._nets[key]

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> FinalOutput | None:
        gen = self.generate(job, payload, ctx)
        return self.finish(job, gen, ctx) if ctx.rank == 0 else None

    def generate(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Generated:
        """Denoise and decode (every rank, in step): the same result on every rank of the group."""
        layout, inputs = _check_payload(job, payload, ctx.device)
        nets = self.nets(ctx, int(inputs["text"]["hidden_states"].shape[1]))
        started = time.perf_counter()
        with torch.inference_mode():
            cond = self._conditioning(job, layout, inputs, nets.dit)
            xv, xa = sample(
                nets.dit, job, layout, cond, nets.tp, report=ctx.report_progress, cancelled=ctx.is_cancelled
            )
            denoised = time.perf_counter()
            frames = nets.vae.decode(xv, layout.frames)
            wave = nets.audio.decode(xa, layout.audio_samples, seed=job.seed)
        done = time.perf_counter()
        timings = {"denoise_s": round(denoised - started, 3), "decode_s": round(done - denoised, 3)}
        return Generated(frames, wave, xv.cpu(), xa.cpu(), timings)

    def _conditioning(self, job: JobRequest, layout: Layout, inputs: dict[str, Any], dit: DiT) -> Conditioning:
        visual, ref_audio, style = inputs["visual_latents"], inputs["audio_latents"], inputs["audio_style"]
        hidden, roles = inputs["text"]["hidden_states"], inputs["text"]["role_ids"]
        refs = dit.reference_tokens(
            conditioning.reference_video(job, visual, self.cfg.max_reference_frames),
            conditioning.reference_audio(ref_audio, self.cfg.max_reference_audio),
            job.fps,
        )
        negative = roles == ROLE_NEGATIVE
        uncond = None
        if job.guidance != 1.0:
            if negative.any():
                null_hidden, null_roles = hidden[negative], roles[negative]
            else:
                null_hidden, null_roles = dit.null_text(hidden.shape[1])
            uncond = dit.context(null_hidden, null_roles, refs, style)
        return Conditioning(
            cond=dit.context(hidden[~negative], roles[~negative], refs, style),
            uncond=uncond,
            video_prior=conditioning.video_prior(job, layout, visual),
            audio_prior=conditioning.audio_prior(layout, ref_audio),
            pins=conditioning.pins(job, layout, visual),
        )

    def finish(self, job: JobRequest, gen: Generated, ctx: StageContext) -> FinalOutput:
        """Rank 0: write the MP4 and describe it."""
        started = time.perf_counter()
        path = write_mp4(
            Path(ctx.output_dir) / f"{ctx.request_id}.mp4",
            gen.frames,
            job.fps,
            gen.audio,
            audio.SAMPLE_RATE,
            qp=self.cfg.qp,
            preset=self.cfg.preset,
        )
        timings = {**gen.timings, "mp4_s": round(time.perf_counter() - started, 3)}
        info = {
            "model": MODEL_NAME,
            "task": job.task.value,
            "seed": job.seed,
            "steps": job.num_inference_steps,
            "tp": ctx.world_size,
            "video_latent_shape": list(gen.video_latents.shape),
            "audio_latent_shape": list(gen.audio_latents.shape),
            "frames_sha256": _digest(gen.frames),
            "audio_sha256": _digest(gen.audio),
            "timings": timings,
        }
        return FinalOutput(path=path, media=probe_mp4(path), info=info)


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: exact comparisons of what the model produced, before encoding."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _check_payload(job: JobRequest, payload: Any, device: torch.device) -> tuple[Layout, dict[str, Any]]:
    """The payload's layout (which must be the job's) and its tensors, shape-checked, on ``device``."""
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), dict):
        raise EnvelopeError("diffusion payload must be a dict with a 'text' dict")
    layout = Layout.from_tensor(payload.get("layout"))
    if layout != Layout.for_job(job):
        raise EnvelopeError("payload layout does not match the job", layout=layout.plain())
    hidden = _tensor(payload["text"], "hidden_states", 2)
    roles = _tensor(payload["text"], "role_ids", 1, torch.int64)
    visual = _tensor(payload, "visual_latents", 5)
    ref_audio = _tensor(payload, "audio_latents", 3)
    style = _tensor(payload, "audio_style", 2)
    lat = (vae.CHANNELS, layout.latent_height, layout.latent_width)
    if (
        hidden.shape[0] != roles.shape[0]
        or not 0 < hidden.shape[0] <= MAX_TEXT_TOKENS
        or not 0 < hidden.shape[1] <= MAX_HIDDEN
        or not bool(((roles >= 0) & (roles <= ROLE_NEGATIVE)).all())
        or (visual.shape[1], visual.shape[3], visual.shape[4]) != lat
        or visual.shape[0] > 2
        or ref_audio.shape[:2] != (1, audio.BANDS)
        or tuple(style.shape) != (1, audio.BANDS)
    ):
        raise EnvelopeError("diffusion payload tensors have unexpected shapes")
    if job.task is Task.FL2VA and (visual.shape[0] != 2 or visual.shape[2] != 1):
        raise EnvelopeError("fl2va payload needs first and last frame latents [2, 16, 1, h, w]")
    text = {"hidden_states": hidden.to(device), "role_ids": roles.to(device)}
    tensors = {"visual_latents": visual, "audio_latents": ref_audio, "audio_style": style}
    return layout, {"text": text, **{k: v.to(device, torch.float32) for k, v in tensors.items()}}


def _tensor(obj: dict[str, Any], name: str, dims: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = obj.get(name)
    if not isinstance(t, torch.Tensor) or t.dim() != dims or (dtype is not None and t.dtype != dtype):
        raise EnvelopeError(f"diffusion payload: {name!r} must be a {dims}-d tensor", field=name)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise EnvelopeError(f"diffusion payload: {name!r} has non-finite values", field=name)
    return t


def factory(
    *,
    stage: StageConfig,
    pipeline: PipelineConfig,
    dim: int = 128,
    heads: int = 8,
    layers: int = 2,
    mlp_ratio: int = 4,
    max_attention_tokens: int = 4096,
    seed: int = 0,
    max_reference_frames: int = 4,
    max_reference_audio: int = 64,
    qp: int = 23,
    preset: str = "veryfast",
) -> ReferenceDiffusion:
    """The reference diffusion model; ``dim``/``heads``/``layers`` size the transformer."""
    return ReferenceDiffusion(
        DiffusionConfig(
            dit=DiTConfig(
                dim=dim,
                heads=heads,
                layers=layers,
                mlp_ratio=mlp_ratio,
                max_attention_tokens=max_attention_tokens,
                seed=seed,
            ),
            max_reference_frames=max_reference_frames,
            max_reference_audio=max_reference_audio,
            qp=qp,
            preset=preset,
        )
    )
