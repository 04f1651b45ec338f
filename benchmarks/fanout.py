"""Fan-out cost of a stage group: the leader sending a job with its payload to its ranks, against a bare
broadcast of the same bytes — both timed in the same rounds, the same way (median and p99, one run).

* ``--mode broadcast`` (default): TP2/TP4 (``--ranks``; gloo on CPU, NCCL with ``--backend nccl``).
* ``--mode nixl-fanout`` (2 GPUs): a TP1 producer process on GPU 0 holds the payload in registered VRAM;
  a TP2 consumer group (leader on GPU 1, follower on GPU 0 — ``--gpus``) — the leader READs it over NIXL
  into its own VRAM, then fans it out over NCCL.

**How a round is timed.**  Every rank leaves a gloo barrier (outside the window), then the leader
stamps ``start`` and sends (``job``: :meth:`GroupChannel.send` of a job header, the manifest and the
packed region; ``raw``: one ``dist.broadcast`` of the region), and every rank stamps ``end`` once it
holds the payload (a follower: after :meth:`GroupChannel.receive`, which unpacks it; on GPUs after
``torch.cuda.synchronize``).  A round's time is ``max(end over ranks) - start``: ``time.perf_counter``
is the host's monotonic clock, the same in every process, so the stamps compare across ranks and no
barrier or other collective sits inside the window.  ``job``, ``frames`` and ``raw`` rounds alternate:
``job`` over a channel whose headers go by the group's host shared-memory mailbox (the default), ``frames``
over a second channel on the same groups with ``mailbox=False`` (headers ride the device broadcast in a
frame, the design before the mailbox), so both designs are measured side by side in one run.  In
``nixl-fanout`` both kinds of round start with the same NIXL READ on the leader; ``start`` is stamped
when it is done.  The target (issue 20) is ``job ≤ 1.5 × raw + 0.05 ms``, on the medians.

  python benchmarks/fanout.py --ranks 2,4 --sizes 4096,359024 --iters 50      # CPU, gloo
  python benchmarks/fanout.py --backend nccl --ranks 2 --iters 200            # 2 GPUs
  python benchmarks/fanout.py --mode nixl-fanout --iters 200                  # 2 GPUs, NIXL + NCCL

Runs from a checkout with ``PYTHONPATH`` unset: the repo root goes on ``sys.path`` (and spawned ranks
inherit it).  A rank that fails sends its traceback to the parent, which prints it and exits non-zero;
``--hang-dump S`` makes a rank that is still running after S seconds print every thread's stack and
exit, so a hang shows where it sits.
"""

from __future__ import annotations

import argparse
import faulthandler
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
from stageferry.schemas import DeviceKind, Manifest  # noqa: E402
from stageferry.stages.group import group_channel  # noqa: E402
from stageferry.stages.group.group import pack_payload  # noqa: E402
from stageferry.stages.group.group_channel import GroupChannel, MessageKind  # noqa: E402

TASK_SIZES = [359_024, 11_158_136, 64_963_792]
WARMUP = 5
#: A job header like :class:`stageferry.stages.group.group.GroupCompute` sends (its ``job`` is a JobRequest's JSON).
JOB_JSON = '{"request_id":"bench","task":"T2VA","prompt":"' + "p" * 200 + '","params":{}}'


def percentiles(samples: list[float]) -> tuple[float, float]:
    s = sorted(samples)
    return statistics.median(s), s[min(len(s) - 1, int(0.99 * len(s)))]


def _init(rank: int, world: int, port: int, backend: str, gpus: list[int]) -> GroupChannel:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if os.environ.get("FANOUT_INLINE_MAX"):  # --inline-max: a region larger than this gets its own broadcast
        group_channel.INLINE_MAX_BYTES = int(os.environ["FANOUT_INLINE_MAX"])
    if backend == "nccl":
        device = torch.device("cuda", gpus[rank])
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
        cpu_group = dist.new_group(backend="gloo")
        return GroupChannel(
            rank=rank, world_size=world, device=device, cpu_group=cpu_group, device_group=dist.group.WORLD
        )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    world_group = dist.group.WORLD
    return GroupChannel(
        rank=rank, world_size=world, device=torch.device("cpu"), cpu_group=world_group, device_group=world_group
    )


def _reporting(target: Any, rank: int, hang_dump: float, *args: Any) -> None:
    """Run a rank's body; on failure, put ``("error", rank, traceback)`` on the queue (last argument)."""
    if hang_dump > 0:
        faulthandler.dump_traceback_later(hang_dump, exit=True)
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


def _join(procs: list[Any]) -> None:
    for p in procs:
        p.join(30)
        if p.is_alive():  # a rank stuck tearing NCCL down must not hold the results back
            p.terminate()


def _frames_twin(channel: GroupChannel) -> GroupChannel:
    """A channel on the same groups whose headers ride frames (no mailbox): the design it replaced."""
    return GroupChannel(
        rank=channel.rank,
        world_size=channel.world_size,
        device=channel.device,
        cpu_group=channel.cpu_group,
        device_group=channel.device_group,
        mailbox=False,
    )


class Rounds:
    """One rank's stamps; :meth:`windows` turns every rank's into per-round times (on the leader)."""

    KINDS = ("job", "frames", "raw")

    def __init__(self, channel: GroupChannel, frames: GroupChannel):
        self.channel = channel
        self.channels = {"job": channel, "frames": frames}
        self.stamps: dict[str, list[tuple[float, float]]] = {kind: [] for kind in self.KINDS}

    def run(self, what: str, region: torch.Tensor, manifest: Manifest, i: int, before: Any = None) -> None:
        """One round: ``job`` sends ``manifest`` with its packed ``region`` (padded to the manifest's
        region size, as a connector's slot is); ``raw`` broadcasts the region's bytes."""
        channel = self.channels.get(what, self.channel)
        blob = region[: manifest.regions[0].nbytes]
        dist.barrier(group=channel.cpu_group)
        if before is not None:
            before()
        start = time.perf_counter()
        kind = DeviceKind.CUDA if blob.is_cuda else DeviceKind.CPU
        if what == "raw":
            dist.broadcast(blob, src=0, group=channel.device_group)
        elif channel.rank == 0:
            header = {"request_id": f"r{i}", "key": f"k{i}", "job": JOB_JSON, "sent_at": time.time()}
            channel.send(MessageKind.JOB, header, manifest=manifest, buffers={kind: region})
        else:
            message = channel.receive()
            assert message.manifest is not None and message.buffers[kind].numel() >= blob.numel()
            assert message.payload is not None  # unpacked by the channel, as a follower's model gets it
        if blob.is_cuda:
            torch.cuda.synchronize(channel.device)
        end = time.perf_counter()
        if i >= WARMUP:
            self.stamps[what].append((start, end))

    def windows(self, what: str) -> list[float]:
        """Collective: ``max(end over ranks) - leader's start`` per round (valid on the leader)."""
        mine = torch.tensor(self.stamps[what], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(self.channel.world_size)]
        dist.all_gather(every, mine, group=self.channel.cpu_group)
        ends = torch.stack([t[:, 1] for t in every]).max(dim=0).values
        return (ends - every[0][:, 0]).tolist()


def _broadcast_rank(
    rank: int, world: int, port: int, backend: str, gpus: list[int], sizes: list[int], iters: int, out: Any
) -> None:
    channel = _init(rank, world, port, backend, gpus)
    frames = _frames_twin(channel)
    for size in sizes:
        manifest, regions = pack_payload(
            {"blob": torch.randint(0, 255, (size,), dtype=torch.uint8, device=channel.device)}
        )
        region = next(iter(regions.values()))
        rounds = Rounds(channel, frames)
        for i in range(iters + WARMUP):
            for kind in Rounds.KINDS:
                rounds.run(kind, region, manifest, i)
        job, old, raw = (rounds.windows(kind) for kind in Rounds.KINDS)
        if rank == 0:
            out.put((world, size, job, old, raw))
            print(f"world {world} size {size:,}: job {percentiles(job)[0] * 1e3:.3f} ms", flush=True)
    dist.barrier(group=channel.cpu_group)
    dist.destroy_process_group()


def verdict(job: list[float], raw: list[float]) -> str:
    med, p99 = percentiles(job)
    rmed, rp99 = percentiles(raw)
    target = 1.5 * rmed + 50e-6
    return (
        f"{med * 1e3:.3f} / {p99 * 1e3:.3f} | {rmed * 1e3:.3f} / {rp99 * 1e3:.3f} | {med / rmed:.2f}× "
        f"(+{(med - rmed) * 1e3:.3f} ms) | {target * 1e3:.3f}: {'met' if med <= target else 'NOT met'}"
    )


TABLE_HEAD = "| headers by | job message | bare broadcast | ratio (job / bare) | target ≤ 1.5 × bare + 0.05: verdict |"


def run_broadcast(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    worlds = [w for w in (int(w) for w in args.ranks.split(",")) if w > 1]
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(max(worlds)))
    if args.backend == "nccl":  # one GPU per rank: a world larger than the GPUs here would never form
        worlds = [w for w in worlds if w <= min(len(gpus), torch.cuda.device_count())]
    rows = []
    for world in worlds:
        out = ctx.Queue()
        port = free_port()
        rank_args = (world, port, args.backend, gpus, sizes, args.iters, out)
        procs = [
            ctx.Process(target=_reporting, args=(_broadcast_rank, r, args.hang_dump, *rank_args)) for r in range(world)
        ]
        for p in procs:
            p.start()
        rows += _collect(out, len(sizes), args.timeout)
        _join(procs)
    print(
        f"\n### Fan-out over {args.backend}: a job message (header + payload region) vs a bare broadcast of the "
        f"same bytes (median / p99 ms, {args.iters} rounds each, alternating, same window)\n"
    )
    print("| ranks | bytes " + TABLE_HEAD)
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for world, size, job, old, raw in rows:
        print(f"| TP{world} | {size:,} | mailbox | {verdict(job, raw)} |")
        print(f"| TP{world} | {size:,} | frames | {verdict(old, raw)} |")


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


def _consumer_rank(rank: int, port: int, gpus: list[int], sizes: list[int], iters: int, conn: Any, out: Any) -> None:
    from stageferry.broker.data.nixl.agent import NixlAgent, XferState
    from stageferry.schemas import MemKind

    channel = _init(rank, 2, port, "nccl", gpus)
    frames = _frames_twin(channel)
    device = channel.device
    agent = remote = None
    dst = torch.empty(max(sizes) + 4096, dtype=torch.uint8, device=device)  # room for the region's padding
    reads: list[float] = []
    if rank == 0:
        agent = NixlAgent("bench-consumer")
        agent.register(dst)
        metadata, remote_addr = conn.recv()
        remote = agent.add_remote(metadata)
    for size in sizes:
        manifest = plan_payload({"blob": dst[:size]}).manifest  # the READ lands the region in ``dst``
        reads.clear()

        def read(size: int = size) -> None:
            if rank != 0:
                return
            assert agent is not None and remote is not None
            t0 = time.perf_counter()
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
            reads.append(time.perf_counter() - t0)

        rounds = Rounds(channel, frames)
        for i in range(iters + WARMUP):
            for kind in Rounds.KINDS:
                rounds.run(kind, dst, manifest, i, before=read)
        job, old, raw = (rounds.windows(kind) for kind in Rounds.KINDS)
        if rank == 0:
            out.put((size, reads[3 * WARMUP :], job, old, raw))
    if rank == 0:
        conn.send("done")
        assert agent is not None
        agent.close()
    dist.barrier(group=channel.cpu_group)
    dist.destroy_process_group()


def run_nixl_fanout(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",")]
    gpus = [int(g) for g in (args.gpus or "1,0").split(",")]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    port = free_port()
    producer = ctx.Process(target=_producer, args=(b, sizes))
    producer.start()
    ranks = [
        ctx.Process(
            target=_reporting,
            args=(_consumer_rank, r, args.hang_dump, port, gpus, sizes, args.iters, a if r == 0 else None, out),
        )
        for r in range(2)
    ]
    for p in ranks:
        p.start()
    rows = _collect(out, len(sizes), args.timeout)
    _join([*ranks, producer])
    print(
        f"\n### TP1 producer (GPU 0) → TP2 consumer: leader (GPU {gpus[0]}) NIXL READ, then a job message vs a "
        f"bare NCCL broadcast to GPU {gpus[1]} (median / p99 ms, {args.iters} rounds each, alternating)\n"
    )
    print("| bytes | NIXL READ " + TABLE_HEAD)
    print("| ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for size, reads, job, old, raw in rows:
        rmed, rp99 = percentiles(reads)
        print(f"| {size:,} | {rmed * 1e3:.3f} / {rp99 * 1e3:.3f} | mailbox | {verdict(job, raw)} |")
        print(f"| {size:,} | {rmed * 1e3:.3f} / {rp99 * 1e3:.3f} | frames | {verdict(old, raw)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["broadcast", "nixl-fanout"], default="broadcast")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--gpus", default="", help="GPU of each rank, e.g. 1,0 (default: rank r on GPU r)")
    parser.add_argument("--sizes", default=",".join(str(s) for s in [4096, 1 << 20, *TASK_SIZES]))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for each size's result")
    parser.add_argument("--inline-max", default="", help="override group_channel.INLINE_MAX_BYTES (bytes)")
    parser.add_argument("--hang-dump", type=float, default=0, help="dump a rank's stacks and exit after S seconds")
    args = parser.parse_args()
    if args.inline_max:
        os.environ["FANOUT_INLINE_MAX"] = args.inline_max  # spawned ranks inherit it
    print(f"torch {torch.__version__}, cuda devices {torch.cuda.device_count()}, cpu threads {torch.get_num_threads()}")
    (run_nixl_fanout if args.mode == "nixl-fanout" else run_broadcast)(args)


if __name__ == "__main__":
    main()
