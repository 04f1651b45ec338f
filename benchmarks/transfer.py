"""A payload hop on one CPU host: NIXL (DRAM -> DRAM over UCX) against inline through Redis Streams.

    python benchmarks/cpu_transfer.py                         # 4 KiB .. 256 MiB and the three task payloads
    python benchmarks/cpu_transfer.py --iters 50 --sizes 359024,65536
    python benchmarks/cpu_transfer.py | tee benchmarks/results/cpu_transfer.txt

Two processes, wired like the tests: a producer process (this script with ``--role producer``) holding a
real :class:`NixlConnector`, and the consumer (this process) with its own.  Every iteration is lock-step:
the consumer asks for one payload, the producer puts it and XADDs the envelope to a stream, the consumer
XREADs it and fetches the payload (``get``) until it holds the tensors.  Per size and iteration the three
paths run side by side (interleaved): NIXL, inline through Redis, and a plain torch memcpy of the same
bytes in this process.

* NIXL: ``NixlConnector.put`` (inline_max_bytes=0, so even 4 KiB goes over NIXL), the reference in the
  entry, ``NixlConnector.get``.
* inline: ``InlineConnector.encode``, the blob in the same entry, ``InlineConnector.get`` (decode).

Timestamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for every process on the host):
``t0`` put/encode starts, ``t1`` put/encode returned (XADD starts), ``t2`` XREAD returned the entry in the
consumer, ``t3`` the consumer holds the payload.  get = t3 - t2, delivery = t3 - t1, hop = t3 - t0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import torch  # noqa: E402

from stageferry.broker.inline import InlineConnector  # noqa: E402
from stageferry.broker.keys import Keys  # noqa: E402
from stageferry.broker.nixl_connector import NixlConnector  # noqa: E402
from stageferry.broker.redis_conn import connect  # noqa: E402
from stageferry.config import DataPlaneConfig, Timeouts  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import InlinePayload, NixlPayload, PayloadRef  # noqa: E402
from stageferry.testing import TASKS, sized_payload, tensor_bytes  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = sorted([4 * KiB * 4**i for i in range(9)] + [nbytes for _, nbytes in TASKS.values()])  # 4 KiB..256 MiB
TASK_OF_SIZE = {nbytes: name for name, (_, nbytes) in TASKS.items()}
WARMUP = 3
INLINE_CAP = 1 << 30
HOP_TARGET_MS = 2.0  # T2VA hop, p50
RATIO_TARGET = 20.0  # Ref2VA: inline through Redis / NIXL


def payload_for(nbytes: int) -> Any:
    """The task payload of that size, else one uint8 tensor of exactly ``nbytes``."""
    task = TASK_OF_SIZE.get(nbytes)
    return TASKS[task][0]() if task else sized_payload(nbytes)


def data_plane(pool_bytes: int) -> DataPlaneConfig:
    return DataPlaneConfig(inline_max_bytes=0, cpu_pool_bytes=pool_bytes, inline_fallback_max_bytes=256 * MiB)


def connector(redis: Any, prefix: str, stage: str, pool_bytes: int) -> NixlConnector:
    conn = NixlConnector(
        redis=redis,
        keys=Keys(prefix),
        stage=stage,
        replica="bench",
        config=data_plane(pool_bytes),
        timeouts=Timeouts(pool_wait=60.0),
    )
    conn.inline = InlineConnector(max_bytes=INLINE_CAP, max_payload_bytes=INLINE_CAP, cuda_device=None)
    return conn


def bench_client(url: str) -> Any:
    """The benchmark's own traffic (commands, envelopes): a 256 MiB entry outlasts connect()'s socket timeout."""
    return aioredis.from_url(url, decode_responses=False, socket_timeout=300)


# -- producer process --------------------------------------------------------------------------------------


async def producer(args: argparse.Namespace) -> None:
    redis, bench = connect(args.redis_url), bench_client(args.redis_url)
    conn = connector(redis, args.prefix, "bench-producer", args.pool_bytes)
    conn.open()
    assert conn.agent is not None, f"producer has no NIXL agent: {conn.unavailable_reason}"
    payloads: dict[int, Any] = {}
    cmd_key, env_key = f"{args.prefix}:bench:cmd", f"{args.prefix}:bench:env"
    async with anyio.create_task_group() as tg:
        await tg.start(conn.run)
        await bench.rpush(f"{args.prefix}:bench:ready", b"1")
        while True:
            item = await bench.blpop([cmd_key], timeout=1)
            if item is None:
                continue
            cmd = json.loads(item[1])
            if cmd["op"] == "stop":
                break
            nbytes = cmd["nbytes"]
            if nbytes not in payloads:
                payloads.clear()  # one size at a time: keep memory flat
                payloads[nbytes] = payload_for(nbytes)
            payload = payloads[nbytes]
            t0 = time.monotonic_ns()
            if cmd["op"] == "nixl":
                out = await conn.put(f"bench-{cmd['i']}", payload)
            else:
                out = await conn.inline.encode(payload)
            t1 = time.monotonic_ns()
            fields: dict[str, Any] = {
                "ref": out.ref.model_dump_json(),
                "t0": t0,
                "t1": t1,
                "registrations": conn.agent.registrations,
            }
            if out.blob is not None:
                fields["blob"] = out.blob
            await bench.xadd(env_key, fields)
        tg.cancel_scope.cancel()
    await conn.aclose()
    await redis.aclose()
    await bench.aclose()


# -- consumer (this process) -------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} / {pct(values, 99):.3f}"


def human(n: int) -> str:
    if n in TASK_OF_SIZE:
        return f"{n:,} ({TASK_OF_SIZE[n]})"
    for unit, size in (("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n:,}"


class Consumer:
    def __init__(self, redis: Any, conn: NixlConnector, prefix: str) -> None:
        self.redis = redis
        self.conn = conn
        self.cmd_key, self.env_key = f"{prefix}:bench:cmd", f"{prefix}:bench:env"
        self.last = "0-0"
        self.producer_registrations: list[int] = []
        from pydantic import TypeAdapter

        self.refs: TypeAdapter[PayloadRef] = TypeAdapter(PayloadRef)

    async def hop(self, op: str, nbytes: int, i: int) -> dict[str, float]:
        """One lock-step hop; milliseconds of put, get, delivery and hop."""
        await self.redis.rpush(self.cmd_key, json.dumps({"op": op, "nbytes": nbytes, "i": i}))
        reply = None
        while not reply:
            reply = await self.redis.xread({self.env_key: self.last}, block=1000, count=1)
        t2 = time.monotonic_ns()
        (_, [(eid, fields)]) = reply[0]
        self.last = eid
        ref = self.refs.validate_json(fields[b"ref"])
        blob = fields.get(b"blob")
        if op == "nixl":
            assert isinstance(ref, NixlPayload), ref
            ctx = self.conn.get(ref, blob, key=f"bench-{i}")
        else:
            assert isinstance(ref, InlinePayload), ref
            ctx = self.conn.inline.get(ref, blob, key=f"bench-{i}")
        async with ctx as incoming:
            t3 = time.monotonic_ns()
            assert tensor_bytes(incoming.payload) <= incoming.nbytes
        await self.redis.xdel(self.env_key, eid)
        self.producer_registrations.append(int(fields[b"registrations"]))
        t0, t1 = int(fields[b"t0"]), int(fields[b"t1"])
        return {"put": (t1 - t0) / 1e6, "get": (t3 - t2) / 1e6, "delivery": (t3 - t1) / 1e6, "hop": (t3 - t0) / 1e6}


def memcpy_ms(src: torch.Tensor, dst: torch.Tensor) -> float:
    t0 = time.perf_counter_ns()
    dst.copy_(src)
    return (time.perf_counter_ns() - t0) / 1e6


def pool_bytes_for(sizes: list[int]) -> int:
    return max(256 * MiB, 2 * max(sizes) + 16 * MiB)  # two slots of the largest payload fit


def start_producer(args: argparse.Namespace, prefix: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--role", "producer", "--prefix", prefix]
    cmd += ["--redis-url", args.redis_url, "--pool-bytes", str(pool_bytes_for(args.sizes))]
    return subprocess.Popen(cmd)


async def consumer_main(args: argparse.Namespace, prefix: str, proc: subprocess.Popen[bytes]) -> int:
    pool_bytes = pool_bytes_for(args.sizes)
    redis, bench = connect(args.redis_url), bench_client(args.redis_url)
    conn = connector(redis, prefix, "bench-consumer", pool_bytes)
    await anyio.to_thread.run_sync(conn.open)
    assert conn.agent is not None, f"consumer has no NIXL agent: {conn.unavailable_reason}"
    results: dict[int, dict[str, dict[str, list[float]]]] = {}
    registrations: tuple[int, int] = (0, 0)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(conn.run)
            with anyio.fail_after(60):
                await bench.blpop([f"{prefix}:bench:ready"], timeout=60)
            c = Consumer(bench, conn, prefix)
            # Warm-up: connection set-up to the peer, allocator and code paths; not counted.
            for nbytes in args.sizes[:1]:
                for i in range(WARMUP):
                    await c.hop("nixl", nbytes, i)
                    await c.hop("inline", nbytes, i)
            regs_before = conn.agent.registrations
            c.producer_registrations.clear()
            gets_before = conn.counters.reads
            for nbytes in args.sizes:
                src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                dst = torch.empty_like(src)
                for i in range(WARMUP):
                    await c.hop("nixl", nbytes, i)
                    await c.hop("inline", nbytes, i)
                    memcpy_ms(src, dst)
                row: dict[str, dict[str, list[float]]] = {"nixl": {}, "inline": {}, "memcpy": {"copy": []}}
                for i in range(args.iters):  # side by side: one of each per iteration
                    for op in ("nixl", "inline"):
                        for k, v in (await c.hop(op, nbytes, i)).items():
                            row[op].setdefault(k, []).append(v)
                    row["memcpy"]["copy"].append(memcpy_ms(src, dst))
                results[nbytes] = row
                del src, dst
                print(f"# measured {human(nbytes)}", file=sys.stderr, flush=True)
            regs_after = conn.agent.registrations
            requests = conn.counters.reads - gets_before
            registrations = (regs_after - regs_before, requests)
            prod_regs = c.producer_registrations
            await bench.rpush(f"{prefix}:bench:cmd", json.dumps({"op": "stop"}))
            tg.cancel_scope.cancel()
    finally:
        await conn.aclose()
        await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        keys = [k async for k in redis.scan_iter(match=f"{prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
        await bench.aclose()
    return report(args, results, registrations, prod_regs)


def report(
    args: argparse.Namespace,
    results: dict[int, dict[str, dict[str, list[float]]]],
    registrations: tuple[int, int],
    prod_regs: list[int],
) -> int:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, iters={args.iters}, warm-up {WARMUP}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} CPUs; load average at the end {load} (other work on the host skews every column)")
    print("times in ms, median / p99 of one run; NIXL with inline_max_bytes=0 (every size goes over NIXL)\n")
    print("## 1. Transfer")
    print()
    print(
        "| bytes | NIXL put | NIXL get (ref received → held) | NIXL delivery (XADD → held) "
        "| inline encode | inline delivery (XADD → XREAD → decoded) | torch memcpy "
        "| inline/NIXL delivery | NIXL get/memcpy | NIXL get GB/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for nbytes, row in results.items():
        n, il, mc = row["nixl"], row["inline"], row["memcpy"]["copy"]
        ratio = statistics.median(il["delivery"]) / statistics.median(n["delivery"])
        vs_copy = statistics.median(n["get"]) / statistics.median(mc)
        gbs = nbytes / statistics.median(n["get"]) / 1e6
        print(
            f"| {human(nbytes)} | {fmt(n['put'])} | {fmt(n['get'])} | {fmt(n['delivery'])} | {fmt(il['put'])} "
            f"| {fmt(il['delivery'])} | {fmt(mc)} | {ratio:.1f}× | {vs_copy:.1f}× | {gbs:.2f} |"
        )
    ok = True
    ref2va = TASKS["Ref2VA"][1]
    if ref2va in results:
        row = results[ref2va]
        hop_ratio = statistics.median(row["inline"]["hop"]) / statistics.median(row["nixl"]["hop"])
        del_ratio = statistics.median(row["inline"]["delivery"]) / statistics.median(row["nixl"]["delivery"])
        holds = hop_ratio >= RATIO_TARGET
        ok &= holds
        print(
            f"\nRef2VA payload over NIXL ≥ {RATIO_TARGET:.0f}× faster than through Redis inline: "
            f"{'HOLDS' if holds else 'DOES NOT HOLD'} — put start → held (p50) {hop_ratio:.1f}× "
            f"(delivery only, XADD → held: {del_ratio:.1f}×)"
        )
    print("\n## 2. Hop latency (producer's put start → consumer holds the tensors)\n")
    print("| task | bytes | NIXL p50 | NIXL p99 | inline p50 | inline p99 | inline/NIXL p50 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (_, nbytes) in TASKS.items():
        if nbytes not in results:
            continue
        n, il = results[nbytes]["nixl"]["hop"], results[nbytes]["inline"]["hop"]
        print(
            f"| {name} | {nbytes:,} | {statistics.median(n):.3f} | {pct(n, 99):.3f} | {statistics.median(il):.3f} "
            f"| {pct(il, 99):.3f} | {statistics.median(il) / statistics.median(n):.1f}× |"
        )
    t2va = TASKS["T2VA"][1]
    if t2va in results:
        p50 = statistics.median(results[t2va]["nixl"]["hop"])
        holds = p50 <= HOP_TARGET_MS
        ok &= holds
        print(
            f"\nadded hop latency for a T2VA payload ≤ {HOP_TARGET_MS:g} ms p50: "
            f"{'HOLDS' if holds else 'DOES NOT HOLD'} ({p50:.3f} ms over NIXL, including the envelope's XADD/XREAD)"
        )
    added, requests = registrations
    print("\n## 3. Memory registrations per request after warm-up\n")
    print(
        f"consumer: {added} new registrations over {requests} NIXL requests "
        f"({added / max(requests, 1):.3f} per request); producer: registrations "
        f"{min(prod_regs, default=-1)}..{max(prod_regs, default=-1)} over the same requests"
    )
    assert added == 0, "the consumer registered memory per request"
    assert len(set(prod_regs)) == 1, "the producer registered memory per request"
    print("registrations per request after warm-up: 0 (asserted)")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--sizes",
        type=lambda s: sorted({int(x) for x in s.split(",")}),
        default=DEFAULT_SIZES,
        help="comma-separated byte counts (task payload sizes use the task payloads)",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--role", choices=["consumer", "producer"], default="consumer", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--pool-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two processes on a 2-core host, as in the tests; memcpy gets one thread too
    configure_logging(fmt="json", level="info", service=f"bench-{args.role}")  # as deployed; to stderr
    if args.role == "producer":
        anyio.run(producer, args)
        return 0
    print(f"$ .venv/bin/python {' '.join(sys.argv)}\n")
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    proc = start_producer(args, prefix)
    try:
        return anyio.run(consumer_main, args, prefix, proc)
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
