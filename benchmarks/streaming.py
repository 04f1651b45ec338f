"""Chunked streaming vs whole payloads between two stages, side by side from one run (issue 40).

    python benchmarks/streaming.py                       # 8 chunks of 256 KiB, 20 ms a step, CPU
    python benchmarks/streaming.py --chunks 16 --chunk-kib 512 --requests 12

Real services: per mode a private key prefix and ``stageferry serve`` processes for an ``encoder`` (the
AR-style producer of ``benchmarks/stream_model.py``: one chunk every ``--step-ms``) and a ``diffusion``
stage (the consumer: ``--consume-ms`` per chunk's worth of data), over NIXL on CPU.  ``chunked``: the
producer emits each chunk as it is made and the consumer starts on chunk 0; ``whole``: the same bytes
and the same compute, handed on as one payload after the last step.  Printed, median / p99:

* **time to first chunk** at the consumer (submit → the first chunk, or the whole payload, in the
  consumer model's hands) and submit → done, over ``--requests`` requests one after another;
* **the hop**: the consumer's get of one chunk against the get of the whole payload (NIXL READ and
  unpack; ``transfer_seconds``), and, for chunks, announced → in hand (the stream's own latency);
* **throughput**: requests/s with ``--requests`` submitted at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
from bench_stats import cell, machine_facts, median  # noqa: E402

from stageferry.cli.launcher import ServiceGroup, wait_for_workers  # noqa: E402
from stageferry.client import Client  # noqa: E402
from stageferry.config import PipelineConfig  # noqa: E402
from stageferry.schemas import RequestState  # noqa: E402
from stageferry.trace.events import TraceEvent  # noqa: E402

STAGES = {"encoder": "benchmarks.stream_model:producer", "diffusion": "benchmarks.stream_model:consumer"}


def pipeline_toml(chunk_bytes: int, chunks: int, device: str = "cpu") -> str:
    stages = "".join(
        f'[[stages]]\nname = "{n}"\nmodel = "{m}"\ntp = 1\ndevice = "{device}"\n\n' for n, m in STAGES.items()
    )
    pool = max(256 << 20, 8 * chunk_bytes * chunks)
    return (
        f'[data_plane]\nconnector = "nixl"\ninline_max_bytes = 65536\ncpu_pool_bytes = {pool}\n\n'
        "[streaming]\nmax_chunks_in_flight = 4\nchunk_timeout_s = 60.0\n\n"
        f"[limits]\nmax_entry_bytes = {256 << 20}\n\n{stages}"
    )


async def chunk_events(client: Client, rid: str, want: int, within_s: float = 10.0) -> list[TraceEvent]:
    """The request's ``chunk.received`` events, once ``want`` of them are in its trace: each service's
    event sink forwards its log lines a moment after the request is done, so the trace read right after
    ``wait`` may not hold them yet.  Fewer after ``within_s``: what there is, said on stderr."""
    deadline = time.monotonic() + within_s
    while True:
        events = [ev for ev in await client.trace(rid) if ev.event == "chunk.received"]
        if len(events) >= want or time.monotonic() > deadline:
            if len(events) < want:
                print(f"{rid}: {len(events)} of {want} chunk.received events in its trace", file=sys.stderr)
            return events
        await asyncio.sleep(0.05)


async def run_mode(url: str, mode: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    prefix = f"strm-{uuid.uuid4().hex[:8]}"
    chunk_bytes = args.chunk_kib << 10
    pipeline = workdir / f"{prefix}.toml"
    pipeline.write_text(pipeline_toml(chunk_bytes, args.chunks, args.device))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "STAGEFERRY_REDIS_URL": url,
        "STAGEFERRY_PREFIX": prefix,
        "STAGEFERRY_PIPELINE": str(pipeline),
        "STAGEFERRY_LOG_FORMAT": "json",
        "STAGEFERRY_BENCH_MODE": mode,
        "STAGEFERRY_BENCH_CHUNKS": str(args.chunks),
        "STAGEFERRY_BENCH_CHUNK_BYTES": str(chunk_bytes),
        "STAGEFERRY_BENCH_STEP_S": str(args.step_ms / 1000),
        "STAGEFERRY_BENCH_CONSUME_S": str(args.consume_ms / 1000),
        "OMP_NUM_THREADS": "1",
    }
    services = ServiceGroup(env, workdir / prefix)
    config = PipelineConfig.load(pipeline)
    out: dict[str, Any] = {"first": [], "done": [], "get": [], "announced": [], "rps": 0.0, "failed": 0}
    try:
        for stage in STAGES:
            await services.start(
                stage, ["env", f"STAGEFERRY_REPLICA={stage}0", sys.executable, "-m", "stageferry", "serve", stage]
            )
        async with Client(url, prefix=prefix, pipeline=config) as client:
            await wait_for_workers(client.redis, client.keys, list(STAGES), timeout=120)
            job = {"task": "t2va", "prompt": "stream", "width": 64, "height": 64, "num_inference_steps": 1}
            for i in range(2):  # warm-up: NIXL handshakes, code paths
                await client.wait(await client.submit({**job, "seed": i}), timeout=120)
            for i in range(args.requests):  # one after another: latency
                submitted = time.time()
                rid = await client.submit({**job, "seed": 100 + i})
                status = await client.wait(rid, timeout=300)
                if status.state is not RequestState.DONE:
                    out["failed"] += 1
                    continue
                res = json.loads(await client.result_bytes(rid) or b"{}")
                out["first"].append((res["first_at"] - submitted) * 1e3)
                out["done"].append((res["done_at"] - submitted) * 1e3)
                if mode == "chunked":
                    for ev in await chunk_events(client, rid, args.chunks):
                        out["get"].append(float(ev.raw["seconds"]) * 1e3)
                        out["announced"].append(float(ev.raw["hop_s"]) * 1e3)
                else:
                    out["get"] += [t.transfer_seconds * 1e3 for t in status.timings if t.stage == "diffusion"]
            started = time.perf_counter()  # all at once: throughput
            rids = [await client.submit({**job, "seed": 1000 + i}) for i in range(args.requests)]
            done = 0

            async def wait_one(rid: str) -> None:
                nonlocal done
                status = await client.wait(rid, timeout=600)
                done += status.state is RequestState.DONE
                if status.state is not RequestState.DONE:
                    print(f"{mode} {rid}: {status.state.value} {status.error}", file=sys.stderr)

            async with anyio.create_task_group() as tg:
                for rid in rids:
                    tg.start_soon(wait_one, rid)
            out["rps"] = done / (time.perf_counter() - started)
            out["failed"] += args.requests - done
            keys = [k async for k in client.redis.scan_iter(f"{prefix}:*")]
            for i in range(0, len(keys), 500):  # our own prefix only: the server is shared
                await client.redis.delete(*keys[i : i + 500])
    finally:
        await services.stop()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="every stage's device: cpu or cuda (both on GPU 0)")
    parser.add_argument("--chunk-kib", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--consume-ms", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        for mode in ("chunked", "whole"):
            results[mode] = await run_mode(args.redis_url, mode, args, Path(tmp))
    c, w = results["chunked"], results["whole"]
    total = args.chunks * args.chunk_kib
    print(f"# streaming vs whole payloads — {machine_facts()}")
    print(
        f"# {args.chunks} chunks × {args.chunk_kib} KiB = {total} KiB a request, NIXL on {args.device}; producer "
        f"{args.step_ms:g} ms a chunk, consumer {args.consume_ms:g} ms a chunk; {args.requests} requests"
    )
    print(f"{'':34} {'chunked':>20} {'whole':>20} {'chunked / whole':>16}")
    rows = [
        ("time to first chunk, ms", c["first"], w["first"]),
        ("submit → done, ms", c["done"], w["done"]),
        ("hop: get (READ+unpack), ms", c["get"], w["get"]),
    ]
    for name, a, b in rows:
        print(f"{name:34} {cell(a, 2):>20} {cell(b, 2):>20} {median(a) / median(b):>16.3f}")
    print(f"{'hop: chunk announced → in hand, ms':34} {cell(c['announced'], 2):>20} {'—':>20}")
    print(f"{'throughput, requests/s':34} {c['rps']:>20.2f} {w['rps']:>20.2f} {c['rps'] / w['rps']:>16.3f}")
    print(f"failed: chunked {c['failed']}, whole {w['failed']}  (cells: median / p99)")


if __name__ == "__main__":
    anyio.run(main)
