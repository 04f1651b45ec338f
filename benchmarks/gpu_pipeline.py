"""The product's own pipeline on the GPUs it finds: real ``stageferry serve`` processes, reference models,
one request of each task at the upstream's size, and per hop what moved the payload and how.

    python benchmarks/gpu_pipeline.py --redis-url redis://127.0.0.1:6379/0 --config a --config b --config c
    python benchmarks/gpu_pipeline.py --redis-url ... --cpu --width 320 --height 192 --duration 1 --steps 2

Configurations (2 GPUs):

* ``a`` — encoder TP1 on GPU 0 → diffusion TP1 on GPU 1 (``devices`` in the pipeline file);
* ``b`` — encoder TP1 → diffusion TP2 sharing GPUs 0–1 (placed by the planner: encoder 0, diffusion 1, 0);
* ``c`` — plain ``stageferry up`` with no pipeline file (the built-in default fitted to the host), then
  ``stageferry plan`` on the reference file ``compose/pipeline.toml`` (TP2 → TP4 as written: refused in
  one line on fewer than four GPUs);
* ``six`` — the upstream's layout, encoder TP2 on GPUs 0–1 → diffusion TP4 on 2–5 (needs six GPUs).

For ``a``/``b``/``six`` it prints the plan, then one row per request (a T2VA warm-up first): the hop's
route (memory kind on both sides and the UCX transport of each region), bytes put (producer) and got
(consumer), the put, READ and NCCL fan-out times, each stage's time, and the MP4's properties.  ``--cpu``
runs the same on CPU (``device = "cpu"``): the dry run of this script on a host without GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stageferry.cli import sample_media  # noqa: E402
from stageferry.cli.launcher import ServiceGroup, wait_for_workers  # noqa: E402
from stageferry.client import Client  # noqa: E402
from stageferry.config import PipelineConfig  # noqa: E402
from stageferry.schemas import RequestState, Task  # noqa: E402
from stageferry.stages.process.placement import host_gpus, plan  # noqa: E402

ENCODER = "stageferry.stages.reference.encoder:factory"
DIFFUSION = "stageferry.stages.reference.diffusion:factory"
LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "a": [{"tp": 1, "devices": [0]}, {"tp": 1, "devices": [1]}],
    "b": [{"tp": 1}, {"tp": 2}],
    "six": [{"tp": 2, "devices": [0, 1]}, {"tp": 4, "devices": [2, 3, 4, 5]}],
}
COLUMNS = (
    "| config | task | route (memory and UCX transport per region) | bytes put | bytes got | put ms | READ ms "
    "| fan-out ms | encoder s | diffusion s | total s | MP4 |"
)


def pipeline_file(path: Path, layout: list[dict[str, Any]], *, cpu: bool) -> Path:
    lines = ['output_dir = "out"']
    for name, model, stage in zip(("encoder", "diffusion"), (ENCODER, DIFFUSION), layout, strict=True):
        lines += ["", "[[stages]]", f'name = "{name}"', f'model = "{model}"', f"tp = {stage['tp']}"]
        if cpu:
            lines.append('device = "cpu"')
        elif "devices" in stage:
            lines.append(f"devices = {stage['devices']}")
    path.write_text("\n".join(lines) + "\n")
    return path


def mp4_facts(media: dict[str, Any]) -> str:
    if not media:
        return "-"
    return (
        f"{media.get('video_codec')} {media.get('width')}x{media.get('height')} {media.get('fps')}fps "
        f"{media.get('frames')}f {media.get('duration_s', 0):.2f}s, {media.get('audio_codec')} "
        f"{media.get('audio_channels')}ch {media.get('sample_rate')}Hz {media.get('audio_duration_s', 0):.2f}s"
    )


async def one_request(client: Client, job: dict[str, Any], task: Task, timeout: float) -> dict[str, Any]:
    """Submit, wait, and read the request's status and trace into one row."""
    uploads = {name: path for name, path in sample_media(task).items()}
    started = time.perf_counter()
    rid = await client.submit({**job, "task": task.value}, uploads=uploads)
    status = await client.wait(rid, timeout=timeout)
    total = time.perf_counter() - started
    events = await client.trace(rid)
    put = [e for e in events if e.event == "payload.put"]
    fanout = [
        e for e in events if e.event == "group.fanout" and (e.stage == "diffusion" or (e.stage is None and e.bytes))
    ]
    timings = {t.stage: t for t in status.timings}
    hop = timings.get("diffusion")
    return {
        "task": task.value,
        "state": status.state.value,
        "error": status.error.message if status.error else None,
        "route": (hop.route or hop.transport.value) if hop else "-",
        "bytes_put": put[-1].bytes if put else None,
        "bytes_got": hop.payload_bytes if hop else None,
        "put_ms": round(put[-1].seconds * 1000, 3) if put and put[-1].seconds is not None else None,
        "read_ms": round(hop.transfer_seconds * 1000, 3) if hop else None,
        "fanout_ms": round(fanout[-1].seconds * 1000, 3) if fanout and fanout[-1].seconds is not None else None,
        "encoder_s": round(timings["encoder"].seconds, 3) if "encoder" in timings else None,
        "diffusion_s": round(hop.seconds, 3) if hop else None,
        "total_s": round(total, 3),
        "mp4": mp4_facts(status.result.media if status.result else {}),
    }


def row(config: str, r: dict[str, Any]) -> str:
    same = "" if r["bytes_put"] == r["bytes_got"] else " (≠)"
    cells = [
        config,
        r["task"],
        r["route"],
        r["bytes_put"],
        f"{r['bytes_got']}{same}",
        r["put_ms"],
        r["read_ms"],
        r["fanout_ms"] if r["fanout_ms"] is not None else "- (TP1)",
        r["encoder_s"],
        r["diffusion_s"],
        r["total_s"],
        r["mp4"] if r["state"] == "done" else f"{r['state']}: {r['error']}",
    ]
    return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"


async def run_layout(config: str, args: argparse.Namespace, work: Path) -> bool:
    path = pipeline_file(work / f"pipeline_{config}.toml", LAYOUTS[config], cpu=args.cpu)
    pipeline = PipelineConfig.load(path)
    gpus = host_gpus()
    print(f"\n## config {config}: {path.name}\n{path.read_text()}", flush=True)
    the_plan = plan(pipeline, gpus)  # refused here, in one line, if this host cannot run it
    print(the_plan.render() + "\n", flush=True)
    prefix = f"gp{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "STAGEFERRY_REDIS_URL": args.redis_url,
        "STAGEFERRY_PREFIX": prefix,
        "STAGEFERRY_PIPELINE": str(path),
        "STAGEFERRY_LOG_FORMAT": "json",
    }
    services = ServiceGroup(env, work / f"logs_{config}")
    ok = True
    try:
        for stage in pipeline.stages:
            await services.start(stage.name, [sys.executable, "-m", "stageferry", "serve", stage.name])
        async with Client(args.redis_url, prefix=prefix, pipeline=pipeline) as client:
            await wait_for_workers(client.redis, client.keys, [s.name for s in pipeline.stages], timeout=args.startup)
            print(COLUMNS + "\n" + "| --- " * 12 + "|", flush=True)
            job = {
                "prompt": "a paper boat drifting down a rain-soaked street, rain drumming on tin roofs",
                "width": args.width,
                "height": args.height,
                "fps": args.fps,
                "duration": args.duration,
                "num_inference_steps": args.steps,
                "seed": 7,
            }
            tasks = [Task.T2VA, *(Task(t) for t in args.tasks.split(","))]
            for i, task in enumerate(tasks):
                r = await one_request(client, job, task, args.timeout)
                print(row(config + (" (warm-up)" if i == 0 else ""), r), flush=True)
                ok = ok and r["state"] == RequestState.DONE.value and r["bytes_put"] == r["bytes_got"]
    finally:
        await services.stop()
        for stage in pipeline.stages:
            tail = services.log_tail(stage.name, 400).splitlines()
            for line in tail:
                if any(k in line for k in ("placement.", "nixl.transport", "nixl.memory.registered", "rank_failed")):
                    print(f"  [{stage.name} log] {line[:400]}")
    return ok


def run_up(args: argparse.Namespace, work: Path) -> bool:
    """``stageferry up`` as a user runs it (no pipeline file, a private Redis), then ``plan`` on the
    reference file as written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")}
    size = ["--width", str(args.width), "--height", str(args.height), "--fps", str(args.fps)]
    size += ["--duration", str(args.duration), "--steps", str(args.steps)]
    argv = [sys.executable, "-m", "stageferry", "up", "--task", "t2va", *size, "--log-dir", str(work / "logs_c")]
    print(f"\n## config c: {' '.join(argv[1:])}", flush=True)
    done = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=args.timeout + 300)
    print(done.stdout.strip())
    print("\n".join(line for line in done.stderr.splitlines() if "\r" not in line)[-4000:])
    print(f"exit {done.returncode}", flush=True)
    ref = ROOT / "compose" / "pipeline.toml"
    argv = [sys.executable, "-m", "stageferry", "--pipeline", str(ref), "plan"]
    print("\n$ stageferry --pipeline compose/pipeline.toml plan", flush=True)
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    print((refused.stdout + refused.stderr).strip() + f"\nexit {refused.returncode}", flush=True)
    return done.returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", choices=[*LAYOUTS, "c"], help="repeatable; default a, b, c")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--cpu", action="store_true", help='device = "cpu" in every stage (dry run without GPUs)')
    parser.add_argument("--tasks", default="t2va,fl2va,ref2va")
    parser.add_argument("--width", type=int, default=1344)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--fps", type=int, default=24)
    parser.add_argument("--duration", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--startup", type=float, default=300.0, help="seconds for the services to start")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = parser.parse_args()
    import torch

    gpus = host_gpus()
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)}) if gpus else ["no GPU"]
    print(f"$ python {' '.join(sys.argv)}")
    print(
        f"host: {platform.node()}, {os.cpu_count()} CPUs, {gpus} GPU(s) {', '.join(names)}; "
        f"torch {torch.__version__}, python {platform.python_version()}; load average {os.getloadavg()[0]:.1f}"
    )
    ok = True
    with tempfile.TemporaryDirectory(prefix="sf-gpu-pipeline-") as tmp:
        work = Path(tmp)
        for config in args.config or ["a", "b", "c"]:
            try:
                ok = (run_up(args, work) if config == "c" else asyncio.run(run_layout(config, args, work))) and ok
            except Exception as exc:  # a refused layout or a failed start: report it, go on with the next
                print(f"config {config}: {type(exc).__name__}: {exc}", flush=True)
                ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
