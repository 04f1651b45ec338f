"""Multi-lane READ of a large DRAM region, side by side with memcpy of the same bytes.

    python benchmarks/read_lanes.py                                  # 14 MB and 65 MB, 20 iterations
    python benchmarks/read_lanes.py --sizes 64963792 --lanes 1,4,8 --threads 0,4,8

Two processes (a producer that registers and fills a DRAM buffer, this consumer), NIXL over UCX (CMA on
one host), as the data plane READs.  For each size, one row per way of moving the bytes:

* ``memcpy`` — ``dst.copy_(src)`` in one thread, and a K-thread memcpy (K pieces, K threads: torch
  releases the GIL in ``copy_``), in this process: the ceiling a READ is compared with;
* ``READ lanes=K threads=T`` — the region as K descriptors of ONE transfer, by an agent whose UCX backend
  has ``num_threads=T`` (``data_plane.read_lanes`` / ``ucx_threads``; T=0 is NIXL's default engine);
* ``READ K transfers`` — K transfers of one descriptor each, posted together (T=0).

Medians and p99 over ``--iters`` after 3 warm-ups; a READ row's bytes are checked (sum) once.
Which UCX threads engine splits descriptors is NIXL's ``nixlUcxThreadPoolEngine`` (chosen when
``num_threads`` > 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis as sync_redis  # noqa: E402
import torch  # noqa: E402

from stageferry.broker.data.nixl.agent import NixlAgent, XferState  # noqa: E402
from stageferry.broker.data.nixl.reads import lane_spans  # noqa: E402
from stageferry.schemas.payload import MemKind  # noqa: E402

WARMUP = 3


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def producer(args: argparse.Namespace) -> None:
    """Register a filled buffer, publish (metadata, address) in Redis, wait for the stop key."""
    r = sync_redis.Redis.from_url(args.redis_url)
    agent = NixlAgent(f"lanes-producer-{os.getpid()}")
    src = torch.randint(0, 255, (max(args.sizes),), dtype=torch.uint8)
    agent.register(src)
    r.set(f"{args.prefix}:meta", agent.metadata())
    sums = {n: int(src[:n].sum()) for n in args.sizes}
    r.set(f"{args.prefix}:addr", json.dumps([src.data_ptr(), sums]))
    while not r.exists(f"{args.prefix}:stop"):
        time.sleep(0.05)
    agent.close()


def wait(agent: NixlAgent, handles: list[object]) -> None:
    for h in handles:
        while agent.poll(h) is not XferState.DONE:
            pass
        agent.release(h)


def time_ms(fn: object, iters: int) -> tuple[float, float]:
    values = []
    for i in range(iters + WARMUP):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        if i >= WARMUP:
            values.append((time.perf_counter() - t) * 1e3)
    values.sort()
    return statistics.median(values), values[int(0.99 * (len(values) - 1))]


def consumer(args: argparse.Namespace) -> None:
    prefix = f"lanes-{os.getpid()}"
    r = sync_redis.Redis.from_url(args.redis_url)
    cmd = [sys.executable, __file__, "--role", "producer", "--prefix", prefix, "--redis-url", args.redis_url]
    proc = subprocess.Popen([*cmd, "--sizes", ",".join(map(str, args.sizes))])
    try:
        while not r.exists(f"{prefix}:addr"):
            time.sleep(0.05)
        meta = r.get(f"{prefix}:meta")
        src_addr, sums = json.loads(r.get(f"{prefix}:addr"))  # type: ignore[arg-type]
        agents = {t: NixlAgent(f"lanes-consumer-{t}-{os.getpid()}", ucx_threads=t) for t in args.threads}
        dst = torch.empty(max(args.sizes), dtype=torch.uint8)
        remote = ""
        for agent in agents.values():
            agent.register(dst)
            remote = agent.add_remote(meta)  # type: ignore[arg-type]
        src_local = torch.randint(0, 255, (max(args.sizes),), dtype=torch.uint8)
        pool = ThreadPoolExecutor(max(args.lanes))
        print(f"$ python {' '.join(sys.argv)}\n")
        print(f"cpus: {os.cpu_count()}, load: {os.getloadavg()[0]:.2f}, torch threads: {torch.get_num_threads()}\n")
        print("| bytes | how | p50 ms | p99 ms | GB/s (p50) | vs 1-thread memcpy |")
        print("| ---: | --- | ---: | ---: | ---: | ---: |")
        for n in args.sizes:
            rows: list[tuple[str, tuple[float, float]]] = []
            memcpy = time_ms(lambda n=n: dst[:n].copy_(src_local[:n]), args.iters)
            rows.append(("memcpy, 1 thread", memcpy))
            for k in args.lanes:
                if k > 1:

                    def par(n: int = n, k: int = k) -> None:
                        spans = lane_spans(n, k)
                        list(pool.map(lambda s: dst[s[0] : s[0] + s[1]].copy_(src_local[s[0] : s[0] + s[1]]), spans))

                    rows.append((f"memcpy, {k} threads", time_ms(par, args.iters)))
            for t, agent in agents.items():
                for k in args.lanes:

                    def read(n: int = n, k: int = k, agent: NixlAgent = agent) -> None:
                        spans = lane_spans(n, k)
                        h = agent.start_read(
                            [(dst.data_ptr() + o, ln, 0) for o, ln in spans],
                            MemKind.DRAM,
                            [(src_addr + o, ln, 0) for o, ln in spans],
                            MemKind.DRAM,
                            remote,
                            b"",
                        )
                        wait(agent, [h])

                    dst.zero_()
                    result = time_ms(read, args.iters)
                    assert int(dst[:n].sum()) == sums[str(n)], "bytes differ"
                    rows.append((f"READ lanes={k} threads={t} (one transfer)", result))
            agent = agents[min(agents)]
            for k in args.lanes:
                if k > 1:

                    def multi(n: int = n, k: int = k, agent: NixlAgent = agent) -> None:
                        hs = [
                            agent.start_read(
                                [(dst.data_ptr() + o, ln, 0)],
                                MemKind.DRAM,
                                [(src_addr + o, ln, 0)],
                                MemKind.DRAM,
                                remote,
                                b"",
                            )
                            for o, ln in lane_spans(n, k)
                        ]
                        wait(agent, hs)

                    rows.append((f"READ {k} transfers threads={min(agents)}", time_ms(multi, args.iters)))
            for how, (p50, p99) in rows:
                print(f"| {n:,} | {how} | {p50:.3f} | {p99:.3f} | {n / p50 / 1e6:.1f} | {memcpy[0] / p50:.2f}× |")
        for agent in agents.values():
            agent.close()
    finally:
        r.set(f"{prefix}:stop", 1)
        proc.wait(30)
        for key in ("meta", "addr", "stop"):
            r.delete(f"{prefix}:{key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=sizes, default=[14_000_000, 64_963_792])
    parser.add_argument("--lanes", type=sizes, default=[1, 2, 4, 8])
    parser.add_argument("--threads", type=sizes, default=[0, 4, 8], help="UCX backend num_threads per agent")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--role", choices=["consumer", "producer"], default="consumer", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.role == "producer":
        producer(args)
    else:
        consumer(args)


if __name__ == "__main__":
    main()
