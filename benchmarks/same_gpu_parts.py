"""Where the same-GPU copy's fixed ~0.25 ms goes: each piece timed on its own, two processes, torch only.

    python benchmarks/same_gpu_parts.py                      # needs a GPU; 1, 11, 65 MB
    python benchmarks/same_gpu_parts.py --sizes 1048576 --iters 50

A child process (``--role producer``) allocates an arena on GPU 0 and exports it once with
:func:`~stageferry.broker.data.nixl.same_gpu.export_arena` (torch's CUDA IPC export) plus one
interprocess CUDA event; it answers commands on its stdin/stdout (one JSON line each way: nothing
pickled).  This process (the consumer) maps the arena once with
:func:`~stageferry.broker.data.nixl.same_gpu.open_arena` and times, as medians of ``--iters`` after
``--warmup``:

* ``gpu``: the copy's GPU time (CUDA timing events around it), local→local and arena→local;
* ``wall``: CPU time from launch to seen done, waiting by ``Event.synchronize`` (spinning) or by
  ``Event.query`` in a loop; for the arena→local copy also right after the producer wrote the region
  (its fill kernel + ``torch.cuda.synchronize``, what a put does before the reference goes out), and
  with the producer marking it ready on the GPU only (its interprocess event recorded after the fill,
  our stream waiting on it: no host synchronize on either side);
* per-call costs that must not be per payload: opening the arena again (cudaIpcOpenMemHandle and the
  rebuild; torch caches the mapping by handle), opening the producer's event from its handle, a new
  stream, a new event, entering ``torch.cuda.stream``, parsing the ``cuda_ipc`` record;
* the event loop: ``anyio.sleep(0)`` (a turn of an otherwise idle loop), and a round trip through
  ``anyio.to_thread.run_sync`` (what ``Event.synchronize`` off the loop would cost);
* the same-GPU copy as the connector runs it (:meth:`SameGpu.copy`), waiting the old way (a yield per
  turn after 0.1 ms) and the new way.

Output: a table of rows ``piece  1 MB  11 MB  65 MB`` in µs.
"""

# ruff: noqa: B023 - every lambda here is called inside its loop turn
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import anyio.lowlevel  # noqa: E402
import torch  # noqa: E402

from stageferry.broker.data.nixl import same_gpu  # noqa: E402
from stageferry.schemas.cuda_ipc import CudaIpcArena  # noqa: E402

MiB = 1 << 20


def producer(arena_bytes: int) -> None:
    torch.cuda.set_device(0)
    buf = torch.zeros(arena_bytes, dtype=torch.uint8, device="cuda:0")
    uuid = same_gpu.gpu_uuid(buf.device) or "GPU-00000000-0000-0000-0000-000000000000"
    spec = same_gpu.export_arena(buf, uuid)
    event = torch.cuda.Event(interprocess=True)
    event.record()
    torch.cuda.synchronize()
    print(json.dumps({"spec": spec.to_json(), "event": bytes(event.ipc_handle()).hex()}), flush=True)
    for n, line in enumerate(sys.stdin, 1):
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        buf[: cmd["nbytes"]].fill_(n % 251)
        if cmd["op"] == "write_sync":
            torch.cuda.synchronize()
        else:  # write_event: ready on the GPU only
            event.record()
        print('{"ok": 1}', flush=True)


class Child:
    def __init__(self, arena_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "producer", "--arena-bytes", str(arena_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.hello = json.loads(self._line())

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("producer exited")
        return line

    def ask(self, op: str, nbytes: int = 0) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "nbytes": nbytes}) + "\n")
        self.proc.stdin.flush()
        if op != "stop":
            self._line()


def med(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def gpu_us(fn: Callable[[], object], iters: int, warmup: int) -> float:
    out = []
    for i in range(iters + warmup):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            out.append(a.elapsed_time(b) / 1e3)
    return med(out)


def wall_us(fn: Callable[[], Any], iters: int, warmup: int, before: Callable[[], None] | None = None) -> float:
    out = []
    for i in range(iters + warmup):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        if i >= warmup:
            out.append(dt)
    return med(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["consumer", "producer"], default="consumer")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                        default=[MiB, 11_158_136, 64_963_792])  # fmt: skip
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--arena-bytes", type=int, default=80 * MiB)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    if args.role == "producer":
        producer(args.arena_bytes)
        return
    torch.cuda.set_device(0)
    child = Child(args.arena_bytes)
    try:
        rows = consumer(args, child)
    finally:
        child.ask("stop")
        child.proc.wait(30)
    print(f"$ python {' '.join(sys.argv)}\n")
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; two processes on GPU 0; "
          f"medians of {args.iters} after {args.warmup}; µs\n")  # fmt: skip
    head = ["piece"] + [f"{n / MiB:.1f} MiB" for n in args.sizes]
    table = [head] + [[name] + [f"{v:.1f}" for v in vals] for name, vals in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    for t in table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths, strict=True))))


def consumer(args: argparse.Namespace, child: Child) -> list[tuple[str, list[float]]]:
    it, wu = args.iters, args.warmup
    spec = CudaIpcArena.from_json(child.hello["spec"])
    dev = torch.device("cuda", 0)
    t = time.perf_counter()
    arena = same_gpu.open_arena(spec, dev)
    first_open = (time.perf_counter() - t) * 1e6
    ipc_event = torch.cuda.Event.from_ipc_handle(dev, bytes.fromhex(child.hello["event"]))
    local_src = torch.zeros(args.arena_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(args.arena_bytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    def launch_wait(src: torch.Tensor, n: int, how: str, wait_ipc: bool = False) -> None:
        with torch.cuda.stream(stream):
            if wait_ipc:
                stream.wait_event(ipc_event)
            dst[:n].copy_(src[:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        if how == "sync":
            done.synchronize()
        else:
            while not done.query():
                pass

    for n in args.sizes:
        view = arena.view
        add("gpu: torch copy local→local", gpu_us(lambda: dst[:n].copy_(local_src[:n]), it, wu))
        add("gpu: torch copy arena→local (producer idle)", gpu_us(lambda: dst[:n].copy_(view[:n]), it, wu))
        if n % 4 == 0:  # the same bytes moved by an SM kernel (int32 × 1), not cudaMemcpyAsync
            src32, dst32 = view[:n].view(torch.int32), dst[:n].view(torch.int32)
            add("gpu: SM-kernel copy arena→local (int32 mul 1)", gpu_us(lambda: torch.mul(src32, 1, out=dst32), it, wu))

            def kernel_wait() -> None:
                with torch.cuda.stream(stream):
                    torch.mul(src32, 1, out=dst32)
                    done = torch.cuda.Event()
                    done.record(stream)
                while not done.query():
                    pass

            add("wall: SM-kernel arena→local + query spin", wall_us(kernel_wait, it, wu))
            add("wall: SM-kernel arena→local after producer fill+synchronize",
                wall_us(kernel_wait, it, wu, before=lambda: child.ask("write_sync", n)))  # fmt: skip
        add("wall: launch local→local + Event.synchronize", wall_us(lambda: launch_wait(local_src, n, "sync"), it, wu))
        add("wall: launch local→local + query spin", wall_us(lambda: launch_wait(local_src, n, "query"), it, wu))
        add("wall: launch arena→local + Event.synchronize", wall_us(lambda: launch_wait(view, n, "sync"), it, wu))
        add("wall: launch arena→local + query spin", wall_us(lambda: launch_wait(view, n, "query"), it, wu))
        add("wall: arena→local after producer fill+synchronize",
            wall_us(lambda: launch_wait(view, n, "query"), it, wu,
                    before=lambda: child.ask("write_sync", n)))  # fmt: skip
        add("wall: arena→local after producer fill+IPC event (GPU wait)",
            wall_us(lambda: launch_wait(view, n, "query", wait_ipc=True), it, wu,
                    before=lambda: child.ask("write_event", n)))  # fmt: skip
        add("wall: producer round trip (fill+synchronize, pipe)", wall_us(lambda: child.ask("write_sync", n), it, wu))
        add("wall: producer round trip (fill+event record, pipe)", wall_us(lambda: child.ask("write_event", n), it, wu))
        torch.cuda.synchronize()
        add("per call: open_arena again (torch-cached mapping)", wall_us(lambda: same_gpu.open_arena(spec, dev), 20, 2))
        handle = bytes.fromhex(child.hello["event"])
        add("per call: Event.from_ipc_handle", wall_us(lambda: torch.cuda.Event.from_ipc_handle(dev, handle), it, wu))
        add("per call: torch.cuda.Stream()", wall_us(lambda: torch.cuda.Stream(dev), it, wu))
        add("per call: torch.cuda.Event()", wall_us(lambda: torch.cuda.Event(), it, wu))

        def enter() -> None:
            with torch.cuda.stream(stream):
                pass

        add("per call: with torch.cuda.stream(s)", wall_us(enter, it, wu))
        add("per call: CudaIpcArena.from_json", wall_us(lambda: CudaIpcArena.from_json(child.hello["spec"]), it, wu))
        add("per call: arena.region() slice", wall_us(lambda: arena.region(spec.address, n), it, wu))
        loop = anyio_rows(arena, n, it, wu, child)
        for k, v in loop.items():
            add(k, v)
    out = [(f"first open_arena (once per peer): {first_open:.0f} µs", [float("nan")] * len(args.sizes))]
    return out + list(rows.items())


def anyio_rows(arena: Any, n: int, it: int, wu: int, child: Child) -> dict[str, float]:
    """The event loop's part, and :meth:`SameGpu.copy` old and new wait, on an asyncio loop."""
    from stageferry.schemas import DeviceKind, MemKind

    res: dict[str, float] = {}
    slot = SimpleNamespace(view=torch.empty(n, dtype=torch.uint8, device="cuda:0"), device_id=0, nbytes=n)
    ep = SimpleNamespace(config=SimpleNamespace(same_gpu_copy=True), timeouts=SimpleNamespace(transfer=30.0))
    region = SimpleNamespace(address=arena.spec.address, length=n, mem_kind=MemKind.VRAM)
    spec = SimpleNamespace(nbytes=n, device=DeviceKind.CUDA)
    ref = SimpleNamespace(manifest=SimpleNamespace(regions=[spec]), regions=[region])

    async def run() -> None:
        async def timed(fn: Callable[[], Any], before: Callable[[], None] | None = None) -> float:
            out = []
            for i in range(it + wu):
                if before is not None:
                    before()
                t = time.perf_counter()
                await fn()
                if i >= wu:
                    out.append(time.perf_counter() - t)
            return med(out)

        res["loop: anyio.sleep(0)"] = await timed(anyio.lowlevel.checkpoint)
        res["loop: anyio.to_thread.run_sync(noop)"] = await timed(lambda: anyio.to_thread.run_sync(lambda: None))
        sg: Any = same_gpu.SameGpu(ep)  # type: ignore[arg-type]
        slots = {DeviceKind.CUDA: slot}
        res["SameGpu.copy (this tree) after producer fill+sync"] = await timed(
            lambda: sg.copy(ref, arena, slots), before=lambda: child.ask("write_sync", n)
        )
        old = same_gpu.HOLD_S
        same_gpu.HOLD_S = 0.0001  # round 10's wait: a yield per loop turn after 0.1 ms
        try:
            res["SameGpu.copy, round-10 wait (hold 0.1 ms)"] = await timed(
                lambda: sg.copy(ref, arena, slots), before=lambda: child.ask("write_sync", n)
            )
        finally:
            same_gpu.HOLD_S = old

    anyio.run(run)
    return res


if __name__ == "__main__":
    main()
