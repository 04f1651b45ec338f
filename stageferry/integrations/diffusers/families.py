"""The pipeline families the diffusers pair runs, each split at its own seam.

A family says which diffusers pipeline serves which task, which components each stage loads, how a job
maps onto the pipeline's ``__call__`` (and what it refuses by name), what the encoder stage computes with
the pipeline's own ``encode_prompt``, and how the diffusion stage hands that back to ``__call__``:

* **LTX-2** (``LTX2Pipeline``; i2va ``LTX2ImageToVideoPipeline``): the encoder stage loads Gemma 3, its
  tokenizer and the text connectors, and sends the connectors' outputs (video and audio text embeddings
  and their mask: a fraction of Gemma's stacked hidden states).  The diffusion stage loads the DiT, the
  video and audio VAEs and the vocoder; its ``connectors`` is :class:`PrecomputedConnectors`, which hands
  the pipeline those outputs back where it would have run the connectors, so the library's own loop runs.
* **Wan 2.1 / 2.2 T2V** (``WanPipeline``, one or two transformers): the encoder stage loads UMT5 and sends
  the prompt embeddings with their padding dropped; the diffusion stage pads them back (zeros, as the
  pipeline does) and loads the transformer(s) and the VAE.  Video only.
"""

from __future__ import annotations

import inspect
import io
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stageferry.errors import ConfigError, JobValidationError, PayloadContractError, field_error
from stageferry.integrations.diffusers.contract import DiffusersContract, ltx2_contract, wan_contract
from stageferry.integrations.diffusers.options import DTYPES, DiffusersOptions, components_of
from stageferry.schemas import JobRequest, Task
from stageferry.stages.reference.media_input import bad_media

#: Job defaults that mean "the pipeline's own" for knobs the diffusers pipelines set elsewhere.
_FLOW_SHIFT, _AUDIO_FLOW_SHIFT = 5.0, 3.0
#: ``__call__`` arguments a job sets: ``options.call`` may not set them.
JOB_ARGS = frozenset(
    {
        "prompt", "negative_prompt", "height", "width", "num_frames", "frame_rate", "num_inference_steps",
        "guidance_scale", "generator", "latents", "audio_latents", "prompt_embeds", "negative_prompt_embeds",
        "prompt_attention_mask", "negative_prompt_attention_mask", "output_type", "return_dict", "image",
        "callback_on_step_end", "callback_on_step_end_tensor_inputs", "max_sequence_length",
        "num_videos_per_prompt", "enable_prompt_enhancement",
    }
)  # fmt: skip


class PrecomputedConnectors(torch.nn.Module):
    """LTX-2's text connectors on the diffusion stage: the encoder stage ran them; this returns their
    outputs to the pipeline's ``__call__`` where it calls ``self.connectors(prompt_embeds, mask)``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # No weights; an empty buffer gives the pipeline's device and dtype lookups their answer.
        self.register_buffer("anchor", torch.empty(0, device=device, dtype=dtype), persistent=False)

    @property
    def device(self) -> torch.device:
        return next(self.buffers()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.buffers()).dtype

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.pending is None or hidden.shape != self.pending[0].shape:
            raise RuntimeError("PrecomputedConnectors called without the payload's connector outputs")
        return self.pending


@dataclass(frozen=True, slots=True)
class Geometry:
    """What sizes the pipeline makes: width and height in multiples of ``spatial``, ``temporal``·k + 1 frames."""

    spatial: int
    temporal: int


class Family:
    """One pipeline family (subclasses below)."""

    name: str
    tasks: dict[Task, str]  #: task → the diffusers pipeline class that serves it
    encoder_parts: frozenset[str]  #: components the encoder stage loads (the diffusion stage: the others)
    audio: bool

    def __init__(self, opts: DiffusersOptions) -> None:
        self.opts = opts
        self.geometry = self._geometry()
        signature = inspect.signature(self._pipeline_class(Task.T2VA).__call__).parameters
        known = {k for task in self.tasks for k in inspect.signature(self._pipeline_class(task).__call__).parameters}
        bad = sorted(k for k in opts.call if k in JOB_ARGS or k not in known)
        if bad:
            raise ConfigError(f"options.call: {bad[0]!r} is not a pipeline argument a pipeline file may set")
        self.call_defaults = {k: p.default for k, p in signature.items() if p.default is not inspect.Parameter.empty}

    # -- loading --------------------------------------------------------------------------------------------

    def _pipeline_class(self, task: Task) -> Any:
        import diffusers

        return getattr(diffusers, self.tasks[task])

    def load(self, part: str, device: torch.device) -> dict[Task, Any]:
        """The stage's pipelines, one per task, sharing one set of modules: only ``part``'s components
        are read from the checkpoint (the others are passed as None, so never loaded)."""
        keep = (
            self.encoder_parts if part == "encoder" else set(components_of(self.opts.model_path)) - self.encoder_parts
        )
        skip = {c: None for c in components_of(self.opts.model_path) if c not in keep and c != "scheduler"}
        base_class = self._pipeline_class(Task.T2VA)
        base = base_class.from_pretrained(self.opts.model_path, dtype=self.opts.load_dtype(), **skip)
        base.to(device)
        base.set_progress_bar_config(disable=True)
        pipes = {Task.T2VA: base}
        for task in self.tasks:
            if task is not Task.T2VA:
                pipes[task] = self._pipeline_class(task).from_pipe(base)
                pipes[task].set_progress_bar_config(disable=True)
        self._adapt(pipes, part)
        return pipes

    def _adapt(self, pipes: dict[Task, Any], part: str) -> None:
        """Family-specific changes to the loaded pipelines (LTX-2's diffusion stage: the connectors)."""

    def _geometry(self) -> Geometry:
        raise NotImplementedError

    # -- the job ----------------------------------------------------------------------------------------------

    def guided(self, job: JobRequest) -> bool:
        """Whether the pipeline runs classifier-free guidance for the job (its own rule)."""
        return job.guidance > 1.0

    def contract(self) -> DiffusersContract:
        raise NotImplementedError

    def frames(self, job: JobRequest) -> int:
        """The job's frame count as the pipeline makes it: an explicit ``num_frames`` must be one the
        pipeline makes; a ``duration`` is rounded to the nearest one."""
        t = self.geometry.temporal
        if job.num_frames is None:
            return max(1, round((job.frame_count - 1) / t)) * t + 1
        return job.num_frames

    def refuse(self, job: JobRequest) -> None:
        """Raise :class:`JobValidationError` naming every job field this pipeline cannot honour."""
        errors = []
        model = f"the diffusers {self.name} pipeline"
        if job.task not in self.tasks:
            served = ", ".join(t.value for t in self.tasks)
            message = f"{model} does not generate {job.task.value} (it serves {served})"
            errors.append(field_error("task", message, "unsupported_task"))
        s, t = self.geometry.spatial, self.geometry.temporal
        for name, value in (("width", job.width), ("height", job.height)):
            if value % s:
                errors.append(field_error(name, f"{model} needs a multiple of {s}, got {value}", "unsupported_size"))
        if job.num_frames is not None and job.num_frames % t != 1 % t:
            lo = (job.num_frames - 1) // t * t + 1
            message = f"{model} makes {t}k+1 frames: {lo} or {lo + t}, not {job.num_frames}"
            errors.append(field_error("num_frames", message, "unsupported_frames"))
        if job.lora is not None:
            errors.append(field_error("lora", f"{model} loads no LoRA adapters", "unsupported_lora"))
        if job.flow_shift != _FLOW_SHIFT:
            errors.append(
                field_error("flow_shift", f"{model} takes its shift from its scheduler's config", "unsupported")
            )
        if job.audio_flow_shift != _AUDIO_FLOW_SHIFT:
            message = f"{model} has no audio flow shift of its own"
            errors.append(field_error("audio_flow_shift", message, "unsupported"))
        if errors:
            raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors)

    def max_sequence_length(self) -> int:
        return int(self.opts.max_sequence_length or self.call_defaults["max_sequence_length"])

    # -- the two halves -----------------------------------------------------------------------------------

    def encode(self, pipe: Any, job: JobRequest, media: dict[str, bytes], device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def call_kwargs(self, pipe: Any, job: JobRequest, payload: dict[str, Any], device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def common_kwargs(self, job: JobRequest) -> dict[str, Any]:
        """What every family's ``__call__`` takes from the job (seeded CPU generator: the same noise on
        any device)."""
        return {
            "height": job.height,
            "width": job.width,
            "num_frames": self.frames(job),
            "num_inference_steps": job.num_inference_steps,
            "guidance_scale": job.guidance,
            "generator": torch.Generator("cpu").manual_seed(job.seed),
            "output_type": "np",
            **self.opts.call,
        }


class LTX2(Family):
    name = "ltx2"
    tasks = {Task.T2VA: "LTX2Pipeline", Task.I2VA: "LTX2ImageToVideoPipeline"}
    encoder_parts = frozenset({"text_encoder", "tokenizer", "connectors"})
    audio = True

    def _geometry(self) -> Geometry:
        from diffusers import AutoencoderKLLTX2Video

        config = AutoencoderKLLTX2Video.load_config(self.opts.model_path, subfolder="vae")
        with torch.device("meta"):
            vae = AutoencoderKLLTX2Video.from_config(config)
        dit = AutoencoderKLLTX2Video.load_config(self.opts.model_path, subfolder="transformer")
        patch = int(dit.get("patch_size", 1))
        return Geometry(spatial=max(32, vae.spatial_compression_ratio * patch), temporal=vae.temporal_compression_ratio)

    def guided(self, job: JobRequest) -> bool:
        audio = self.opts.call.get("audio_guidance_scale", self.call_defaults["audio_guidance_scale"]) or job.guidance
        return job.guidance > 1.0 or float(audio) > 1.0  # type: ignore[arg-type]

    def contract(self) -> DiffusersContract:
        return ltx2_contract(self.guided)

    def _adapt(self, pipes: dict[Task, Any], part: str) -> None:
        if part == "diffusion":
            dtype = DTYPES[self.opts.dtypes.get("connectors", self.opts.dtype)]
            connectors = PrecomputedConnectors(pipes[Task.T2VA].device, dtype)
            for pipe in pipes.values():
                pipe.connectors = connectors

    def encode(self, pipe: Any, job: JobRequest, media: dict[str, bytes], device: torch.device) -> dict[str, Any]:
        """``encode_prompt`` then the connectors, on the [negative, positive] batch as ``__call__`` makes it."""
        cfg = self.guided(job)
        pe, pm, ne, nm = pipe.encode_prompt(
            prompt=job.prompt,
            negative_prompt=job.negative_prompt,
            do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length(),
            device=device,
        )
        if cfg:
            pe, pm = torch.cat([ne, pe], dim=0), torch.cat([nm, pm], dim=0)
        video, audio, mask = pipe.connectors(pe, pm, padding_side=getattr(pipe.tokenizer, "padding_side", "left"))
        payload: dict[str, Any] = {"prompt_embeds": video, "audio_prompt_embeds": audio, "attention_mask": mask}
        if job.task is Task.I2VA:
            from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

            payload["image"] = _image(media.get("first_frame"))
            payload["image_crf"] = int(self.opts.call.get("image_crf", resolve_default_image_crf(pipe.text_encoder)))  # type: ignore[arg-type]
        return payload

    def call_kwargs(self, pipe: Any, job: JobRequest, payload: dict[str, Any], device: torch.device) -> dict[str, Any]:
        video, audio, mask = (payload[k].to(device) for k in ("prompt_embeds", "audio_prompt_embeds", "attention_mask"))
        pipe.connectors.pending = (video, audio, mask)
        kwargs = {**self.common_kwargs(job), "frame_rate": float(job.fps)}
        kwargs |= {"prompt_embeds": video[-1:], "prompt_attention_mask": mask[-1:]}
        if video.shape[0] == 2:
            kwargs |= {"negative_prompt_embeds": video[:1], "negative_prompt_attention_mask": mask[:1]}
        if job.task is Task.I2VA:
            from PIL import Image

            kwargs["image"] = Image.fromarray(payload["image"].cpu().numpy(), mode="RGB")
            kwargs.setdefault("image_crf", payload.get("image_crf"))
        return kwargs


class Wan(Family):
    name = "wan"
    tasks = {Task.T2VA: "WanPipeline"}
    encoder_parts = frozenset({"text_encoder", "tokenizer"})
    audio = False

    def _geometry(self) -> Geometry:
        from diffusers import AutoencoderKLWan

        vae = AutoencoderKLWan.load_config(self.opts.model_path, subfolder="vae")
        temporal = 2 ** sum(vae.get("temperal_downsample", [False, True, True]))
        spatial = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        patch = AutoencoderKLWan.load_config(self.opts.model_path, subfolder="transformer").get("patch_size", [1, 2, 2])
        spatial = int(vae.get("scale_factor_spatial", spatial)) * int(patch[1])
        return Geometry(spatial=spatial, temporal=int(vae.get("scale_factor_temporal", temporal)))

    def contract(self) -> DiffusersContract:
        from diffusers import WanTransformer3DModel

        width = int(WanTransformer3DModel.load_config(self.opts.model_path, subfolder="transformer")["text_dim"])
        return wan_contract(self.guided, width)

    def encode(self, pipe: Any, job: JobRequest, media: dict[str, bytes], device: torch.device) -> dict[str, Any]:
        length = self.max_sequence_length()
        pe, ne = pipe.encode_prompt(
            prompt=job.prompt,
            negative_prompt=job.negative_prompt,
            do_classifier_free_guidance=self.guided(job),
            max_sequence_length=length,
            device=device,
        )
        payload = {"prompt_embeds": _trim(pe[0]), "max_sequence_length": length}
        if ne is not None:
            payload["negative_prompt_embeds"] = _trim(ne[0])
        return payload

    def call_kwargs(self, pipe: Any, job: JobRequest, payload: dict[str, Any], device: torch.device) -> dict[str, Any]:
        length = payload.get("max_sequence_length", self.max_sequence_length())
        kwargs = self.common_kwargs(job)
        kwargs["prompt_embeds"] = _pad(payload["prompt_embeds"].to(device), length, "prompt_embeds")
        if "negative_prompt_embeds" in payload:
            negative = payload["negative_prompt_embeds"].to(device)
            kwargs["negative_prompt_embeds"] = _pad(negative, length, "negative_prompt_embeds")
        return kwargs


def _trim(states: torch.Tensor) -> torch.Tensor:
    """[L, D] without its trailing all-zero rows (the pipeline's padding); padding them back with zeros
    gives the same tensor, whichever of them were padding."""
    nonzero = states.abs().amax(dim=1).nonzero()
    n = int(nonzero[-1]) + 1 if len(nonzero) else 1
    return states[:n].contiguous()


def _pad(states: torch.Tensor, length: int, name: str) -> torch.Tensor:
    if states.shape[0] > length:
        raise PayloadContractError.of([(name, f"{states.shape[0]} tokens, more than {length}", "shape")])
    return torch.cat([states, states.new_zeros(length - states.shape[0], states.shape[1])])[None]


def _image(data: bytes | None) -> torch.Tensor:
    """The first frame's pixels, RGB uint8 [h, w, 3], as the pipeline's user would pass them (PIL RGB)."""
    from PIL import Image, UnidentifiedImageError

    if data is None:
        raise bad_media("media.first_frame", "i2va needs a first frame")
    try:
        with Image.open(io.BytesIO(data)) as img:
            return torch.from_numpy(np.array(img.convert("RGB"), dtype=np.uint8))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise bad_media("media.first_frame", f"not a readable image: {exc}") from exc


FAMILIES: dict[str, type[Family]] = {
    "LTX2Pipeline": LTX2,
    "LTX2ImageToVideoPipeline": LTX2,
    "WanPipeline": Wan,
}


def family_for(opts: DiffusersOptions, class_name: str) -> Family:
    """The family of a checkpoint whose ``model_index.json`` names ``class_name``."""
    if class_name not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"{opts.model_path}: pipeline {class_name} is not one the diffusers pair runs ({known})")
    return FAMILIES[class_name](opts)
