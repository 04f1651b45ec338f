"""What the consumer leader's contract check costs, next to one copy of the same bytes.

For conditioning payloads shaped like the real model's three tasks (hidden 5120; fl2va/ref2va at
1280×720, 81 frames at 16 fps, the ref2va reference video 81 frames and 10 s of audio), built with
``build_payload`` on CPU: the median of ``CONDITIONING.check`` (structure + value scans: finite floats,
role ids in range) and of ``CONDITIONING.read`` (structure only, what a model calls on every rank),
side by side with one ``clone`` of every tensor (a memcpy of the payload).  The check runs once per
request, on the leader, before the fan-out.

    .venv/bin/python -m benchmarks.contract_check [--repeat 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_stats import human, machine_facts, median
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_contract import CONDITIONING, build_payload
from stageferry.schemas.payload_layout import Layout


def payload(task: str) -> tuple[JobRequest, dict[str, Any]]:
    media = {
        "t2va": {},
        "fl2va": {"first_frame": {"path": "f.png"}, "last_frame": {"path": "l.png"}},
        "ref2va": {"reference_video": {"path": "v.mp4"}, "reference_audio": {"path": "a.wav"}},
    }[task]
    size = {"width": 320, "height": 192} if task == "t2va" else {"width": 1280, "height": 720}
    job = JobRequest.model_validate(
        {"task": task, "prompt": "p" * 33, "fps": 16, "num_frames": 81, "media": media, **size}
    )
    layout = Layout.for_job(job)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(35, 5120, generator=g).bfloat16()
    roles = torch.ones(35, dtype=torch.int64)
    visual: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    style: torch.Tensor | None = None
    h, w = layout.latent_height, layout.latent_width
    if task == "fl2va":
        visual = torch.randn(2, 16, 1, h, w, generator=g)
    if task == "ref2va":
        visual = torch.randn(1, 16, 21, h, w, generator=g)
        audio = torch.randn(1, 64, 501, generator=g)
        style = audio.mean(dim=2)
    return job, build_payload(job, hidden, roles, visual_latents=visual, audio_latents=audio, audio_style=style)


def tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    return []


def timed(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_facts(), f"torch threads {torch.get_num_threads()}")  # noqa: T201
    print("| task | payload bytes | check ms | read ms | clone ms | check / clone |")  # noqa: T201
    print("| --- | ---: | ---: | ---: | ---: | ---: |")  # noqa: T201
    for task in ("t2va", "fl2va", "ref2va"):
        job, p = payload(task)
        leaves = tensors(p)
        nbytes = sum(t.numel() * t.element_size() for t in leaves)
        check = timed(lambda: CONDITIONING.check(job, p), args.repeat)  # noqa: B023
        read = timed(lambda: CONDITIONING.read(job, p), args.repeat)  # noqa: B023
        clone = timed(lambda: [t.clone() for t in leaves], args.repeat)  # noqa: B023
        row = f"| {task} | {human(nbytes)} | {check * 1e3:.3f} | {read * 1e3:.3f} | {clone * 1e3:.3f} |"
        print(f"{row} {check / clone:.2f} |")  # noqa: T201


if __name__ == "__main__":
    main()
