"""The reference encoder stage: job (+ media) → conditioning payload, tensor-parallel over the group.

Plug in with ``model = "stageferry.stages.reference.encoder:factory"``.  The payload (only rank 0's is
used; every rank computes the same one) follows the conditioning contract
(:data:`stageferry.schemas.payload_contract.CONDITIONING`, built with ``build_payload``)::

    {"task": "t2va" | "fl2va" | "ref2va",
     "text": {"hidden_states": bf16 [n, hidden], "role_ids": int64 [n]},
     "visual_latents": fp32 [k, 16, t, H/8, W/8],  # t2va: k = 0; fl2va: k = 2 (first, last; t = 1);
                                                   # ref2va: k = 1 (reference video) or 0 (audio only)
     "audio_latents": fp32 [1, 64, m],             # reference audio (ref2va); m = 0 otherwise
     "audio_style": fp32 [1, 64],                  # mean of the audio latents, zeros without reference
     "layout": int64 [11 + keyframes],             # see schemas/payload_layout.py
     "meta": {...plain values...}, "seed": int}

For t2va with a 33-byte prompt and ``hidden=5120`` that is 35×5120×2 + 35×8 + 11×8 + 64×4 = 359,024
bytes of tensors, the real model's T2VA size.  The text encoder is tensor-parallel; the VAE and audio
encoders are small and replicated.  Everything is deterministic: fixed weights (``seed``), no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stageferry.broker.data.staging import blank, write_into
from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.payload_contract import build_payload
from stageferry.schemas.payload_layout import Layout, latent_frames
from stageferry.stages.model import StageContext, refuse_task
from stageferry.stages.reference import audio, vae
from stageferry.stages.reference.audio import AudioCodec
from stageferry.stages.reference.media_input import bad_media, load_audio, load_image, load_video
from stageferry.stages.reference.text_encoder import ROLE_NEGATIVE, TextEncoder, TextEncoderConfig
from stageferry.stages.reference.tp import TP
from stageferry.stages.reference.vae import VideoVAE

ENCODER_NAME = "stageferry.reference.encoder/1"


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    text: TextEncoderConfig
    max_reference_frames: int = 81  #: reference video frames encoded (at the job's fps)
    max_reference_audio_s: float = 30.0  #: reference audio decoded
    seed: int = 0  #: weight seed of the VAE and audio encoders


class _Nets:
    """One rank's modules, built on first use (the factory does not know the rank)."""

    def __init__(self, cfg: EncoderConfig, tp: TP) -> None:
        self.tp = tp
        self.text = TextEncoder(cfg.text, tp)
        self.vae = VideoVAE(seed=cfg.seed, device=tp.device)
        self.audio = AudioCodec(seed=cfg.seed, device=tp.device)


#: The tasks the reference models generate (i2va is an integration's: docs/diffusers.md).
REFERENCE_TASKS = frozenset({Task.T2VA, Task.FL2VA, Task.REF2VA})


class ReferenceEncoder:
    """Called on every rank with the same job and media; returns the same payload on every rank, its
    tensors on the rank's device (VRAM on a GPU: the data plane moves them GPU to GPU), except the small
    ``layout`` descriptor, kept in host memory."""

    def __init__(self, cfg: EncoderConfig) -> None:
        self.cfg = cfg
        self._nets: dict[tuple[int, int, str, int], _Nets] = {}

    def nets(self, ctx: StageContext) -> _Nets:
        """This rank's shard, built on first use: the factory does not know the rank."""
        key = (ctx.tp_rank, ctx.tp_size, str(ctx.device), id(ctx.process_group))
        if key not in self._nets:
            self._nets[key] = _Nets(self.cfg, TP(ctx.process_group, ctx.tp_rank, ctx.tp_size, ctx.device))
        return self._nets[key]

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> dict[str, Any]:
        """Encode; once every shape is known, ask the stage for the output tensors
        (``ctx.output_tensors``: on the leader, the next hop's pool slot), let the VAE write the visual
        latents — the payload's bulk — straight into them, and copy the small rest in."""
        refuse_task(job, REFERENCE_TASKS, model="the reference encoder")
        nets = self.nets(ctx)
        layout = Layout.for_job(job)
        on = ctx.device  # tensors stay on the rank's device (VRAM on a GPU); the layout is built on the host
        with torch.inference_mode():
            hidden, roles = nets.text.encode(job.prompt, job.negative_prompt)
            ctx.report_progress(1, 3)
            pixels = self._visual_input(job, ctx.media)
            audio_latents = self._audio(job, nets, ctx.media)
            style = audio_latents.mean(dim=2) if audio_latents.shape[2] else torch.zeros(1, audio.BANDS)
            visual_shape = _visual_shape(job, layout, pixels)
            template = build_payload(
                job,
                hidden.to(on),
                roles.to(on),
                visual_latents=blank(visual_shape, torch.float32, on),
                audio_latents=audio_latents.to(on),
                audio_style=style.to(on, torch.float32),
                meta={
                    "encoder": ENCODER_NAME,
                    "hidden": int(hidden.shape[1]),
                    "text_tokens": int((roles != ROLE_NEGATIVE).sum()),
                    "negative_tokens": int((roles == ROLE_NEGATIVE).sum()),
                    "reference_latent_frames": visual_shape[2] if job.task is Task.REF2VA and visual_shape[0] else 0,
                },
            )
            out = ctx.output_tensors(template)
            ctx.report_progress(2, 3)
            template["visual_latents"] = self._encode_visual(pixels, nets, out["visual_latents"])
            ctx.report_progress(3, 3)
            return write_into(out, template)  # type: ignore[no-any-return]

    def _visual_input(self, job: JobRequest, media: dict[str, bytes]) -> list[torch.Tensor]:
        """The frames to encode: the first and last frame (fl2va), the reference video (ref2va), or none."""
        if job.task is Task.FL2VA:
            return [
                load_image(_bytes(job, media, name), job.width, job.height, field=f"media.{name}")
                for name in ("first_frame", "last_frame")
            ]
        if job.task is Task.REF2VA and job.media.reference_video is not None:
            frames = load_video(
                _bytes(job, media, "reference_video"),
                job.width,
                job.height,
                job.fps,
                self.cfg.max_reference_frames,
                field="media.reference_video",
            )
            return [frames]
        return []

    def _encode_visual(self, pixels: list[torch.Tensor], nets: _Nets, out: torch.Tensor) -> torch.Tensor:
        """The visual latents of ``pixels``, written into ``out`` (shape :func:`_visual_shape`): one VAE
        encoding per image (fl2va: [2, 16, 1, h, w]), or of the whole video ([1, 16, t, h, w])."""
        if len(pixels) == 2:
            images = [nets.vae.encode(image) for image in pixels]
            return torch.stack(images, out=out) if out.device == images[0].device else out.copy_(torch.stack(images))
        if pixels:
            target = out[0] if out.device == nets.vae.mix.device else None
            video = nets.vae.encode(pixels[0], out=target)
            return out if target is not None else out.copy_(video[None])
        return out

    def _audio(self, job: JobRequest, nets: _Nets, media: dict[str, bytes]) -> torch.Tensor:
        if job.task is Task.REF2VA and job.media.reference_audio is not None:
            wave = load_audio(
                _bytes(job, media, "reference_audio"),
                max_seconds=self.cfg.max_reference_audio_s,
                field="media.reference_audio",
            )
            return nets.audio.encode(wave)
        return torch.zeros(1, audio.BANDS, 0)


def _visual_shape(job: JobRequest, layout: Layout, pixels: list[torch.Tensor]) -> tuple[int, ...]:
    """The shape of the payload's visual latents for these frames (see the module docstring)."""
    h, w = layout.latent_height, layout.latent_width
    if job.task is Task.FL2VA:
        return (2, vae.CHANNELS, 1, h, w)
    if pixels:
        return (1, vae.CHANNELS, latent_frames(pixels[0].shape[0]), h, w)
    return (0, vae.CHANNELS, layout.latent_frames, h, w)


def _bytes(job: JobRequest, media: dict[str, bytes], name: str) -> bytes:
    """The loaded bytes of a media input the job names (the leader loads them into ``ctx.media``)."""
    data = media.get(name)
    if data is None:
        raise bad_media(f"media.{name}", "the media input was not loaded for this stage")
    return data


def factory(
    *,
    stage: StageConfig,
    pipeline: PipelineConfig,
    hidden: int = 5120,
    dim: int = 256,
    heads: int = 8,
    layers: int = 2,
    max_tokens: int = 512,
    max_reference_frames: int = 81,
    max_reference_audio_s: float = 30.0,
    seed: int = 0,
) -> ReferenceEncoder:
    """The reference encoder; ``hidden`` sizes the payload like the real model's (5120).  What it decodes
    from reference media is bounded by the deployment's limits as well (the cost budget counts them)."""
    text = TextEncoderConfig(hidden=hidden, dim=dim, heads=heads, layers=layers, max_tokens=max_tokens, seed=seed)
    limits = pipeline.limits
    return ReferenceEncoder(
        EncoderConfig(
            text=text,
            max_reference_frames=min(max_reference_frames, limits.max_reference_frames),
            max_reference_audio_s=min(max_reference_audio_s, limits.max_reference_audio_s),
            seed=seed,
        )
    )
