"""NIXL READ VRAM->VRAM (one process per GPU) against a torch peer copy, through stageferry's NixlAgent.

    python benchmarks/gpu_transfer.py                       # 2 GPUs: GPU0 producer, GPU1 consumer
    python benchmarks/gpu_transfer.py --cpu --sizes 1048576  # DRAM->DRAM smoke test, memcpy baseline
    python benchmarks/gpu_transfer.py --config default --config 'rails1:UCX_MAX_RMA_RAILS=1'

Each --config runs in a fresh producer/consumer pair (UCX reads its environment once per process).
Each side registers one buffer of the largest size once; every READ is timed by wall clock from post to
DONE with busy polling.  The baseline copy is timed the same way, with torch.cuda.synchronize() on both
GPUs around it.  Variants: ``start_read`` (descriptors built and validated per READ: the plain path),
``indexed`` (prepared descriptor lists, one handle per READ), ``repost`` (one prepared handle posted
again), each split into --chunks descriptors.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_BYTES = 64_963_792
TARGET_RATIO = 0.70
DEFAULT_SIZES = [359_024, 11_158_136, 64_963_792] + [1 << (20 + 2 * i) for i in range(6)]  # 1 MiB..1 GiB
MODES = ("start_read", "indexed", "repost")


@dataclass
class Config:
    label: str
    env: dict[str, str] = field(default_factory=dict)


def parse_config(spec: str) -> Config:
    label, _, rest = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(";") if kv)  # ';' since UCX_TLS values hold commas
    return Config(label or "default", env)


def pattern(torch: Any, n: int, offset: int, device: Any) -> Any:
    return ((torch.arange(offset, offset + n, dtype=torch.int64, device=device) * 7 + 3) % 251).to(torch.uint8)


def fill(torch: Any, buf: Any, n: int) -> None:
    step = 64 << 20
    for off in range(0, n, step):
        k = min(step, n - off)
        buf[off : off + k].copy_(pattern(torch, k, off, buf.device))


def verify(torch: Any, buf: Any, n: int) -> bool:
    step = 64 << 20
    return all(
        torch.equal(buf[off : off + min(step, n - off)], pattern(torch, min(step, n - off), off, buf.device))
        for off in range(0, n, step)
    )


def split(base: int, n: int, chunks: int, dev: int) -> list[tuple[int, int, int]]:
    """``chunks`` regions covering [base, base+n): fewer descriptors are cheaper, more may run in parallel."""
    chunks = max(1, min(chunks, n))
    step = n // chunks
    out = [(base + i * step, step, dev) for i in range(chunks - 1)]
    out.append((base + (chunks - 1) * step, n - (chunks - 1) * step, dev))
    return out


def stats(ns: list[int], n: int) -> tuple[float, float, float]:
    """median ms, p99 ms (nearest rank), median GB/s."""
    s = sorted(ns)
    med = statistics.median(s)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return med / 1e6, p99 / 1e6, n / med


def load_agent_module() -> Any:
    """benchmarks/nixl_bench_agent.py, stageferry's NixlAgent with prepared lists, reposts and WRITE
    (imported in the child processes, after their environment is set)."""
    import nixl_bench_agent as mod

    return mod


# -- child processes ---------------------------------------------------------------------------------


def _setup(env: dict[str, str], cpu: bool, device: int) -> tuple[Any, Any]:
    os.environ.update(env)
    import torch

    if cpu:
        return torch, torch.device("cpu")
    torch.cuda.set_device(device)
    torch.zeros(1, device=device)  # CUDA context before the agent: UCX's CUDA transports need it
    return torch, torch.device("cuda", device)


def producer(ctl: Connection, peer: Connection, env: dict[str, str], cpu: bool, nbytes: int, share: bool) -> None:
    torch, dev = _setup(env, cpu, 0)
    NixlAgent = load_agent_module().BenchAgent

    agent = NixlAgent(f"bench-producer-{os.getpid()}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    fill(torch, src, nbytes)
    if not cpu:
        torch.cuda.synchronize()
    agent.register(src)
    peer.send((agent.metadata(), NixlAgent.region_of(src)))
    if share:
        peer.send(src)  # torch shares it by CUDA IPC: the cross-process baseline, not a NIXL path
    notifs = 0
    while not ctl.poll(0.005):
        notifs += sum(len(v) for v in agent.drain_notifs().values())
    ctl.recv()
    time.sleep(0.2)
    notifs += sum(len(v) for v in agent.drain_notifs().values())
    agent.close()
    ctl.send({"notifs": notifs, "registrations": agent.registrations})


def time_copy(torch: Any, copy: Any, n: int, iters: int, warmup: int) -> list[int]:
    """Wall clock around one copy, with both GPUs synchronized before and after (as for the baseline)."""
    ts = []
    for i in range(warmup + iters):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t = time.perf_counter_ns()
        copy(n)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        if i >= warmup:
            ts.append(time.perf_counter_ns() - t)
    return ts


def consumer(
    conn: Connection,
    peer: Connection,
    env: dict[str, str],
    cpu: bool,
    nbytes: int,
    sizes: list[int],
    chunk_list: list[int],
    modes: list[str],
    iters: int,
    warmup: int,
    share: bool,
) -> None:
    torch, dev = _setup(env, cpu, 1)
    na = load_agent_module()
    MemKind, NixlAgent, XferState = na.MemKind, na.BenchAgent, na.XferState

    kind = MemKind.DRAM if cpu else MemKind.VRAM
    t0 = time.perf_counter()
    agent = NixlAgent(f"bench-consumer-{os.getpid()}")
    created_s = time.perf_counter() - t0
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    agent.register(dst)
    md, (raddr, _, rdev) = peer.recv()
    src_ipc = peer.recv() if share else None
    name = agent.add_remote(md)
    t0 = time.perf_counter()
    agent.warm_up(name)
    warm_s = time.perf_counter() - t0
    ldev = max(dst.get_device(), 0)
    seq = 0
    results: dict[tuple[int, str, int], list[int]] = {}
    checks: dict[int, bool] = {}

    def wait(h: object) -> None:
        while agent.poll(h) is XferState.PROC:
            pass

    for n in sizes:
        for chunks in chunk_list:
            loc = split(dst.data_ptr(), n, chunks, ldev)
            rem = split(raddr, n, chunks, rdev)
            idx = list(range(len(loc)))
            for mode in modes:
                times: list[int] = []
                if mode == "start_read":
                    for i in range(warmup + iters):
                        seq += 1
                        t = time.perf_counter_ns()
                        h = agent.start_read(loc, kind, rem, kind, name, b"%d" % seq)
                        wait(h)
                        dt = time.perf_counter_ns() - t
                        agent.release(h)
                        if i >= warmup:
                            times.append(dt)
                else:
                    lp = agent.prepare_local(loc, kind)
                    rp = agent.prepare_remote(name, rem, kind)
                    h = None
                    for i in range(warmup + iters):
                        seq += 1
                        t = time.perf_counter_ns()
                        if mode == "indexed" or h is None:
                            h = agent.start_read_indexed(lp, idx, rp, idx, b"%d" % seq)
                        else:
                            agent.repost(h, b"%d" % seq)
                        wait(h)
                        dt = time.perf_counter_ns() - t
                        if mode == "indexed":
                            agent.release(h)
                            h = None
                        if i >= warmup:
                            times.append(dt)
                    if h is not None:
                        agent.release(h)
                    agent.release_prepared(lp)
                    agent.release_prepared(rp)
                results[(n, mode, chunks)] = times
        # Correctness once per size: zero, read, compare against the producer's pattern.  The zeroing
        # kernel must finish before the READ is posted: UCX copies on its own stream (so must the pool).
        dst[:n].zero_()
        if not cpu:
            torch.cuda.synchronize()
        seq += 1
        h = agent.start_read([(dst.data_ptr(), n, ldev)], kind, [(raddr, n, rdev)], kind, name, b"%d" % seq)
        wait(h)
        agent.release(h)
        checks[n] = verify(torch, dst, n)
    diag: dict[str, dict[int, list[int]]] = {}
    writes = 0
    try:
        if src_ipc is not None:  # after verification: the WRITEs below overwrite the producer's buffer
            writes = run_diag(torch, agent, kind, name, dst, ldev, src_ipc, (raddr, rdev), sizes, iters, warmup, diag)
    except Exception as exc:  # diagnostics must not cost the main results
        diag["error"] = {0: [0]}
        print(f"diagnostics failed: {type(exc).__name__}: {exc}", flush=True)
    del src_ipc
    out = {
        "diag": diag,
        "results": results,
        "checks": checks,
        "reads": seq,
        "writes": writes,
        "open_handles": agent.open_handles(),
        "registrations": agent.registrations,
        "transport": agent.transport_info(name),
        "agent_s": created_s,
        "warm_up_s": warm_s,
    }
    agent.close()
    conn.send(out)


def run_diag(
    torch: Any,
    agent: Any,
    kind: Any,
    name: str,
    dst: Any,
    ldev: int,
    src_ipc: Any,
    remote: tuple[int, int],
    sizes: list[int],
    iters: int,
    warmup: int,
    diag: dict[str, dict[int, list[int]]],
) -> int:
    """Cross-process baselines on the same memory (CUDA IPC) and a NIXL WRITE; returns WRITEs posted."""
    raddr, rdev = remote
    XferState = load_agent_module().XferState
    seq = 0

    def wait(h: object) -> None:
        while agent.poll(h) is XferState.PROC:
            pass

    diag["ipc_copy"] = {n: time_copy(torch, lambda k: dst[:k].copy_(src_ipc[:k]), n, iters, warmup) for n in sizes}
    rt = _cudart()
    if rt is not None:
        rt.cudaDeviceEnablePeerAccess(ctypes.c_int(0), ctypes.c_uint(0))
        rt.cudaGetLastError()
        stream = ctypes.c_void_p(torch.cuda.current_stream(1).cuda_stream)

        def pull(k: int) -> None:
            rt.cudaMemcpyAsync(
                ctypes.c_void_p(dst.data_ptr()),
                ctypes.c_void_p(src_ipc.data_ptr()),
                ctypes.c_size_t(k),
                ctypes.c_int(4),
                stream,
            )

        diag["ipc_pull"] = {n: time_copy(torch, pull, n, iters, warmup) for n in sizes}
    diag["write"] = {}
    for n in sizes:
        ts = []
        for i in range(warmup + iters):
            seq += 1
            t = time.perf_counter_ns()
            h = agent.start_write([(dst.data_ptr(), n, ldev)], kind, [(raddr, n, rdev)], kind, name, b"%d" % seq)
            wait(h)
            dt = time.perf_counter_ns() - t
            agent.release(h)
            if i >= warmup:
                ts.append(dt)
        diag["write"][n] = ts
    return seq


# -- baseline ----------------------------------------------------------------------------------------


def _cudart() -> Any | None:
    """libcudart as loaded by torch, for a copy issued on GPU1's stream (the pull direction of a READ)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            if "libcudart.so" in line:
                return ctypes.CDLL(line.split()[-1])
    return None


def baseline(sizes: list[int], cpu: bool, iters: int, warmup: int) -> dict[str, dict[int, list[int]]]:
    import torch

    n_max = max(sizes)
    out: dict[str, dict[int, list[int]]] = {"push": {}, "pull": {}}
    if cpu:
        src = torch.empty(n_max, dtype=torch.uint8)
        fill(torch, src, n_max)
        dst = torch.zeros(n_max, dtype=torch.uint8)
        for n in sizes:
            ts = []
            for i in range(warmup + iters):
                t = time.perf_counter_ns()
                dst[:n].copy_(src[:n])
                if i >= warmup:
                    ts.append(time.perf_counter_ns() - t)
            out["push"][n] = ts
        assert torch.equal(dst, src)
        return out

    def sync() -> None:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)

    src = torch.empty(n_max, dtype=torch.uint8, device="cuda:0")
    fill(torch, src, n_max)
    dst = torch.zeros(n_max, dtype=torch.uint8, device="cuda:1")
    for n in sizes:  # torch: copy issued on the source device (GPU0 pushes over NVLink)
        ts = []
        for i in range(warmup + iters):
            sync()
            t = time.perf_counter_ns()
            dst[:n].copy_(src[:n])
            sync()
            if i >= warmup:
                ts.append(time.perf_counter_ns() - t)
        out["push"][n] = ts
    assert torch.equal(dst.cpu(), src.cpu())
    rt = _cudart()
    if rt is not None:
        with torch.cuda.device(1):
            rt.cudaDeviceEnablePeerAccess(ctypes.c_int(0), ctypes.c_uint(0))  # 704 = already enabled: fine
            rt.cudaGetLastError()  # don't leave that for torch's next launch check
            stream = ctypes.c_void_p(torch.cuda.current_stream(1).cuda_stream)
            dst.zero_()
            for n in sizes:
                ts = []
                for i in range(warmup + iters):
                    sync()
                    t = time.perf_counter_ns()
                    rc = rt.cudaMemcpyAsync(
                        ctypes.c_void_p(dst.data_ptr()),
                        ctypes.c_void_p(src.data_ptr()),
                        ctypes.c_size_t(n),
                        ctypes.c_int(4),
                        stream,
                    )  # cudaMemcpyDefault
                    sync()
                    if rc != 0:
                        break
                    if i >= warmup:
                        ts.append(time.perf_counter_ns() - t)
                if ts:
                    out["pull"][n] = ts
            if out["pull"] and not torch.equal(dst.cpu(), src.cpu()):
                out["pull"] = {}
    del src, dst
    torch.cuda.empty_cache()
    return out


# -- driver ------------------------------------------------------------------------------------------


def run_config(cfg: Config, args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    env = dict(cfg.env)
    if args.proto_info:
        env.setdefault("UCX_PROTO_INFO", "y")  # lets transport_info() name the transport
    n_max = max(sizes)
    share = args.diag and not args.cpu
    pc, pchild = ctx.Pipe()
    cc, cchild = ctx.Pipe()
    peer_p, peer_c = ctx.Pipe()  # producer -> consumer directly (a shared CUDA tensor can't be relayed)
    p = ctx.Process(target=producer, args=(pchild, peer_p, env, args.cpu, n_max, share), daemon=True)
    c = ctx.Process(
        target=consumer,
        args=(cchild, peer_c, env, args.cpu, n_max, sizes, args.chunks, args.modes, args.iters, args.warmup, share),
        daemon=True,
    )
    p.start()
    c.start()
    try:
        if not cc.poll(args.config_timeout):
            raise RuntimeError("consumer did not finish in time")
        res: dict[str, Any] = cc.recv()
        pc.send("stop")
        res["producer"] = pc.recv() if pc.poll(30) else {}
        return res
    finally:
        for proc in (c, p):
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def fmt(ms: float, gbs: float) -> str:
    return f"{ms:.3f} ms ({gbs:.0f} GB/s)"


def report(
    cfg: Config, res: dict[str, Any], base: dict[str, dict[int, list[int]]], args: argparse.Namespace, sizes: list[int]
) -> list[tuple[str, str, int, float]]:
    env = {k: v for k, v in {**os.environ, **cfg.env}.items() if k.startswith(("UCX_", "NIXL_"))}
    if args.proto_info:
        env.setdefault("UCX_PROTO_INFO", "y")
    kind = "DRAM->DRAM" if args.cpu else "VRAM->VRAM"
    base_name = "memcpy (torch copy_)" if args.cpu else "torch peer copy GPU0->GPU1"
    print(f"\n### config `{cfg.label}`  env: {' '.join(f'{k}={v}' for k, v in sorted(env.items())) or '(none)'}")
    print(f"transport: {res['transport']}")
    prod = res.get("producer", {})
    failed = [n for n, ok in res["checks"].items() if not ok]
    print(
        f"agent created in {res['agent_s']:.3f} s, warm_up {res['warm_up_s'] * 1e3:.1f} ms; "
        f"READs {res['reads']}, WRITEs {res['writes']}, "
        f"notifs at producer {prod.get('notifs')}, open handles after {res['open_handles']}, "
        f"registrations {res['registrations']}/{prod.get('registrations')}; "
        f"bytes verified: {not failed}" + (f" (FAILED for sizes {failed})" if failed else "")
    )
    mm, mc = args.main_mode, args.main_chunks
    print(f"\nNIXL READ {kind} = `{mm}` with {mc} descriptor(s); p99 = nearest rank of {args.iters}\n")
    pull = bool(base["pull"])
    head = f"| bytes | {base_name} median |"
    if pull:
        head += " copy pulled by GPU1 median |"
    head += f" NIXL READ {kind} median | NIXL p99 | NIXL / peer BW |"
    print(head)
    print("|" + "---:|" * (head.count("|") - 1))
    for n in sizes:
        bms, _, bgb = stats(base["push"][n], n)
        key = (n, mm, mc)
        if key not in res["results"]:
            continue
        nms, n99, ngb = stats(res["results"][key], n)
        row = f"| {n:,} | {fmt(bms, bgb)} |"
        if pull:
            pms, _, pgb = stats(base["pull"][n], n)
            row += f" {fmt(pms, pgb)} |"
        row += f" {fmt(nms, ngb)} | {n99:.3f} ms ({n / (n99 * 1e6):.0f} GB/s) | {ngb / bgb:.2f} |"
        print(row)
    variants = sorted({(m, ch) for (_, m, ch) in res["results"]}, key=lambda v: (MODES.index(v[0]), v[1]))
    summary: list[tuple[str, str, int, float]] = []
    if len(variants) > 1:
        print("\nall variants, median GB/s (ratio to peer copy):\n")
        print("| bytes | " + " | ".join(f"{m} x{ch}" for m, ch in variants) + " |")
        print("|---:|" + "---:|" * len(variants))
        for n in sizes:
            bgb = stats(base["push"][n], n)[2]
            cells = []
            for m, ch in variants:
                gb = stats(res["results"][(n, m, ch)], n)[2]
                cells.append(f"{gb:.0f} ({gb / bgb:.2f})")
            print(f"| {n:,} | " + " | ".join(cells) + " |")
    diag = res.get("diag") or {}
    if "error" in diag:
        print("\n(diagnostics failed: see the consumer's message above)")
    elif diag:
        print("\ndiagnostics, median ms (GB/s): where the gap to the peer copy comes from\n")
        cols = [
            ("ipc_copy", "torch copy_ of the producer's tensor via CUDA IPC, in the consumer (push)"),
            ("ipc_pull", "same IPC memory, cudaMemcpyAsync on GPU1's stream"),
            ("write", "NIXL WRITE GPU1->GPU0 (push), start_write x1"),
        ]
        cols = [c for c in cols if c[0] in diag]
        print(f"| bytes | {base_name} | " + " | ".join(d for _, d in cols) + f" | NIXL READ {mm} x{mc} |")
        print("|---:|---:|" + "---:|" * (len(cols) + 1))
        for n in sizes:
            cells = [fmt(*[stats(base["push"][n], n)[i] for i in (0, 2)])]
            for k, _ in cols:
                ms, _, gb = stats(diag[k][n], n)
                cells.append(fmt(ms, gb))
            ms, _, gb = stats(res["results"][(n, mm, mc)], n)
            cells.append(fmt(ms, gb))
            print(f"| {n:,} | " + " | ".join(cells) + " |")
    if TARGET_BYTES in sizes:
        bgb = stats(base["push"][TARGET_BYTES], TARGET_BYTES)[2]
        for m, ch in variants:
            ratio = stats(res["results"][(TARGET_BYTES, m, ch)], TARGET_BYTES)[2] / bgb
            summary.append((cfg.label, m, ch, ratio))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="DRAM->DRAM between two processes, memcpy baseline")
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="LABEL[:K=V;K=V...]",
        help="extra env for both processes; repeat to compare (each gets fresh processes)",
    )
    ap.add_argument(
        "--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1], help="descriptors per READ, comma list"
    )
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    ap.add_argument("--main-mode", default="start_read", choices=MODES)
    ap.add_argument("--main-chunks", type=int, default=1)
    ap.add_argument(
        "--no-proto-info",
        dest="proto_info",
        action="store_false",
        help="don't set UCX_PROTO_INFO=y (then the transport cannot be named)",
    )
    ap.add_argument(
        "--no-diag", dest="diag", action="store_false", help="skip the GPU diagnostics (CUDA IPC copies, NIXL WRITE)"
    )
    ap.add_argument("--config-timeout", type=float, default=240.0)
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip remaining configs after this many s")
    args = ap.parse_args()
    sizes = sorted(set(args.sizes))
    if args.main_mode not in args.modes:
        args.modes.insert(0, args.main_mode)
    if args.main_chunks not in args.chunks:
        args.chunks.insert(0, args.main_chunks)
    configs = [parse_config(c) for c in args.config] or [Config("default")]
    t_start = time.monotonic()

    import torch

    print(
        f"torch {torch.__version__}, python {sys.version.split()[0]}, "
        f"{'CPU' if args.cpu else torch.cuda.get_device_name(0) + ' x' + str(torch.cuda.device_count())}"
    )
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("need 2 GPUs (or --cpu)")
    ucx_env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "NCCL_", "CUDA_"))}
    print("process env:", " ".join(f"{k}={v}" for k, v in sorted(ucx_env.items())) or "(none)")
    print(f"sizes {sizes}, iters {args.iters}, warmup {args.warmup}, modes {args.modes}, chunks {args.chunks}")
    base = baseline(sizes, args.cpu, args.iters, args.warmup)
    summary: list[tuple[str, str, int, float]] = []
    for cfg in configs:
        if args.budget_s and time.monotonic() - t_start > args.budget_s:
            print(f"\n(skipped config `{cfg.label}`: over --budget-s)")
            continue
        t0 = time.monotonic()
        try:
            res = run_config(cfg, args, sizes)
        except Exception as exc:  # keep the other configs' results
            print(f"\n### config `{cfg.label}` FAILED: {type(exc).__name__}: {exc}")
            continue
        summary += report(cfg, res, base, args, sizes)
        print(f"\n(config `{cfg.label}` took {time.monotonic() - t0:.1f} s)")
    if summary:
        print(f"\n## target: {TARGET_BYTES:,}-byte payload at >= {TARGET_RATIO:.0%} of peer-copy bandwidth\n")
        for label, m, ch, ratio in summary:
            ok = "HOLDS" if ratio >= TARGET_RATIO else "does not hold"
            print(f"- config `{label}`, {m} x{ch}: ratio {ratio:.2f} -> target {ok}")
        main_rows = [r for r in summary if r[1] == args.main_mode and r[2] == args.main_chunks]
        best = max(main_rows or summary, key=lambda r: r[3])
        print(
            f"\nTARGET {'HOLDS' if best[3] >= TARGET_RATIO else 'DOES NOT HOLD'} "
            f"(best {args.main_mode} x{args.main_chunks}: config `{best[0]}`, ratio {best[3]:.2f})"
        )
    print(f"\ntotal {time.monotonic() - t_start:.1f} s")


if __name__ == "__main__":
    main()
