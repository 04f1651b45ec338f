"""The diffusers pair's stages measured one at a time, as each stage's service would load and run them,
next to the plain one-process pipeline: load time, GPU memory after load and at peak, compute time,
payload bytes, and whether the frames are the same bits.

    python benchmarks/diffusers_gpu.py --checkpoint /tmp/wan-1.3b --family wan --width 832 --height 480 \\
        --frames 33 --steps 10 --dtype bfloat16 --dtypes vae=float32

Each part runs on its own (the previous one freed) so the memory a stage needs is what it alone holds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from stageferry.config import PipelineConfig  # noqa: E402
from stageferry.integrations.diffusers import diffusion, encoder  # noqa: E402
from stageferry.integrations.diffusers.stages import digest  # noqa: E402
from stageferry.schemas import JobRequest  # noqa: E402
from stageferry.stages.model import StageContext  # noqa: E402

GIB = 1 << 30


def gpu(dev: torch.device) -> dict[str, float]:
    torch.cuda.synchronize(dev)
    return {
        "allocated_gib": round(torch.cuda.memory_allocated(dev) / GIB, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated(dev) / GIB, 2),
    }


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--family", choices=["wan", "ltx2"], default="wan")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dtypes", default="", help="component=dtype,...")
    parser.add_argument("--max-len", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dtypes = dict(kv.split("=") for kv in args.dtypes.split(",") if kv)
    opts: dict[str, Any] = {"model_path": args.checkpoint, "dtype": args.dtype, "dtypes": dtypes}
    if args.max_len:
        opts["max_sequence_length"] = args.max_len
    stages = [
        {"name": "encoder", "model": "stageferry.integrations.diffusers:encoder", "options": opts, "device": "cuda"},
        {
            "name": "diffusion",
            "model": "stageferry.integrations.diffusers:diffusion",
            "options": opts,
            "device": "cuda",
        },
    ]
    pipeline = PipelineConfig.model_validate({"stages": stages})
    job = JobRequest(
        prompt="a paper boat drifting down a rain-soaked street", negative_prompt="blurry, low quality",
        width=args.width, height=args.height, fps=args.fps, num_frames=args.frames,
        num_inference_steps=args.steps, guidance=args.guidance, seed=7,
    )  # fmt: skip
    out_dir = Path("/tmp/diffusers_gpu_out")

    def ctx(stage: str) -> StageContext:
        return StageContext(stage, 0, 1, dev, f"bench-{stage}", "k", out_dir)

    report: dict[str, Any] = {
        "job": job.model_dump(include={"width", "height", "num_frames", "num_inference_steps", "guidance"})
    }  # noqa: E501
    free()
    t = time.perf_counter()
    enc = encoder(stage=pipeline.stages[0], pipeline=pipeline)
    report["encoder"] = {"load_s": round(time.perf_counter() - t, 2), "after_load": gpu(dev), "holds_bytes": enc.loaded}
    enc(job, None, ctx("encoder"))  # warm
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    payload = enc(job, None, ctx("encoder"))
    torch.cuda.synchronize(dev)
    assert payload is not None
    tensors = {k: v for k, v in payload.items() if isinstance(v, torch.Tensor)}
    report["encoder"] |= {
        "encode_s": round(time.perf_counter() - t, 4),
        "peak": gpu(dev),
        "payload": {k: [list(v.shape), str(v.dtype)] for k, v in tensors.items()},
        "payload_bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
    }
    payload = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in payload.items()}
    del enc
    free()
    t = time.perf_counter()
    dif = diffusion(stage=pipeline.stages[1], pipeline=pipeline)
    report["diffusion"] = {
        "load_s": round(time.perf_counter() - t, 2),
        "after_load": gpu(dev),
        "holds_bytes": dif.loaded,
    }
    dif.input_contract.check(job, payload)
    torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    result = dif(job, payload, ctx("diffusion"))
    assert result is not None
    report["diffusion"] |= {"generate_s": round(time.perf_counter() - t, 2), "peak": gpu(dev), "info": result.info}
    del dif
    free()
    import diffusers

    name = {"wan": "WanPipeline", "ltx2": "LTX2Pipeline"}[args.family]
    t = time.perf_counter()
    load_dtype: Any = {"default": getattr(torch, args.dtype), **{k: getattr(torch, v) for k, v in dtypes.items()}}
    pipe = getattr(diffusers, name).from_pretrained(args.checkpoint, dtype=load_dtype).to(dev)
    pipe.set_progress_bar_config(disable=True)
    report["one_process"] = {"load_s": round(time.perf_counter() - t, 2), "after_load": gpu(dev)}
    torch.cuda.reset_peak_memory_stats(dev)
    t = time.perf_counter()
    kwargs: dict[str, Any] = {
        "prompt": job.prompt, "negative_prompt": job.negative_prompt, "height": job.height, "width": job.width,
        "num_frames": args.frames, "num_inference_steps": args.steps, "guidance_scale": args.guidance,
        "generator": torch.Generator("cpu").manual_seed(7), "output_type": "np",
    }  # fmt: skip
    if args.max_len:
        kwargs["max_sequence_length"] = args.max_len
    out = pipe(**kwargs)
    frames = np.asarray(out.frames[0])
    report["one_process"] |= {"run_s": round(time.perf_counter() - t, 2), "peak": gpu(dev)}
    report["same_frames"] = digest(frames) == report["diffusion"]["info"]["frames_sha256"]
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
