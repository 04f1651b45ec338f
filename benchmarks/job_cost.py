"""What a job costs the reference models in memory, by size: the basis of ``limits.max_pixel_frames``.

Each case runs the reference encoder and diffusion (default sizes, one rank, CPU) on a t2va job in a fresh
child process and reports the child's peak resident memory above its baseline (models built, one tiny
job run), next to the job's pixel-frames (width × height × frames).  The cases stay small — the point is
the slope, bytes per pixel-frame, from which the default budget is derived; never run a case sized near
the host's memory on a shared machine.

    python -m benchmarks.job_cost            # the default cases
    python -m benchmarks.job_cost 320x192x8 640x384x48
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("320x192x16", "320x192x64", "640x384x48", "640x384x96", "1344x768x24")
STEPS = 2


def child(spec: str) -> None:
    import torch

    from stageferry.config import PipelineConfig
    from stageferry.schemas import JobRequest
    from stageferry.stages.model import StageContext
    from stageferry.stages.reference import diffusion, encoder

    width, height, frames = (int(v) for v in spec.split("x"))
    pipe = PipelineConfig()
    enc = encoder.factory(stage=pipe.stages[0], pipeline=pipe)
    dif = diffusion.factory(stage=pipe.stages[1], pipeline=pipe)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = StageContext(stage="bench", rank=0, world_size=1, device=torch.device("cpu"), request_id="bench",
                           key="bench_0_0", output_dir=Path(tmp))  # fmt: skip

        def run(w: int, h: int, f: int) -> None:
            job = JobRequest(prompt="a cat in the rain", width=w, height=h, num_frames=f, num_inference_steps=STEPS)
            dif(job, enc(job, None, ctx), ctx)

        run(64, 64, 1)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        run(width, height, frames)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"pixel_frames": width * height * frames, "peak_above_base": peak - base}))  # noqa: T201


def main(cases: list[str]) -> None:
    from stageferry.config import DEFAULT_MAX_PIXEL_FRAMES

    print(f"{'job (w x h x frames)':>22} {'pixel-frames':>14} {'peak RSS above base':>20} {'bytes/pixel-frame':>18}")  # noqa: T201
    slopes = []
    for spec in cases:
        out = subprocess.run([sys.executable, "-m", "benchmarks.job_cost", "--child", spec], capture_output=True,
                             text=True, check=True)  # fmt: skip
        row = json.loads(out.stdout.strip().splitlines()[-1])
        per = row["peak_above_base"] / row["pixel_frames"]
        slopes.append(per)
        print(f"{spec:>22} {row['pixel_frames']:>14,} {row['peak_above_base'] / 2**20:>16.0f} MiB {per:>18.1f}")  # noqa: T201
    worst = max(slopes)
    print(
        f"default max_pixel_frames = {DEFAULT_MAX_PIXEL_FRAMES:,}: about "  # noqa: T201
        f"{DEFAULT_MAX_PIXEL_FRAMES * worst / 2**30:.1f} GiB at the worst slope measured ({worst:.1f} B/pixel-frame)"
    )
    print(
        f"the issue's job, 2048 x 2048 x 1800 = {2048 * 2048 * 1800:,} pixel-frames: about "  # noqa: T201
        f"{2048 * 2048 * 1800 * worst / 2**30:.0f} GiB"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main(sys.argv[1:] or list(CASES))
