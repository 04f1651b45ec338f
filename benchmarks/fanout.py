"""Fan-out cost of a stage group: the leader broadcasting a payload to its ranks, against payload size.

Two measurements, each printed as a markdown table of medians and p99 (one run, side by side):

* ``--mode broadcast`` (default): world sizes 1, 2, 4 (``--ranks``); rank 0 sends a ``job`` message
  carrying the payload's packed region through :class:`stageferry.stages.group_channel.GroupChannel`
  (gloo on CPU, NCCL with ``--backend nccl``); every follower receives and unpacks it.  Timed from the
  leader's send to every rank holding the tensors (a barrier closes each round).
* ``--mode nixl-fanout`` (GPUs): a TP1 producer process on GPU 0 holds the payload in registered VRAM;
  a TP2 consumer group (leader on GPU 1, follower on GPU 0) — the leader READs it over NIXL into its
  own VRAM, then broadcasts it over NCCL.  Prints READ, broadcast and total time per size.

  python benchmarks/fanout.py --ranks 1,2,4                        # CPU, gloo
  python benchmarks/fanout.py --backend nccl --ranks 2             # 2 GPUs
  python benchmarks/fanout.py --mode nixl-fanout                   # 2 GPUs, NIXL + NCCL

Runs from a checkout (the repo root goes on ``sys.path``).  A rank that fails sends its traceback to
the parent, which prints it and exits non-zero instead of waiting for results that will never come.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from stageferry.broker.data.payload_codec import plan_payload  # noqa: E402
from stageferry.embedded_redis import free_port  # noqa: E402
from stageferry.schemas import DeviceKind  # noqa: E402
from stageferry.stages.group_channel import GroupChannel, MessageKind  # noqa: E402

TASK_SIZES = [359_024, 11_158_136, 64_963_792]


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def _init(rank: int, world: int, port: int, backend: str) -> GroupChannel:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        cpu_group = dist.new_group(backend="gloo")
        return GroupChannel(
            rank=rank, world_size=world, device=device, cpu_group=cpu_group, device_group=dist.group.WORLD
        )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return GroupChannel(
        rank=rank, world_size=world, device=device, cpu_group=dist.group.WORLD, device_group=dist.group.WORLD
    )


def _reporting(target: Any, rank: int, *args: Any) -> None:
    """Run a rank's body; on failure, put ``("error", rank, traceback)`` on the queue (last argument)."""
    try:
        target(rank, *args)
    except BaseException:
        args[-1].put(("error", rank, traceback.format_exc()))
        raise


def _collect(out: Any, n: int, timeout: float) -> list[Any]:
    """``n`` results from the ranks; a rank's error ends the benchmark with its traceback."""
    rows = []
    for _ in range(n):
        item = out.get(timeout=timeout)
        if item[0] == "error":
            print(f"rank {item[1]} failed:\n{item[2]}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        rows.append(item)
    return rows


def _broadcast_rank(rank: int, world: int, port: int, backend: str, sizes: list[int], iters: int, out: Any) -> None:
    channel = _init(rank, world, port, backend)
    kind = DeviceKind.CUDA if backend == "nccl" else DeviceKind.CPU
    for size in sizes:
        payload = {"blob": torch.empty(size, dtype=torch.uint8, device=channel.device)}
        plan = plan_payload(payload)
        buffers = {kind: payload["blob"]}
        times, raw = [], []
        for i in range(iters + 2):  # side by side: a job message, then a bare broadcast of the same bytes
            dist.barrier(group=channel.cpu_group)
            t0 = time.perf_counter()
            if rank == 0:
                channel.send(MessageKind.JOB, {"i": i}, manifest=plan.manifest, buffers=buffers)
            else:
                message = channel.receive()
                assert message.buffers[kind].numel() >= size
            if backend == "nccl":
                torch.cuda.synchronize(channel.device)
            dist.barrier(group=channel.cpu_group)
            t1 = time.perf_counter()
            dist.barrier(group=channel.cpu_group)
            t2 = time.perf_counter()
            dist.broadcast(payload["blob"], src=0, group=channel.device_group)
            if backend == "nccl":
                torch.cuda.synchronize(channel.device)
            dist.barrier(group=channel.cpu_group)
            if i >= 2:
                times.append(t1 - t0)
                raw.append(time.perf_counter() - t2)
        if rank == 0:
            out.put((world, size, times, raw))
            print(f"world {world} size {size:,}: {percentiles(times)[0] * 1e3:.3f} ms", flush=True)
    dist.barrier(group=channel.cpu_group)
    dist.destroy_process_group()


def run_broadcast(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    results: dict[tuple[int, int], list[float]] = {}
    raws: dict[tuple[int, int], list[float]] = {}
    worlds = [int(w) for w in args.ranks.split(",")]
    if args.backend == "nccl":  # one GPU per rank: a world larger than the GPUs here would never form
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
    for world in worlds:
        if world == 1:
            for size in sizes:
                results[(1, size)] = raws[(1, size)] = [0.0]
            continue
        out = ctx.Queue()
        port = free_port()
        procs = [
            ctx.Process(target=_reporting, args=(_broadcast_rank, r, world, port, args.backend, sizes, args.iters, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for w, size, times, raw in _collect(out, len(sizes), args.timeout):
            results[(w, size)] = times
            raws[(w, size)] = raw
        for p in procs:
            p.join(30)
            if p.is_alive():  # a rank stuck tearing NCCL down must not hold the results back
                p.terminate()
    print(
        f"\n### Fan-out: a job message (header + payload region) vs a bare {args.backend} broadcast of the "
        f"same bytes (median / p99 ms, {args.iters} rounds, side by side; world 1 needs no broadcast)\n"
    )
    multi = [w for w in worlds if w > 1]
    print("| bytes | " + " | ".join(f"TP{w} job message | TP{w} bare broadcast | ratio" for w in multi) + " |")
    print("| ---: |" + " ---: | ---: | ---: |" * len(multi))
    for size in sizes:
        cells = []
        for w in multi:
            med, p99 = percentiles(results[(w, size)])
            rmed, rp99 = percentiles(raws[(w, size)])
            gbps = size / med / 1e9 if med else float("inf")
            cells.append(
                f"{med * 1e3:.3f} / {p99 * 1e3:.3f} ({gbps:.1f} GB/s) | {rmed * 1e3:.3f} / {rp99 * 1e3:.3f} "
                f"| {med / rmed:.2f}× (+{(med - rmed) * 1e3:.3f} ms)"
            )
        print(f"| {size:,} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------- NIXL READ, then NCCL fan-out


def _producer(conn: Any, sizes: list[int]) -> None:
    from stageferry.broker.data.nixl.agent import NixlAgent

    torch.cuda.set_device(0)
    agent = NixlAgent("bench-producer")
    buf = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device="cuda:0")
    agent.register(buf)
    torch.cuda.synchronize()
    conn.send((agent.metadata(), buf.data_ptr()))
    conn.recv()  # until the consumer is done
    agent.close()


def _consumer_rank(rank: int, port: int, sizes: list[int], iters: int, conn: Any, out: Any) -> None:
    from stageferry.broker.data.nixl.agent import NixlAgent, XferState
    from stageferry.schemas import MemKind

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 1 - rank)  # the leader on GPU 1, the follower on GPU 0
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    cpu_group = dist.new_group(backend="gloo")
    channel = GroupChannel(rank=rank, world_size=2, device=device, cpu_group=cpu_group, device_group=dist.group.WORLD)
    agent = remote = None
    dst = torch.empty(max(sizes), dtype=torch.uint8, device=device)
    if rank == 0:
        agent = NixlAgent("bench-consumer")
        agent.register(dst)
        metadata, remote_addr = conn.recv()
        remote = agent.add_remote(metadata)
    for size in sizes:
        plan = plan_payload({"blob": dst[:size]})
        reads, fans, totals = [], [], []
        for i in range(iters + 2):
            dist.barrier(group=cpu_group)
            t0 = time.perf_counter()
            if rank == 0:
                assert agent is not None and remote is not None
                h = agent.start_read(
                    [(dst.data_ptr(), size, device.index)],
                    MemKind.VRAM,
                    [(remote_addr, size, 0)],
                    MemKind.VRAM,
                    remote,
                    b"",
                )
                while agent.poll(h) is not XferState.DONE:
                    pass
                agent.release(h)
                t1 = time.perf_counter()
                channel.send(MessageKind.JOB, {"i": i}, manifest=plan.manifest, buffers={DeviceKind.CUDA: dst})
            else:
                t1 = t0
                channel.receive()
            torch.cuda.synchronize(device)
            dist.barrier(group=cpu_group)
            t2 = time.perf_counter()
            if i >= 2:
                reads.append(t1 - t0)
                fans.append(t2 - t1)
                totals.append(t2 - t0)
        if rank == 0:
            out.put((size, reads, fans, totals))
    if rank == 0:
        conn.send("done")
        assert agent is not None
        agent.close()
    dist.destroy_process_group()


def run_nixl_fanout(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    port = free_port()
    producer = ctx.Process(target=_producer, args=(b, sizes))
    producer.start()
    ranks = [
        ctx.Process(target=_reporting, args=(_consumer_rank, r, port, sizes, args.iters, a if r == 0 else None, out))
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    rows = _collect(out, len(sizes), args.timeout)
    for p in [*ranks, producer]:
        p.join(30)
        if p.is_alive():
            p.terminate()
    print(
        f"\n### TP1 producer (GPU 0) → TP2 consumer: leader (GPU 1) NIXL READ, then NCCL broadcast to GPU 0 "
        f"(median / p99 ms, {args.iters} rounds)\n"
    )
    print("| bytes | NIXL READ | NCCL fan-out | total |")
    print("| ---: | ---: | ---: | ---: |")
    for size, reads, fans, totals in rows:
        cells = [f"{percentiles(x)[0] * 1e3:.3f} / {percentiles(x)[1] * 1e3:.3f}" for x in (reads, fans, totals)]
        print(f"| {size:,} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["broadcast", "nixl-fanout"], default="broadcast")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--sizes", default=",".join(str(s) for s in [4096, 1 << 20, *TASK_SIZES, 256 << 20]))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for each size's result")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, cuda devices {torch.cuda.device_count()}, cpu threads {torch.get_num_threads()}")
    (run_nixl_fanout if args.mode == "nixl-fanout" else run_broadcast)(args)


if __name__ == "__main__":
    main()
