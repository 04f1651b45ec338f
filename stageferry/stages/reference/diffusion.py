"""The reference diffusion stage: conditioning payload → MP4 (H.264 + AAC), tensor-parallel.

Plug in with ``model = "stageferry.stages.reference.diffusion:factory"``.  Called on every rank with
the same job and payload, it:

1. reads the payload through its declared ``input_contract``, the conditioning contract
   (:data:`stageferry.schemas.payload_contract.CONDITIONING`).  The stage's leader has checked the
   payload against it in full before the fan-out (a violation ends the request ``rejected`` there);
   here only the structure is read again, alike on every rank.  The text hidden size is free: the
   transformer's text projection is built for the width it is given (deterministic weights per width),
   so a plug-in text encoder of 384 or 1024 features works as the reference's 5120 does;
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

With ``stream_latent_frames = N`` (a three-stage pipeline, docs/streaming.md) it stops after step 2 and
streams the final latents to the next stage instead — the decode stage
(:mod:`stageferry.stages.reference.decode`) — in temporal chunks of N latent frames
(:func:`latent_chunks`), the first carrying the audio latents too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import ConfigError, JobValidationError, field_error
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_contract import CONDITIONING, PayloadContract
from stageferry.schemas.payload_contract import Conditioning as Inputs
from stageferry.schemas.payload_layout import Layout
from stageferry.stages.model import FinalOutput, StageContext, refuse_task
from stageferry.stages.reference import audio, conditioning
from stageferry.stages.reference.audio import AudioCodec
from stageferry.stages.reference.dit import DiT, DiTConfig
from stageferry.stages.reference.encoder import REFERENCE_TASKS
from stageferry.stages.reference.mp4 import probe_mp4, write_mp4
from stageferry.stages.reference.sampler import Conditioning, sample
from stageferry.stages.reference.text_encoder import ROLE_NEGATIVE
from stageferry.stages.reference.tp import TP
from stageferry.stages.reference.vae import VideoVAE

MODEL_NAME = "stageferry.reference.diffusion/1"


@dataclass(frozen=True, slots=True)
class Generated:
    """What every rank computes: frames [F, H, W, 3] uint8, audio [2, S] fp32, and the final latents."""

    frames: torch.Tensor
    audio: torch.Tensor
    video_latents: torch.Tensor
    audio_latents: torch.Tensor
    timings: dict[str, float]


@dataclass(frozen=True, slots=True)
class Denoised:
    """The final latents (video [16, T', h, w], audio [1, 64, n]), their layout, the nets, the seconds."""

    video: torch.Tensor
    audio: torch.Tensor
    layout: Layout
    nets: _Nets
    seconds: float


@dataclass(frozen=True, slots=True)
class DiffusionConfig:
    dit: DiTConfig
    max_reference_frames: int = 4  #: reference video latent frames used as context
    max_reference_audio: int = 64  #: reference audio tokens used as context (average-pooled)
    qp: int = 23
    preset: str = "veryfast"
    max_pixel_frames: int = 0  #: the deployment's budget (``limits.max_pixel_frames``); 0: unchecked
    stream_latent_frames: int = 0  #: > 0: stream the latents on in chunks of this many latent frames


class _Nets:
    def __init__(self, cfg: DiffusionConfig, tp: TP, hidden: int) -> None:
        self.tp = tp
        self.dit = DiT(cfg.dit, tp, hidden)
        self.vae = VideoVAE(seed=cfg.dit.seed, device=tp.device)
        self.audio = AudioCodec(seed=cfg.dit.seed, device=tp.device)


class ReferenceDiffusion:
    #: What this stage reads: its leader checks every payload against it before the fan-out.
    input_contract: PayloadContract = CONDITIONING

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
        if self.cfg.stream_latent_frames:
            d = self.denoise(job, payload, ctx)
            for chunk in latent_chunks(d.video, d.audio, self.cfg.stream_latent_frames):
                ctx.emit_chunk(chunk)  # only the leader's go out
            return None  # closes the stream
        gen = self.generate(job, payload, ctx)
        return self.finish(job, gen, ctx) if ctx.rank == 0 else None

    def generate(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Generated:
        """Denoise and decode (every rank, in step): the same result on every rank of the group."""
        d = self.denoise(job, payload, ctx)
        started = time.perf_counter()
        with torch.inference_mode():
            steps = job.num_inference_steps
            ctx.report_progress(steps, steps, phase="decode")  # minutes on a CPU at a large size
            frames = d.nets.vae.decode(d.video, d.layout.frames)
            wave = d.nets.audio.decode(d.audio, d.layout.audio_samples, seed=job.seed)
        timings = {"denoise_s": d.seconds, "decode_s": round(time.perf_counter() - started, 3)}
        return Generated(frames, wave, d.video.cpu(), d.audio.cpu(), timings)

    def denoise(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Denoised:
        """The final video and audio latents (every rank, in step)."""
        refuse_task(job, REFERENCE_TASKS, model="the reference diffusion model")
        inputs = _on(self.input_contract.read(job, payload), ctx.device)
        layout = inputs.layout
        nets = self.nets(ctx, int(inputs.hidden_states.shape[1]))
        self._check_budget(layout)
        started = time.perf_counter()
        with torch.inference_mode():
            cond = self._conditioning(job, layout, inputs, nets.dit)
            xv, xa = sample(
                nets.dit, job, layout, cond, nets.tp, report=ctx.report_progress, cancelled=ctx.is_cancelled
            )
        return Denoised(xv, xa, layout, nets, round(time.perf_counter() - started, 3))

    def _check_budget(self, layout: Layout) -> None:
        """What this stage allocates (latents, tokens, decoded frames) scales with width × height ×
        frames: refuse before allocating anything if it is above the deployment's budget."""
        cost, limit = layout.width * layout.height * layout.frames, self.cfg.max_pixel_frames
        if limit and cost > limit:
            message = f"{cost} pixel-frames is above this deployment's limit max_pixel_frames = {limit}"
            error = field_error("num_frames", message, "over_budget", limit=limit)
            raise JobValidationError(f"invalid job: {message}", [error])

    def _conditioning(self, job: JobRequest, layout: Layout, inputs: Inputs, dit: DiT) -> Conditioning:
        visual, ref_audio, style = inputs.visual_latents, inputs.audio_latents, inputs.audio_style
        hidden, roles = inputs.hidden_states, inputs.role_ids
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
        ctx.report_progress(job.num_inference_steps, job.num_inference_steps, phase="mux")
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


def latent_chunks(video: torch.Tensor, audio: torch.Tensor, every: int) -> list[dict[str, torch.Tensor]]:
    """The latents as the decode stage takes them: video [16, T', h, w] cut along time into chunks of
    ``every`` latent frames (``first``: the index of a chunk's first), the audio latents in the first."""
    out: list[dict[str, torch.Tensor]] = []
    for first in range(0, int(video.shape[1]), every):
        chunk = {"first": torch.tensor([first]), "video_latents": video[:, first : first + every].cpu().contiguous()}
        if first == 0:
            chunk["audio_latents"] = audio.cpu().contiguous()
        out.append(chunk)
    return out


def _stream_option(stage: StageConfig) -> int:
    value = stage.options.get("stream_latent_frames", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"stages.{stage.name}.options.stream_latent_frames: a whole number >= 0, not {value!r}")
    return value


def _digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes: exact comparisons of what the model produced, before encoding."""
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def _on(inputs: Inputs, device: torch.device) -> Inputs:
    """The payload's tensors on ``device``: text as sent (bf16 stays bf16), latents as fp32."""
    return dataclasses.replace(
        inputs,
        hidden_states=inputs.hidden_states.to(device),
        role_ids=inputs.role_ids.to(device),
        visual_latents=inputs.visual_latents.to(device, torch.float32),
        audio_latents=inputs.audio_latents.to(device, torch.float32),
        audio_style=inputs.audio_style.to(device, torch.float32),
    )


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
    stream_latent_frames: int = 0,
) -> ReferenceDiffusion:
    """The reference diffusion model; ``dim``/``heads``/``layers`` size the transformer;
    ``stream_latent_frames`` > 0 (or the stage's ``options.stream_latent_frames``) streams the latents to a
    decode stage (a three-stage pipeline)."""
    stream_latent_frames = stream_latent_frames or _stream_option(stage)
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
            max_pixel_frames=pipeline.limits.max_pixel_frames,
            stream_latent_frames=stream_latent_frames,
        )
    )
