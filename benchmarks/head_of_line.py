"""Head-of-line blocking: small control envelopes through Redis while Ref2VA-sized payloads flow.

    python benchmarks/head_of_line.py                       # 10 s per phase
    python benchmarks/head_of_line.py --seconds 20 --gap-ms 50

This is why the data plane exists.  A probe (this process) XADDs a 200-byte control envelope every
``--probe-ms`` and a second connection XREAD-BLOCKs it, timing XADD → received.  Three phases, one run:

* ``idle``   — nothing else flows;
* ``nixl``   — a producer and a consumer (separate processes, as two stage leaders) move Ref2VA payloads
  (64,963,792 bytes) back to back with ``--gap-ms`` between hops: envelopes through Redis, bytes over NIXL;
* ``inline`` — the same flow with every payload inline in its stream entry, through Redis.

Printed: the probe's p50/p99/max per phase, its p99 against idle, and the payload rate each phase
reached.  Target: with bulk payloads over NIXL the control p99 stays within 2× of idle.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402
from bench_stats import TASK_BYTES, machine_facts, median, pct, verdict  # noqa: E402
from transfer import Consumer, FanOut, bench_client, connector  # noqa: E402

from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402

HOL_TARGET = 2.0  # control p99 with NIXL bulk flowing / idle p99
PROBE_BYTES = 200
REF2VA = TASK_BYTES["Ref2VA"]
POOL_BYTES = 4 * REF2VA
TRANSFER_SCRIPT = str(Path(__file__).resolve().parent / "transfer.py")  # its producer role feeds the bulk flow


async def bulk_consumer(args: argparse.Namespace) -> None:
    """Fetch Ref2VA payloads one after another until the stop key appears; report the count."""
    redis, bench = connect(args.redis_url), bench_client(args.redis_url)
    conn = connector(redis, args.prefix, "hol-consumer", POOL_BYTES, torch.device("cpu"))
    await anyio.to_thread.run_sync(conn.open)
    hops = 0
    async with anyio.create_task_group() as tg:
        await tg.start(conn.run)
        c = Consumer(bench, conn, args.prefix, torch.device("cpu"), FanOut(1))
        await c.hop(args.op, REF2VA, 0)  # warm-up: handshake
        await bench.rpush(f"{args.prefix}:hol:started", b"1")
        while not await bench.exists(f"{args.prefix}:hol:stop"):
            await c.hop(args.op, REF2VA, hops)
            hops += 1
            await anyio.sleep(args.gap_ms / 1000)
        await bench.rpush(f"{args.prefix}:hol:hops", str(hops).encode())
        tg.cancel_scope.cancel()
    await conn.aclose()
    await redis.aclose()
    await bench.aclose()


async def probe(url: str, prefix: str, seconds: float, every_ms: float) -> list[float]:
    """XADD → XREAD latencies (ms) of small envelopes for ``seconds``."""
    sender, receiver = bench_client(url), bench_client(url)
    stream = f"{prefix}:hol:ctl"
    body = b"x" * PROBE_BYTES
    sent: dict[bytes, int] = {}
    latencies: list[float] = []
    end = time.monotonic() + seconds

    async def receive() -> None:
        last = b"$"
        while time.monotonic() < end + 5 and (len(latencies) < len(sent) or time.monotonic() < end):
            reply = await receiver.xread({stream: last}, block=500, count=100)
            now = time.monotonic_ns()
            for _, entries in reply or []:
                for eid, fields in entries:
                    last = eid
                    latencies.append((now - int(fields[b"t"])) / 1e6)

    async with anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await anyio.sleep(0.2)  # the reader is blocked on the stream before the first envelope
        while time.monotonic() < end:
            t = time.monotonic_ns()
            eid = await sender.xadd(stream, {"t": t, "body": body}, maxlen=1000, approximate=True)
            sent[eid] = t
            await anyio.sleep(every_ms / 1000)
    await sender.delete(stream)
    await sender.aclose()
    await receiver.aclose()
    return latencies


def spawn(args: argparse.Namespace, prefix: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, *extra, "--prefix", prefix, "--redis-url", args.redis_url]
    return subprocess.Popen(cmd)


async def phase(args: argparse.Namespace, op: str | None) -> dict[str, Any]:
    prefix = f"hol-{uuid.uuid4().hex[:8]}"
    procs: list[subprocess.Popen[bytes]] = []
    bench = bench_client(args.redis_url)
    hops = 0
    try:
        if op is not None:
            procs.append(spawn(args, prefix, TRANSFER_SCRIPT, "--role", "producer", "--pool-bytes", str(POOL_BYTES)))
            procs.append(spawn(args, prefix, __file__, "--role", "bulk", "--op", op, "--gap-ms", str(args.gap_ms)))
            await bench.blpop([f"{prefix}:hol:started"], timeout=120)
        latencies = await probe(args.redis_url, prefix, args.seconds, args.probe_ms)
        if op is not None:
            await bench.set(f"{prefix}:hol:stop", b"1")
            reply = await bench.blpop([f"{prefix}:hol:hops"], timeout=120)
            hops = int(reply[1]) if reply else 0
            await bench.rpush(f"{prefix}:bench:cmd", json.dumps({"op": "stop"}))
    finally:
        for p in procs:
            try:
                await anyio.to_thread.run_sync(partial(p.wait, timeout=30))
            except subprocess.TimeoutExpired:
                p.kill()
        keys = [k async for k in bench.scan_iter(match=f"{prefix}:*")]
        if keys:
            await bench.delete(*keys)
        await bench.aclose()
    return {"latency": latencies, "payloads_per_s": hops / args.seconds}


async def main_async(args: argparse.Namespace) -> int:
    phases: dict[str, dict[str, Any]] = {}
    for name, op in (("idle", None), ("nixl", "nixl"), ("inline", "inline")):
        phases[name] = await phase(args, op)
        print(f"# phase {name}: {len(phases[name]['latency'])} probes", file=sys.stderr, flush=True)
    print(f"machine: {machine_facts()}")
    print(
        f"probe: {PROBE_BYTES}-byte envelope every {args.probe_ms:g} ms, XADD → XREAD; {args.seconds:g} s per phase; "
        f"bulk: Ref2VA ({REF2VA:,} B) payloads back to back, {args.gap_ms:g} ms apart\n"
    )
    print("## Head-of-line blocking: control-envelope latency (ms) while bulk payloads flow\n")
    print("| phase | probes | p50 | p99 | max | p99 / idle p99 | Ref2VA payloads/s moved |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    idle_p99 = pct(phases["idle"]["latency"], 99)
    for name, r in phases.items():
        lat = r["latency"]
        print(
            f"| {name} | {len(lat)} | {median(lat):.3f} | {pct(lat, 99):.3f} | {max(lat):.3f} "
            f"| {pct(lat, 99) / idle_p99:.1f}× | {r['payloads_per_s']:.1f} |"
        )
    ratio = pct(phases["nixl"]["latency"], 99) / idle_p99
    holds = ratio <= HOL_TARGET
    print(
        f"\ncontrol-envelope p99 with bulk payloads flowing over NIXL within {HOL_TARGET:g}× of idle: "
        f"{verdict(holds)} ({ratio:.2f}×; inline: {pct(phases['inline']['latency'], 99) / idle_p99:.1f}×)"
    )
    return 0 if holds else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--probe-ms", type=float, default=5.0)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--role", choices=["main", "bulk"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--op", choices=["nixl", "inline"], help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    configure_logging(fmt="json", level="warning", service=f"hol-{args.role}")
    if args.role == "bulk":
        anyio.run(bulk_consumer, args)
        return 0
    print(f"$ python {' '.join(sys.argv)}\n")
    return anyio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
