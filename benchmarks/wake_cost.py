"""What the same-GPU copy's host calls cost right after the thread slept, against back to back (issue 39).

    python benchmarks/wake_cost.py                  # 1 MiB, asleep 0 / 2 / 50 ms before each; needs a GPU
    python benchmarks/wake_cost.py --idle 0 5 --iters 200

A get's copy is queued right after its stage woke up for the payload's reference.  This times, in one
process on GPU 0, the runtime calls :meth:`~stageferry.broker.data.nixl.same_gpu.SameGpu.launch` makes
(``cudaSetDevice``, ``cudaMemcpyAsync`` device to device, an event taken from its pool and recorded) and
the wait for the event, each after ``time.sleep(idle)``; and a torch copy (``copy_`` + an event, then its
synchronize) the same way.  Medians of ``--iters`` after 20 discarded, µs.  Run it under CUDA MPS too
(``issue39_device.sh`` runs it with and without): the stages of a one-GPU host share it through MPS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from stageferry.broker.data.nixl.cuda_runtime import CudaRuntime, EventPool, RuntimeCopy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=1 << 20)
    parser.add_argument("--idle", type=float, nargs="+", default=[0, 2, 50], help="ms asleep before each call")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    torch.cuda.set_device(0)
    src = torch.ones(args.bytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    runtime = CudaRuntime.loaded()
    assert runtime is not None, "torch's CUDA runtime is not a shared library here"
    stream, pool = runtime.stream(), EventPool(runtime)
    pool.put(runtime.event())
    s, d = src.data_ptr(), dst.data_ptr()
    print(f"$ python {' '.join(sys.argv)}\n")
    print(f"{torch.cuda.get_device_name(0)}, {args.bytes:,} bytes, medians of {args.iters} (µs)\n")
    print("| asleep ms | cudaSetDevice | cudaMemcpyAsync | event take + record | wait | runtime, all "
          "| torch copy_ + record | torch synchronize | torch, all |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for idle in args.idle:
        ours, theirs = [], []
        for _ in range(args.iters + 20):
            time.sleep(idle / 1e3)
            t0 = time.perf_counter()
            runtime.set_device(0)
            t1 = time.perf_counter()
            runtime.copy(d, s, args.bytes, stream)
            t2 = time.perf_counter()
            event = pool.take()
            runtime.record(event, stream)
            done = RuntimeCopy(event, pool)
            t3 = time.perf_counter()
            while not done.query():
                pass
            t4 = time.perf_counter()
            ours.append([t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0])
        for _ in range(args.iters + 20):
            time.sleep(idle / 1e3)
            t0 = time.perf_counter()
            dst.copy_(src)
            finished = torch.cuda.Event()
            finished.record()
            t1 = time.perf_counter()
            finished.synchronize()
            t2 = time.perf_counter()
            theirs.append([t1 - t0, t2 - t1, t2 - t0])
        cells = [statistics.median(row[k] for row in ours[20:]) * 1e6 for k in range(5)]
        cells += [statistics.median(row[k] for row in theirs[20:]) * 1e6 for k in range(3)]
        print(f"| {idle:g} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
