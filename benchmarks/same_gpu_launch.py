"""Where the same-GPU copy's launch time goes inside a get, and what changes it (issue 39, item 2 at 1 MB).

    python benchmarks/same_gpu_launch.py                     # 1 MiB, every variant; needs a GPU
    python benchmarks/same_gpu_launch.py --bytes 11158136 --variants as_is,driver_api --progress-delay-us 100000

``benchmarks/same_gpu.py`` measured the copy's launch at 40–52 µs of host time inside a get, against 13–14
µs for the same CUDA runtime calls back to back in a plain process, and against 14 µs for them after the
thread slept 2 ms (``benchmarks/wake_cost.py``, same host).  This runs the same two processes on GPU 0 (the
producer is ``same_gpu.py``'s) and, for the fast path only, times each runtime call the launch makes
inside real gets, under variants taken in turns within one run (rounds of ``--iters`` gets each):

* ``as_is``: the code as it is (a get first queues a 4 KiB copy of ours, ``SameGpu.prime``: ``prime`` is
  the host time of its calls, before the checks);
* ``no_prime``: without that copy, so the payload's is the first queued after the wait for the payload;
* ``prime_thread``: that copy queued by a thread of its own, woken at the same point (``touch`` is the
  get's own cost: handing it over): does the get gain more when its checks run meanwhile?
* ``touch_at_launch``: one cheap runtime call (``cudaEventQuery`` of a finished event) just before the
  launch, no prime: is any first runtime call slow, or the first copy only?
* ``driver_api``: the copy and its event queued with the driver's calls (``cuMemcpyDtoDAsync_v2``,
  ``cuEventRecord``, ``cuEventQuery``), no ``cudaSetDevice``: the runtime's own layer left out;
* ``no_gil_release``: the runtime calls through ``ctypes.PyDLL`` (the GIL kept across them);
* ``twice``: no prime, the launch's copy queued twice, the second (``memcpy2``, the same bytes again) timed
  apart: is a copy queued right after another fast inside a get too?

Round 19 on H100s (``benchmarks/results/issue39/h100/round19/``): before the prime, the payload's
``cudaMemcpyAsync`` took 18–19 µs inside gets under MPS and a second one right after it 5 µs; a 4 KiB copy
of ours queued first made the get shorter when queued as the get's first step (then in ``_fetch``'s
caller) and longer when queued after the manifest's checks: hence ``SameGpu.prime``, first thing in a get.

Medians in µs: ``py`` is the launch's Python before its first runtime call, then each call, ``launch`` the
whole launch, ``touch`` the extra call where there is one, ``copy`` launch → copy done (what ``same_gpu.py``
reports), ``get`` the whole get; a torch device copy back to back (host wall, launch → event done) is the
reference, as in ``same_gpu.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import torch  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from same_gpu import CONSUMER, PRODUCER, MiB, make, producer_loaded, start_producer, torch_copy_ms  # noqa: E402

from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.data.nixl import agent as agent_module  # noqa: E402
from stageferry.broker.data.nixl.cuda_runtime import CudaRuntime  # noqa: E402
from stageferry.broker.data.nixl.same_gpu import PRIME_BYTES, IpcArena  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import NixlPayload, PayloadRef  # noqa: E402

VARIANTS = (
    "as_is",
    "no_prime",
    "prime_thread",
    "touch_at_launch",
    "driver_api",
    "no_gil_release",
    "twice",
)
CALLS = ("_set_device", "_memcpy", "_record", "_query")


class Probe:
    """Patches the process's runtime calls with timed ones, per variant, and keeps each get's marks."""

    def __init__(self, rt: CudaRuntime) -> None:
        self.rt = rt
        self.real = {name: getattr(rt, name) for name in CALLS}
        self.marks: list[tuple[str, float, float]] = []
        lib = ctypes.PyDLL(rt.path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self.no_gil = {
            "_set_device": CudaRuntime._fn(lib, "cudaSetDevice", i32),
            "_memcpy": CudaRuntime._fn(lib, "cudaMemcpyAsync", vp, vp, size, i32, vp),
            "_record": CudaRuntime._fn(lib, "cudaEventRecord", vp, vp),
            "_query": CudaRuntime._fn(lib, "cudaEventQuery", vp),
        }
        cu = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        memcpy = CudaRuntime._fn(cu, "cuMemcpyDtoDAsync_v2", ctypes.c_uint64, ctypes.c_uint64, size, vp)
        self.driver = {
            "_set_device": lambda index: 0,
            "_memcpy": lambda dst, src, n, kind, stream: memcpy(dst, src, n, stream),
            "_record": CudaRuntime._fn(cu, "cuEventRecord", vp, vp),
            "_query": CudaRuntime._fn(cu, "cuEventQuery", vp),
        }
        self.touch_event = rt.event()
        rt.record(self.touch_event, 0)
        rt.synchronize(self.touch_event)

    def use(self, variant: str) -> None:
        calls = {"driver_api": self.driver, "no_gil_release": self.no_gil}.get(variant, self.real)
        for name in CALLS:
            setattr(self.rt, name, self._timed(name, calls[name]))
        if variant == "twice":
            once, again = self.rt._memcpy, self._timed("_memcpy2", self.real["_memcpy"])
            self.rt._memcpy = lambda *a: once(*a) or again(*a)  # type: ignore[method-assign]

    def _timed(self, name: str, fn: Callable[..., int]) -> Callable[..., int]:
        marks = self.marks

        def call(*a: Any) -> int:
            t = time.perf_counter()
            status = fn(*a)
            marks.append((name, t, time.perf_counter()))
            return status

        return call

    def touch(self) -> None:
        t = time.perf_counter()
        self.rt._query(self.touch_event)
        self.marks.append(("touch", t, time.perf_counter()))


async def consumer(args: argparse.Namespace, child: Any) -> None:
    torch.cuda.set_device(0)
    redis = connect(args.redis_url)
    conn = make(redis, args.prefix, CONSUMER, args.pool_bytes, upstream=PRODUCER)
    conn.open()
    assert conn.agent is not None, conn.unavailable_reason
    rt = CudaRuntime.loaded()
    assert rt is not None
    probe, cons = Probe(rt), conn.consumer
    refs: TypeAdapter[PayloadRef] = TypeAdapter(PayloadRef)
    variant = {"name": "as_is"}
    at: dict[str, float] = {}
    launch, wait, prime = cons.same_gpu.launch, cons.same_gpu.wait, cons.same_gpu.prime

    primes: queue.SimpleQueue[IpcArena | None] = queue.SimpleQueue()

    def prime_in_thread() -> None:  # SameGpu.prime's calls, untimed (not to be taken for the launch's)
        set_device, memcpy = probe.real["_set_device"], probe.real["_memcpy"]
        while (arena := primes.get()) is not None:
            set_device(arena.device)
            memcpy(arena.scratch, arena.scratch + PRIME_BYTES, PRIME_BYTES, 3, arena.stream)

    threading.Thread(target=prime_in_thread, daemon=True).start()

    def prime_or_not(*a: Any, **k: Any) -> None:
        if variant["name"] in ("as_is", "driver_api", "no_gil_release"):
            prime(*a, **k)
        elif variant["name"] == "prime_thread":
            t = time.perf_counter()
            primes.put(a[1])
            probe.marks.append(("touch", t, time.perf_counter()))

    def launch_timed(*a: Any, **k: Any) -> Any:
        if variant["name"] == "touch_at_launch":
            probe.touch()
        at["launch"] = time.perf_counter()
        try:
            return launch(*a, **k)
        finally:
            at["launched"] = time.perf_counter()

    async def wait_timed(*a: Any, **k: Any) -> Any:
        try:
            return await wait(*a, **k)
        finally:
            at["done"] = time.perf_counter()

    cons.same_gpu.launch, cons.same_gpu.wait = launch_timed, wait_timed  # type: ignore[method-assign]
    cons.same_gpu.prime = prime_or_not  # type: ignore[method-assign]
    seen: dict[str, dict[str, list[float]]] = {v: defaultdict(list) for v in args.variants}
    cmd = json.dumps({"nbytes": args.bytes, "count": 1})
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(conn.run)
            await producer_loaded(conn, child, args.log)
            torch_gpu, torch_wall = torch_copy_ms(args.bytes, 100)
            n = 0
            for _round in range(args.rounds):
                for name in args.variants:
                    variant["name"] = name
                    probe.use(name)
                    for i in range(args.warmup + args.iters):
                        await redis.rpush(f"{args.prefix}:bench:cmd", cmd)
                        _, raw = await redis.blpop([f"{args.prefix}:bench:refs"], timeout=60)  # type: ignore[misc]
                        ref = refs.validate_json(raw)
                        assert isinstance(ref, NixlPayload), ref
                        await cons.claim(ref)
                        at.clear()
                        probe.marks.clear()
                        n += 1
                        async with conn.get(ref, None, key=f"g{n}", claimed=True) as incoming:
                            assert incoming.route and "same-gpu copy" in incoming.route, incoming.route
                        if i < args.warmup:
                            continue
                        row = seen[name]
                        marks = list(probe.marks)
                        launch_marks = [m for m in marks if at["launch"] <= m[1] <= at["launched"]]
                        for call, t0, t1 in launch_marks:
                            row[call].append((t1 - t0) * 1e6)
                        for call, t0, t1 in marks:
                            if call == "touch":
                                row["touch"].append((t1 - t0) * 1e6)
                        primed = [t1 - t0 for call, t0, t1 in marks if t1 <= at["launch"] and call != "touch"]
                        if primed:
                            row["prime"].append(sum(primed) * 1e6)
                        row["py"].append((launch_marks[0][1] - at["launch"]) * 1e6)
                        row["launch"].append((at["launched"] - at["launch"]) * 1e6)
                        row["copy"].append((at["done"] - at["launch"]) * 1e6)
                        row["get"].append(incoming.seconds * 1e6)
            probe.use("as_is")
            primes.put(None)
            await redis.rpush(f"{args.prefix}:bench:cmd", json.dumps({"stop": True}))
            tg.cancel_scope.cancel()
    finally:
        await conn.aclose()
        await redis.aclose()
    print(f"$ python {' '.join(sys.argv)}\n")
    mps = "on" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "off (unless a system daemon runs)"
    print(f"{torch.cuda.get_device_name(0)}, {args.bytes:,} bytes, producer and consumer on GPU 0, MPS {mps}, "
          f"progress-thread delay {args.progress_delay_us} µs; {args.rounds} rounds × {args.iters} gets a variant "
          f"(after {args.warmup} each round)\n")  # fmt: skip
    print(f"torch copy back to back: GPU {torch_gpu * 1e3:.1f} µs, host wall {torch_wall * 1e3:.1f} µs\n")
    cols = ["prime", "touch", "py", "_set_device", "_memcpy", "_memcpy2", "_record", "launch", "copy", "get"]
    print("| variant | " + " | ".join(c.strip("_") for c in cols) + " | copy / torch wall |")
    print("| --- |" + " ---: |" * (len(cols) + 1))
    for name, row in seen.items():
        cells = [f"{statistics.median(row[c]):.1f}" if row.get(c) else "-" for c in cols]
        ratio = statistics.median(row["copy"]) / (torch_wall * 1e3)
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f}× |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=MiB)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--progress-delay-us", type=int, default=agent_module.PROGRESS_DELAY_US)
    parser.add_argument("--pool-bytes", type=int, default=256 * MiB)
    parser.add_argument("--log", default="")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    configure_logging(fmt="json", level="warning", service="bench-same-gpu-launch")
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU")
    if args.progress_delay_us != agent_module.PROGRESS_DELAY_US:  # the consumer's agent only
        init = agent_module.NixlAgent.__init__
        defaults = dict(init.__kwdefaults__ or {}, progress_delay_us=args.progress_delay_us)
        init.__kwdefaults__ = defaults
    child = start_producer(args)
    try:
        anyio.run(consumer, args, child)
    finally:
        try:
            child.wait(30)
        except Exception:  # noqa: BLE001
            child.kill()


if __name__ == "__main__":
    main()
