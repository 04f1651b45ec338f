"""The diffusers stage pair: ``encoder`` and ``diffusion`` factories (see the package docstring).

Both load at start-up, on the device the placement planner gave the rank (the service sets the CUDA
device before it builds the model), and only on rank 0: a diffusers pipeline computes on one device, so a
group of N ranks has rank 0 compute and ranks 1..N-1 only keep step with it (``stageferry plan`` and
``docs/diffusers.md`` say so).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import CancelledRequestError
from stageferry.integrations.diffusers.contract import DiffusersContract
from stageferry.integrations.diffusers.families import Family, family_for
from stageferry.integrations.diffusers.options import (
    DiffusersOptions,
    diffusion_options,
    options_of,
    pipeline_class_name,
)
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.stages.reference.mp4 import probe_mp4, write_mp4

log = structlog.get_logger(__name__)


def _load_device(stage: StageConfig) -> torch.device:
    """The device the service set for this rank: its CUDA device, or the CPU."""
    if stage.device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_leader() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    gib = 1 << 30
    return {
        "allocated_gib": round(torch.cuda.memory_allocated(device) / gib, 3),
        "peak_gib": round(torch.cuda.max_memory_allocated(device) / gib, 3),
    }


def _bytes_of(pipes: dict[Any, Any]) -> dict[str, int]:
    """Parameter and buffer bytes of each loaded component (what the stage holds)."""
    base = next(iter(pipes.values()))
    out = {}
    for name, module in base.components.items():
        if isinstance(module, torch.nn.Module):
            out[name] = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return out


def shown_model(model_path: str) -> str:
    """The checkpoint as a result may name it to a client: a hub id as it is, a local directory by its
    name alone (the deployment's filesystem layout is not the client's business)."""
    local = os.path.isabs(model_path) or model_path.startswith(("./", "../", "~"))
    return Path(model_path).name if local else model_path


class _Stage:
    part: str

    def __init__(self, opts: DiffusersOptions, family: Family, stage: StageConfig) -> None:
        self.opts, self.family = opts, family
        self.pipes: dict[Any, Any] = {}
        self.device = _load_device(stage)
        if _is_leader():
            started = time.perf_counter()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.pipes = family.load(self.part, self.device)
            log.info(
                "diffusers.loaded",
                stage=stage.name,
                part=self.part,
                family=family.name,
                device=str(self.device),
                seconds=round(time.perf_counter() - started, 3),
                component_bytes=_bytes_of(self.pipes),
                **_memory(self.device),
            )
        elif stage.world_size > 1:
            log.info("diffusers.rank_idle", stage=stage.name, rank=os.environ.get("RANK"), reason="rank 0 computes")

    @property
    def loaded(self) -> dict[str, int]:
        return _bytes_of(self.pipes) if self.pipes else {}


class DiffusersEncoder(_Stage):
    """The encoder stage: the pipeline's text encoder (and LTX-2's connectors); never the transformer."""

    part = "encoder"

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> dict[str, Any] | None:
        self.family.refuse(job)
        if ctx.rank != 0:
            return None
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.family.encode(self.pipes[job.task], job, ctx.media, self.device)
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        meta = {
            "model_path": shown_model(self.opts.model_path),
            "encoder_s": round(time.perf_counter() - started, 4),
            "payload_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            **_memory(self.device),
        }
        return {"family": self.family.name, "task": job.task.value, **out, "meta": meta}


class DiffusersDiffusion(_Stage):
    """The diffusion stage: the transformer(s), scheduler, VAE(s) and vocoder; never the text encoder.
    It calls the pipeline's own ``__call__`` with the payload's conditioning and writes the MP4."""

    part = "diffusion"

    def __init__(self, opts: DiffusersOptions, family: Family, stage: StageConfig) -> None:
        super().__init__(opts, family, stage)
        #: What this stage reads: its leader checks every payload against it before the fan-out.
        self.input_contract: DiffusersContract = family.contract()

    def generate(self, job: JobRequest, payload: dict[str, Any], ctx: StageContext) -> Any:
        """The pipeline's output (frames [1, F, H, W, 3] float in [0, 1]; LTX-2 also audio [1, 2, S])."""
        pipe = self.pipes[job.task]
        kwargs = self.family.call_kwargs(pipe, job, payload, self.device)
        steps = job.num_inference_steps

        def on_step(_pipe: Any, i: int, _t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            ctx.report_progress(i + 1, steps)
            if ctx.is_cancelled():
                raise CancelledRequestError("cancelled between diffusion steps", step=i + 1)
            return tensors

        with torch.inference_mode():
            return pipe(**kwargs, callback_on_step_end=on_step)

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> FinalOutput | None:
        self.family.refuse(job)
        if ctx.rank != 0:
            return None
        assert isinstance(payload, dict)
        started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        out = self.generate(job, payload, ctx)
        generated = time.perf_counter()
        frames = np.asarray(out.frames[0])
        audio = getattr(out, "audio", None) if self.family.audio else None
        wave = audio[0].float().cpu() if audio is not None else None
        rate = int(self.pipes[job.task].vocoder.config.output_sampling_rate) if wave is not None else 0
        pixels = torch.from_numpy((frames * 255).round().clip(0, 255).astype(np.uint8))
        path = Path(ctx.output_dir) / f"{ctx.request_id}.mp4"
        write_mp4(path, pixels, job.fps, wave, rate or 32_000, qp=self.opts.qp)
        info = {
            "model": f"diffusers:{self.family.tasks[job.task]}",
            "model_path": shown_model(self.opts.model_path),
            "task": job.task.value,
            "seed": job.seed,
            "steps": job.num_inference_steps,
            "frames": int(frames.shape[0]),
            "audio": f"{rate} Hz stereo from the vocoder"
            if wave is not None
            else "none: this pipeline makes video only",
            "frames_sha256": digest(frames),
            "audio_sha256": digest(wave.numpy()) if wave is not None else None,
            "computing_ranks": 1,
            "timings": {
                "pipeline_s": round(generated - started, 3),
                "mp4_s": round(time.perf_counter() - generated, 3),
            },
            "encoder": payload.get("meta", {}),
            **_memory(self.device),
        }
        return FinalOutput(path=path, media=probe_mp4(path), info=info)


def digest(array: np.ndarray) -> str:
    """sha256 of an array's bytes: exact comparisons of what the pipeline produced, before encoding."""
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def encoder(*, stage: StageConfig, pipeline: PipelineConfig) -> DiffusersEncoder:
    """``model = "stageferry.integrations.diffusers:encoder"``."""
    opts = options_of(stage)
    # The CFG decision follows the diffusion stage's ``call`` (e.g. LTX-2's audio_guidance_scale).
    with_call = opts.model_copy(update={"call": diffusion_options(stage, pipeline).call})
    family = family_for(with_call, pipeline_class_name(opts.model_path))
    return DiffusersEncoder(opts, family, stage)


def diffusion(*, stage: StageConfig, pipeline: PipelineConfig) -> DiffusersDiffusion:
    """``model = "stageferry.integrations.diffusers:diffusion"``."""
    opts = options_of(stage)
    return DiffusersDiffusion(opts, family_for(opts, pipeline_class_name(opts.model_path)), stage)
