"""Time to the first playable bytes at the client: the reference pipeline streamed (three stages, a
fragmented MP4 downloaded as it is written) vs whole (two stages, the MP4 once done), one run (issue 40).

    python benchmarks/streamed_reference.py                  # 256x144, 2 s at 8 fps, 2 steps, CPU
    python benchmarks/streamed_reference.py --requests 6 --width 320 --height 192

Real services per mode (a private key prefix, ``stageferry serve`` processes on CPU, NIXL) and the gateway
(uvicorn, in this process); an httpx client submits ``POST /v1/videos`` and polls ``GET
/v1/videos/{id}/content`` every 20 ms.  ``streamed``: ``examples/streamed_reference/pipeline.toml``'s
shape — the diffusion stage streams latent chunks (``stream_latent_frames = 1``), the decode stage writes a
fragmented MP4, the gateway sends it while it grows; ``whole``: the two-stage default, the MP4 when done.
Printed, median / p99 over ``--requests`` requests one after another:

* **first playable bytes**: submit → the client holds a playable prefix (streamed: the first complete
  fragment — the header and a ``moof`` whose ``mdat`` is followed by the next box; whole: the whole file,
  an MP4 whose index is written last);
* **submit → last byte** at the client.

Then where the time went, per stage (median ms over the requests, one at a time and at once): the stage's
model time from the final status, the model's own timings (``denoise_s``, ``decode_s``, ``mp4_s``,
``decode_mux_s``) and the seconds back-pressure held the streaming producer (its ``stream.done`` event);
with ``--gpu-util``, the GPU's mean utilisation during the burst (``nvidia-smi``, every 100 ms).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from bench_stats import cell, machine_facts, median  # noqa: E402

from stageferry.cli.launcher import ServiceGroup, wait_for_workers  # noqa: E402
from stageferry.client import Client  # noqa: E402
from stageferry.config import PipelineConfig  # noqa: E402
from stageferry.embedded_redis import free_port  # noqa: E402
from stageferry.gateway import GatewayConfig, create_app  # noqa: E402
from stageferry.gateway.server import uvicorn_config  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402

ENCODER = ("encoder", "stageferry.stages.reference.encoder:factory", "")
MODES = {
    "streamed": [
        ENCODER,
        ("diffusion", "stageferry.stages.reference.diffusion:factory", "options = { stream_latent_frames = 1 }\n"),
        ("decode", "stageferry.stages.reference.decode:factory", ""),
    ],
    "whole": [ENCODER, ("diffusion", "stageferry.stages.reference.diffusion:factory", "")],
}


def pipeline_toml(mode: str, out: Path, device: str = "cpu", chunk_latent_frames: int = 1) -> str:
    stages = "".join(
        f'[[stages]]\nname = "{n}"\nmodel = "{m}"\ntp = 1\ndevice = "{device}"\n'
        f"{extra.replace('stream_latent_frames = 1', f'stream_latent_frames = {chunk_latent_frames}')}\n"
        for n, m, extra in MODES[mode]
    )
    return (
        f'output_dir = "{out}"\n\n[data_plane]\nconnector = "nixl"\ninline_max_bytes = 65536\n\n'
        f"[streaming]\nmax_chunks_in_flight = 4\nchunk_timeout_s = 120.0\n\n{stages}"
    )


def playable_at(body: bytes, fragmented: bool, ended: bool) -> bool:
    """Whether ``body`` (a prefix of the MP4) is playable: a whole file, or a complete first fragment."""
    if ended:
        return True
    if not fragmented:
        return False
    first = body.find(b"moof")
    return first >= 0 and body.find(b"moof", first + 4) > 0


async def download(http: httpx.AsyncClient, vid: str, submitted: float, fragmented: bool) -> tuple[float, float]:
    """(first playable, last byte) seconds after ``submitted``, polling the content until it answers 200."""
    while True:
        async with http.stream("GET", f"/v1/videos/{vid}/content") as reply:
            if reply.status_code == 200:
                body, first = b"", None
                async for piece in reply.aiter_bytes():
                    body += piece
                    if first is None and playable_at(body, fragmented, ended=False):
                        first = time.time() - submitted
                last = time.time() - submitted
                return (first if first is not None else last), last
            await reply.aread()
            if reply.status_code != 409:
                raise RuntimeError(f"{vid}: {reply.status_code} {reply.text[:300]}")
        await anyio.sleep(0.02)


async def burst(http: httpx.AsyncClient, form: dict[str, str], count: int, fragmented: bool, ids: list[str]) -> float:
    """Seconds from submitting ``count`` requests at once to the last byte of the last of them: what the
    pipeline sustains with every stage busy (its stages overlap on different requests)."""
    if count <= 0:
        return float("nan")
    started = time.time()

    async def one(i: int) -> None:
        created = await http.post("/v1/videos", data={**form, "seed": str(1000 + i)})
        created.raise_for_status()
        ids.append(created.json()["id"])
        await download(http, ids[-1], started, fragmented)

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
    return time.time() - started


def _started(server: uvicorn.Server, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)


async def run_mode(url: str, mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    prefix = f"sref-{uuid.uuid4().hex[:8]}"
    out_dir = workdir / prefix / "out"
    pipeline = workdir / f"{prefix}.toml"
    pipeline.write_text(pipeline_toml(mode, out_dir, args.device, args.chunk_latent_frames))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "STAGEFERRY_REDIS_URL": url,
        "STAGEFERRY_PREFIX": prefix,
        "STAGEFERRY_PIPELINE": str(pipeline),
        "STAGEFERRY_LOG_FORMAT": "json",
        "OMP_NUM_THREADS": "1",
    }
    stages = [n for n, _, _ in MODES[mode]]
    services = ServiceGroup(env, workdir / prefix)
    config = PipelineConfig.load(pipeline)
    port = free_port()
    gateway = GatewayConfig(redis_url=url, prefix=prefix, pipeline=config, model_name="bench")
    server = uvicorn.Server(uvicorn_config(create_app(gateway), host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    res: dict[str, Any] = {"first": [], "last": [], "single": [], "burst": []}
    form = {"prompt": "a red fox runs through deep snow", "width": str(args.width), "height": str(args.height),
            "fps": "8", "num_inference_steps": str(args.steps),
            "extra_params": json.dumps({"task": "t2va", "duration": args.duration})}  # fmt: skip
    try:
        for stage in stages:
            await services.start(
                stage, ["env", f"STAGEFERRY_REPLICA={stage}0", sys.executable, "-m", "stageferry", "serve", stage]
            )
        async with Client(url, prefix=prefix, pipeline=config) as client:
            await wait_for_workers(client.redis, client.keys, stages, timeout=180)
            await anyio.to_thread.run_sync(_started, server)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
                for i in range(args.requests + 1):  # the first warms up (NIXL handshakes, code paths)
                    submitted = time.time()
                    created = await http.post("/v1/videos", data={**form, "seed": str(i)})
                    created.raise_for_status()
                    first, last = await download(http, created.json()["id"], submitted, mode == "streamed")
                    if i:
                        res["first"].append(first * 1e3)
                        res["last"].append(last * 1e3)
                        res["single"].append(created.json()["id"])
                with GpuUtil(enabled=args.gpu_util) as util:
                    res["burst_s"] = await burst(http, form, args.burst, mode == "streamed", res["burst"])
                res["gpu_util"] = util.mean
            for key in ("single", "burst"):
                res[key] = [await stage_times(client, rid) for rid in res[key]]
            keys = [k async for k in client.redis.scan_iter(f"{prefix}:*")]
            for i in range(0, len(keys), 500):  # our own prefix only: the server is shared
                await client.redis.delete(*keys[i : i + 500])
    finally:
        server.should_exit = True
        await anyio.to_thread.run_sync(thread.join, 15)
        await services.stop()
    return res


async def stage_times(client: Client, rid: str) -> dict[str, float]:
    """Seconds by ``<stage>`` (model time; a streaming producer's: running → ``stream.done``),
    ``<stage>.<timing>`` (the model's own) and ``<stage>.backpressure_s`` for one finished request."""
    status = await client.status(rid)
    out: dict[str, float] = {}
    if status is None:
        return out
    for timing in status.timings:
        out[timing.stage] = timing.seconds
    if status.result is not None:
        last = status.timings[-1].stage if status.timings else "last"
        for name, value in (status.result.data.get("timings") or {}).items():
            if isinstance(value, int | float):
                out[f"{last}.{name}"] = float(value)
    began: dict[str, float] = {}
    for ev in await client.trace(rid):
        if ev.event == "status.running" and ev.stage is not None:
            began.setdefault(ev.stage, ev.timestamp)
        if ev.event == "stream.done" and ev.stage is not None:  # a streaming producer: no timing of its own
            out[f"{ev.stage}.backpressure_s"] = float(ev.raw.get("backpressure_s") or 0.0)
            if ev.stage in began:
                out.setdefault(ev.stage, ev.timestamp - began[ev.stage])
    return out


class GpuUtil:
    """The GPU's mean utilisation (%) while the block runs, sampled by ``nvidia-smi`` every 100 ms."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.mean = enabled, float("nan")
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> GpuUtil:
        if self.enabled:
            cmd = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        samples = [float(x) for x in out.split() if x.strip().isdigit()]
        self.mean = sum(samples) / len(samples) if samples else float("nan")


def print_breakdown(results: dict[str, dict[str, Any]]) -> None:
    """Median ms per stage and timing, one at a time and at once, streamed and whole side by side."""
    names = sorted({k for r in results.values() for key in ("single", "burst") for t in r[key] for k in t})
    print(f"{'where the time went, ms (median)':36} {'streamed 1 / at once':>20} {'whole 1 / at once':>20}")
    for name in names:
        cells = []
        for r in results.values():
            got = [[t[name] * 1e3 for t in r[key] if name in t] for key in ("single", "burst")]
            cells.append(" / ".join(f"{median(g):.1f}" if g else "-" for g in got))
        print(f"{name:36} {cells[0]:>20} {cells[1]:>20}")
    util = [r.get("gpu_util", float("nan")) for r in results.values()]
    if any(u == u for u in util):
        print(f"{'GPU utilisation during the burst, %':36} {util[0]:>20.1f} {util[1]:>20.1f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=144)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="every stage's device, TP1 (cuda: all on one GPU)")
    parser.add_argument("--burst", type=int, default=0, help="then this many requests at once (throughput)")
    parser.add_argument(
        "--chunk-latent-frames",
        type=int,
        default=1,
        help="streamed: latent frames per chunk (the diffusion stage's stream_latent_frames)",
    )
    parser.add_argument("--gpu-util", action="store_true", help="sample nvidia-smi's utilisation during the burst")
    args = parser.parse_args()
    configure_logging(fmt="auto", level="warning", service="bench")  # the in-process gateway's 409s: not news
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sref-bench-") as tmp:
        for mode in MODES:
            results[mode] = await run_mode(args.redis_url, mode, args, Path(tmp))
    s, w = results["streamed"], results["whole"]
    print(f"# the reference pipeline, streamed (3 stages, fMP4 while written) vs whole (2 stages) — {machine_facts()}")
    print(
        f"# {args.width}x{args.height}, {args.duration:g} s at 8 fps, {args.steps} steps, {args.device}, TP1; "
        f"{args.requests} requests; streamed in chunks of {args.chunk_latent_frames} latent frame(s)"
        f"{'; CUDA MPS on' if os.environ.get('CUDA_MPS_PIPE_DIRECTORY') else ''}"
    )
    print(f"{'':36} {'streamed':>20} {'whole':>20} {'streamed / whole':>17}")
    for name, key in (("submit → first playable bytes, ms", "first"), ("submit → last byte, ms", "last")):
        print(f"{name:36} {cell(s[key], 1):>20} {cell(w[key], 1):>20} {median(s[key]) / median(w[key]):>17.3f}")
    rate = {k: len(r["last"]) / (sum(r["last"]) / 1e3) for k, r in results.items()}  # one request at a time
    ratio = rate["streamed"] / rate["whole"]
    print(f"{'throughput, requests/s':36} {rate['streamed']:>20.3f} {rate['whole']:>20.3f} {ratio:>17.3f}")
    if args.burst > 0:
        rate = {k: args.burst / r["burst_s"] for k, r in results.items()}
        ratio = rate["streamed"] / rate["whole"]
        name = f"throughput, {args.burst} at once, req/s"
        print(f"{name:36} {rate['streamed']:>20.3f} {rate['whole']:>20.3f} {ratio:>17.3f}")
    print("(cells: median / p99; at the client, through the gateway; one request at a time unless 'at once')")
    print_breakdown(results)


if __name__ == "__main__":
    anyio.run(main)
