"""Where a GPU fan-out's time goes: per-phase timestamps on the leader and the follower, round by round.

``fanout.py`` says *how much* a job message costs over a bare NCCL broadcast; this says *where*.  Two
ranks (NCCL, one GPU each, ``--gpus``, default leader on GPU 1 and follower on GPU 0 as in
``fanout.py --mode nixl-fanout``) run these rounds, alternating, each after a gloo barrier:

* ``raw``  — one ``dist.broadcast`` of the region, then ``torch.cuda.synchronize`` (``fanout.py``'s bare round);
* ``raw-ev`` — the same broadcast; the follower waits as :class:`GroupChannel` does (a copy of the frame's
  head to pinned memory and an event), not with a device synchronisation;
* ``mech`` — the channel's device work without its Python: the leader copies a 300-byte header from
  pinned memory and the region into a persistent frame and broadcasts it, the follower copies the head
  back and waits on it (a region over ``INLINE_MAX_BYTES``: a 16 KiB frame, then the region's own
  broadcast posted once the head is read); ``mech-up`` only the header's copy (the follower
  synchronises), ``mech-d2d`` only the region's copy into the frame;
* ``job``  — :meth:`GroupChannel.send` / :meth:`GroupChannel.receive` (which unpacks), as ``fanout.py`` does:
  headers by the group's mailbox (host shared memory), the region riding the pre-posted carrier;
* ``frames`` — the same over a channel with ``mailbox=False`` (headers in frames on the device group).

Every rank stamps ``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of the host) on
entering and leaving the channel's steps (``name>`` / ``name<``, by wrapping its methods here — the
product code carries no timing), and ``start``/``end`` as ``fanout.py`` does.  The table prints each
stamp's median offset from the leader's ``start``, per rank, in µs; ``gpu`` lines are CUDA-event times on
that rank's stream from its ``start`` to its last enqueue.

  python benchmarks/fanout_phases.py --sizes 359024,11158136 --iters 200
  python benchmarks/fanout_phases.py --backend gloo --sizes 359024 --iters 200   # CPU ranks: raw, job, frames
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from stageferry.broker.data.payload_codec import plan_payload  # noqa: E402
from stageferry.embedded_redis import free_port  # noqa: E402
from stageferry.schemas import DeviceKind  # noqa: E402
from stageferry.stages.group import frames, group_channel, mailbox  # noqa: E402
from stageferry.stages.group.group_channel import GroupChannel, MessageKind  # noqa: E402

WARMUP = 10
KINDS = ("raw", "raw-ev", "mech", "mech-up", "mech-d2d", "job", "frames")
JOB_JSON = '{"request_id":"bench","task":"T2VA","prompt":"' + "p" * 200 + '","params":{}}'
_marks: list[tuple[str, float]] = []


def mark(label: str) -> None:
    _marks.append((label, time.perf_counter()))


def _instrument() -> None:
    """Stamp entry and exit of the channel's steps (this process only)."""
    steps = {
        GroupChannel: ("send", "receive", "_send_frame", "_receive_frame", "_propagate_frame",
                       "_broadcast_region", "_receive_region", "_manifest", "_frame",
                       "_send_by_mailbox", "_receive_by_mailbox"),
        mailbox.Mailbox: ("post", "take"),
        frames.Staging: ("upload", "download", "wait"),
        frames.Frame: ("payload",),
    }  # fmt: skip
    for cls, names in steps.items():
        for name in names:
            original = getattr(cls, name)

            def wrapped(*args: Any, _f: Any = original, _n: str = name, **kwargs: Any) -> Any:
                mark(_n + ">")
                try:
                    return _f(*args, **kwargs)
                finally:
                    mark(_n + "<")

            setattr(cls, name, functools.wraps(original)(wrapped))


class Head:
    """A pinned host buffer and an event: the channel's way to move a frame's head (see ``_Staging``)."""

    def __init__(self) -> None:
        self.host = torch.empty(group_channel.FRAME_BYTES, dtype=torch.uint8, pin_memory=True)
        self.done = torch.cuda.Event(blocking=True)

    def up(self, data: bytes, frame: torch.Tensor) -> None:
        self.host.numpy()[: len(data)] = memoryview(data)
        frame[: len(data)].copy_(self.host[: len(data)], non_blocking=True)

    def down(self, frame: torch.Tensor, n: int = group_channel.FRAME_BYTES) -> bytes:
        self.host[:n].copy_(frame[:n], non_blocking=True)
        self.done.record()
        while not self.done.query():
            pass
        return self.host[:n].numpy().tobytes()


def _rank(rank: int, port: int, gpus: list[int], sizes: list[int], iters: int, out: Any) -> None:
    try:
        if not gpus:
            _cpu_body(rank, port, sizes, iters, out)
            return
        _body(rank, port, gpus, sizes, iters, out)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise


def _body(rank: int, port: int, gpus: list[int], sizes: list[int], iters: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", gpus[rank])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    cpu = dist.new_group(backend="gloo")
    channel = GroupChannel(rank=rank, world_size=2, device=device, cpu_group=cpu, device_group=dist.group.WORLD)
    old = GroupChannel(
        rank=rank, world_size=2, device=device, cpu_group=cpu, device_group=dist.group.WORLD, mailbox=False
    )
    _instrument()
    head = Head()
    header = b"\x01" * 300
    for size in sizes:
        blob = torch.randint(0, 255, (size + 4096,), dtype=torch.uint8, device=device)
        manifest = plan_payload({"blob": blob[:size]}).manifest
        nbytes = manifest.regions[0].nbytes
        inline = nbytes <= group_channel.INLINE_MAX_BYTES
        fb = group_channel.FRAME_BYTES
        frame = torch.zeros(fb + (nbytes if inline else 0), dtype=torch.uint8, device=device)
        small = torch.zeros(fb, dtype=torch.uint8, device=device)
        rows: list[tuple[str, int, list[tuple[str, float]], float]] = []
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        for i in range(iters + WARMUP):
            for kind in KINDS:
                dist.barrier(group=cpu)
                _marks.clear()
                mark("start")
                evs[0].record()
                if kind in ("raw", "raw-ev"):
                    dist.broadcast(blob[:nbytes], src=0)
                    mark("bcast<")
                    if kind == "raw-ev" and rank == 1:
                        head.down(blob, 16)
                        mark("head<")
                elif kind.startswith("mech"):
                    up, d2d, down = (kind in ("mech", "mech-up")), (kind in ("mech", "mech-d2d")), kind == "mech"
                    target = frame if inline else small
                    if rank == 0:
                        if up:
                            head.up(header, target)
                        if inline and d2d:
                            frame[fb : fb + nbytes].copy_(blob[:nbytes])
                        mark("copies<")
                        dist.broadcast(target, src=0)
                        mark("bcast<")
                        if not inline:
                            dist.broadcast(blob[:nbytes], src=0)
                            mark("bcast2<")
                    else:
                        dist.broadcast(target, src=0)
                        mark("bcast<")
                        if down:
                            head.down(target)
                            mark("head<")
                        if not inline:
                            dist.broadcast(blob[:nbytes], src=0)
                            mark("bcast2<")
                elif rank == 0:
                    h = {"request_id": f"r{i}", "key": f"k{i}", "job": JOB_JSON, "sent_at": time.time()}
                    on = channel if kind == "job" else old
                    on.send(MessageKind.JOB, h, manifest=manifest, buffers={DeviceKind.CUDA: blob[:nbytes]})
                else:
                    message = (channel if kind == "job" else old).receive()
                    assert message.manifest is not None
                    assert message.payload is not None  # unpacked by the channel, as a follower's model gets it
                    mark("unpacked")
                evs[1].record()
                torch.cuda.synchronize(device)
                mark("end")
                if i >= WARMUP:
                    rows.append((kind, size, list(_marks), evs[0].elapsed_time(evs[1]) * 1e3))
        out.put(("rows", rank, rows))
    dist.barrier(group=cpu)
    dist.destroy_process_group()


def _cpu_body(rank: int, port: int, sizes: list[int], iters: int, out: Any) -> None:
    """The ``raw``, ``job`` and ``frames`` rounds on CPU ranks over gloo (no device work to separate)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    world = dist.group.WORLD
    channel = GroupChannel(rank=rank, world_size=2, device=torch.device("cpu"), cpu_group=world, device_group=world)
    old = GroupChannel(
        rank=rank, world_size=2, device=torch.device("cpu"), cpu_group=world, device_group=world, mailbox=False
    )
    _instrument()
    for size in sizes:
        blob = torch.randint(0, 255, (size + 4096,), dtype=torch.uint8)
        manifest = plan_payload({"blob": blob[:size]}).manifest
        nbytes = manifest.regions[0].nbytes
        rows: list[tuple[str, int, list[tuple[str, float]], float]] = []
        for i in range(iters + WARMUP):
            for kind in ("raw", "job", "frames"):
                dist.barrier(group=world)
                _marks.clear()
                mark("start")
                on = channel if kind == "job" else old
                if kind == "raw":
                    dist.broadcast(blob[:nbytes], src=0)
                    mark("bcast<")
                elif rank == 0:
                    h = {"request_id": f"r{i}", "key": f"k{i}", "job": JOB_JSON, "sent_at": time.time()}
                    on.send(MessageKind.JOB, h, manifest=manifest, buffers={DeviceKind.CPU: blob[:nbytes]})
                else:
                    assert on.receive().payload is not None
                    mark("unpacked")
                mark("end")
                if i >= WARMUP:
                    rows.append((kind, size, list(_marks), 0.0))
        out.put(("rows", rank, rows))
    dist.barrier(group=world)
    dist.destroy_process_group()


def report(leader: list[Any], follower: list[Any]) -> None:
    """Per kind and size: the window (max end - leader start), then every stamp's median offset."""
    by: dict[tuple[str, int], list[tuple[Any, Any]]] = defaultdict(list)
    for a, b in zip(leader, follower, strict=True):
        assert a[:2] == b[:2]
        by[a[:2]].append((a, b))
    for (kind, size), pairs in by.items():
        windows = []
        offsets: dict[tuple[int, str], list[float]] = defaultdict(list)
        order: dict[tuple[int, str], int] = {}
        gpu: dict[int, list[float]] = defaultdict(list)
        for a, b in pairs:
            t0 = dict(a[2])["start"]
            ends = [dict(r[2])["end"] for r in (a, b)]
            windows.append(max(ends) - t0)
            for r, row in enumerate((a, b)):
                gpu[r].append(row[3])
                seen: dict[str, int] = defaultdict(int)
                for label, t in row[2]:
                    seen[label] += 1
                    key = (r, label if seen[label] == 1 else f"{label}#{seen[label]}")
                    offsets[key].append((t - t0) * 1e6)
                    order.setdefault(key, len(order))
        w = sorted(windows)
        print(
            f"\n#### {kind}, {size:,} bytes: window median {statistics.median(w) * 1e3:.3f} ms, "
            f"p10 {w[len(w) // 10] * 1e3:.3f}, p90 {w[9 * len(w) // 10] * 1e3:.3f} ({len(w)} rounds)"
        )
        for r in (0, 1):
            cells = [
                f"{label} {statistics.median(offsets[(rr, label)]):.0f}"
                for (rr, label) in sorted(order, key=lambda k: order[k])
                if rr == r
            ]
            who = "leader  " if r == 0 else "follower"
            print(f"{who} µs: " + " | ".join(cells) + f" | gpu {statistics.median(gpu[r]):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="359024,11158136")
    parser.add_argument("--gpus", default="1,0")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="gloo: CPU ranks")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    gpus = [int(g) for g in args.gpus.split(",")] if args.backend == "nccl" else []
    print(f"torch {torch.__version__}, cuda devices {torch.cuda.device_count()}, gpus {gpus}", flush=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, gpus, sizes, args.iters, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows: dict[int, list[Any]] = {0: [], 1: []}
    for _ in range(2 * len(sizes)):
        item = out.get(timeout=args.timeout)
        if item[0] == "error":
            print(f"rank {item[1]} failed:\n{item[2]}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        rows[item[1]] += item[2]
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.terminate()
    report(rows[0], rows[1])


if __name__ == "__main__":
    main()
