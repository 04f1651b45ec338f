"""Redis's own instructions per step of a request's hot path, two trees side by side: counted, not timed.

    python benchmarks/script_instructions.py --base /tmp/base-tree [--requests 300]

Requests/s and Redis's µs per request are noisy on a shared box; the instructions Redis executes for a
step are not (``valgrind --tool=callgrind`` counts them, the same for the same inputs whatever else the
machine does).  For each tree (``--base`` and this one, or ``--this``), in a process of its own with that
tree first on its path, against a private ``redis-server`` run under callgrind (``--hz 1``: few timer
ticks inside a measurement), a request's steps as the stages send them, each over ``--requests`` fresh
requests through the tree's own API (``EntryRecords``, ``StageStream``, ``RequestStore``), with
T2VA-sized arguments (a client's submission, statuses with a timing, a 2.1 KB envelope, a result): a
first stage's read of one entry (its read script moves the submissions its clients pushed onto the intake
list, the count and a surplus at a time, as a busy stage's reads do), its start (``admit_mark_and_look``
with its queued and running), the hand-off to the next stage (with its
``queued``), the next stage's read (one entry, its lease claimed), its start, and the finish.  Between
steps callgrind's counters are zeroed and dumped (``callgrind_control``); printed: instructions per call
of each step for both trees, the ratio, and the sum (a request's hot path; the client's submission and
its wait are not in it).  Needs ``valgrind`` (Debian's) and
``redis-server`` on ``PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = (
    "first stage's read (and move)",
    "first stage's start",
    "hand-off",
    "next stage's read",
    "next stage's start",
    "finish",
)
ENVELOPE_BYTES = 2_077  #: a T2VA envelope with a NIXL payload, as the stages wrote it (MONITOR, 2026-12-04)


class Callgrind:
    """A private ``redis-server`` under callgrind, its counters zeroed and dumped around each step."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.dir, self.port = workdir, port
        self.out = workdir / "cg.out"
        self.proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={self.out}", "redis-server", "--port",
             str(port), "--save", "", "--appendonly", "no", "--hz", "1", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _control(self, *args: str) -> None:
        subprocess.run(["callgrind_control", *args, str(self.proc.pid)], check=True, capture_output=True)

    def zero(self) -> None:
        self._control("-z")

    def dump(self, keep: Path | None = None) -> int:
        """Dump the counters since the last zero; the instructions counted (the dump moved to ``keep``, for
        ``callgrind_annotate``, when given)."""
        before = set(self.dir.glob("cg.out.*"))
        self._control("-d")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for path in set(self.dir.glob("cg.out.*")) - before:
                totals = [line for line in path.read_text().splitlines() if line.startswith("totals:")]
                if totals:
                    if keep is None:
                        path.unlink()
                    else:
                        shutil.move(path, keep)
                    return int(totals[0].split()[1])
            time.sleep(0.05)
        raise TimeoutError("callgrind wrote no dump")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_tree(tree: Path, requests: int, workdir: Path, port: int, keep: Path | None) -> dict[str, float]:
    """One tree's instructions per call of each step (its own process: its own code)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", str(port), "--requests", str(requests),
               "--workdir", str(workdir), *(["--keep", str(keep)] if keep else [])]  # fmt: skip
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exited {done.returncode}:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


async def child(port: int, requests: int, workdir: Path, keep: Path | None) -> dict[str, float]:
    """The steps, over this process's tree (imported from its path), each measured over ``requests`` calls."""
    import uuid

    import anyio

    from stageferry.broker.control.entry_records import EntryKeys, EntryRecords
    from stageferry.broker.control.intake import Intake
    from stageferry.broker.control.keys import Keys
    from stageferry.broker.control.redis_conn import open_client
    from stageferry.broker.control.requests import RequestStore
    from stageferry.broker.control.streams import LeaseClaim, StageStream
    from stageferry.schemas import RequestState, RequestStatus

    cg = Callgrind(workdir, port)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        async with open_client(url) as redis:
            deadline = time.monotonic() + 60
            while True:
                try:
                    await redis.ping()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await anyio.sleep(0.1)
            keys = Keys(f"si{uuid.uuid4().hex[:6]}")
            store = RequestStore(redis, keys, ttl_s=86_400, events_maxlen=2_000)
            records = EntryRecords(redis, keys, ttl_s=86_400)
            claim = LeaseClaim(prefix=keys.claim(""), holder="diffusion-0", ttl_ms=60_000)
            intake = Intake(redis, keys, "encoder", max_item_bytes=64 * 1024)
            enc = StageStream(redis, keys, "encoder", "encoder-0", visibility_ms=60_000, intake=intake)
            dif = StageStream(redis, keys, "diffusion", "diffusion-0", visibility_ms=60_000, lease_claim=claim)
            for stream in (enc, dif):
                await stream.ensure_group()
            rids = [f"video_sync-{uuid.uuid4().hex}" for _ in range(requests + 1)]  # the first: warm-up
            timing = {"stage": "encoder", "seconds": 0.0036, "transport": "none"}
            done_timing = {"stage": "diffusion", "seconds": 0.0053, "transport": "nixl", "payload_bytes": 359104,
                           "transfer_seconds": 0.0025, "route": "DRAM→DRAM cma"}  # fmt: skip
            result = {"location": "redis:x", "redis_key": "x", "bytes": 2, "sha256": "0" * 64, "data": {"b": 359024}}

            def write(rid: str, state: RequestState, stage: str, index: int, mode: Any, **more: Any) -> Any:
                status = RequestStatus(request_id=rid, state=state, stage=stage, **more)
                return store.status_write(status, mode=mode, stage_index=index)

            for rid in rids:  # as a client submits (RequestStore.submit): a Submission's JSON
                job = {"task": "t2va", "prompt": "throughput", "negative_prompt": "", "width": 1344, "height": 768,
                       "fps": 24, "duration": None, "num_frames": None, "num_inference_steps": 1, "seed": 0,
                       "flow_shift": 5.0, "audio_flow_shift": 3.0, "guidance": 5.0, "lora": None,
                       "media": {"first_frame": None, "last_frame": None, "reference_video": None,
                                 "reference_audio": None}}  # fmt: skip
                item = {"v": 1, "ticket": uuid.uuid4().hex, "request_id": rid, "job": job}
                await redis.rpush(intake.list_keys[0], json.dumps(item, separators=(",", ":")))
            got: dict[str, float] = {}
            digest = "d" * 64

            async def step(name: str, calls: list[Any]) -> list[Any]:
                out = [await calls[0]()]  # warm-up: loads the script (NOSCRIPT, then LOAD)
                cg.zero()
                out += [await call() for call in calls[1:]]
                kept = None if keep is None else keep / f"{STEPS.index(name)}-{name.replace(' ', '_')}.callgrind"
                got[name] = cg.dump(kept) / (len(calls) - 1)
                return out

            def start(entry: Any, rid: str, stage: str, index: int, stream: StageStream) -> Any:
                first = index == 0
                timings = [] if first else [timing]
                queued = write(rid, RequestState.QUEUED, stage, index, "create" if first else "update", timings=timings)
                running = write(rid, RequestState.RUNNING, stage, index, "update", timings=timings)
                run = EntryKeys.of(keys, rid, stage, 0, entry.id)
                return lambda: records.admit_mark_and_look(run, digest, entry.id, held=stream.held(entry),
                                                           starts=(queued, running))  # fmt: skip

            firsts = await step(STEPS[0], [lambda: enc.read(count=1, new_only=True) for _ in rids])
            entries = [batch[0] for batch in firsts]
            await step(STEPS[1], [start(e, rid, "encoder", 0, enc) for e, rid in zip(entries, rids, strict=True)])

            def hand(entry: Any, rid: str) -> Any:
                lease = f"{rid}_0_0.{uuid.uuid4().hex[:12]}"
                envelope = json.dumps({"request_id": rid, "key": f"{rid}_0_0", "pad": "e" * ENVELOPE_BYTES})
                fields = {"request_id": rid, "envelope": envelope[:ENVELOPE_BYTES], "lease": lease}
                status = write(rid, RequestState.QUEUED, "diffusion", 1, "any", timings=[timing])
                mark = EntryKeys.of(keys, rid, "encoder", 0, entry.id).crash_field
                return lambda: enc.hand_off(entry.id, "diffusion", fields, status=status, crash_field=mark)

            await step(STEPS[2], [hand(e, rid) for e, rid in zip(entries, rids, strict=True)])
            nexts = await step(STEPS[3], [lambda: dif.read(count=1, new_only=True) for _ in rids])
            entries = [batch[0] for batch in nexts]
            await step(STEPS[4], [start(e, rid, "diffusion", 1, dif) for e, rid in zip(entries, rids, strict=True)])

            def finish(entry: Any, rid: str) -> Any:
                status = write(rid, RequestState.DONE, "diffusion", 1, "any", timings=[timing, done_timing],
                               result=result)  # fmt: skip
                run = EntryKeys.of(keys, rid, "diffusion", 0, entry.id)
                return lambda: dif.finish(entry.id, status=status, cancel=run.cancel, crash_field=run.crash_field,
                                          result_key=keys.result(rid), result=(b"ok", 86_400))  # fmt: skip

            await step(STEPS[5], [finish(e, rid) for e, rid in zip(entries, rids, strict=True)])
            for stream in (enc, dif):
                await stream.aclose()
    finally:
        cg.stop()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the tree to compare with (a git worktree of the base commit)")
    parser.add_argument("--this", type=Path, default=ROOT)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--port", type=int, default=6397)
    parser.add_argument("--keep", type=Path, help="keep each step's callgrind dump in KEEP/<tree>/")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        import anyio

        print(json.dumps(anyio.run(child, args.child, args.requests, args.workdir, args.keep)))
        return
    if args.base is None or shutil.which("valgrind") is None or shutil.which("redis-server") is None:
        raise SystemExit("needs --base, valgrind and redis-server")
    trees = {"base": args.base.resolve(), "this": args.this.resolve()}
    print(f"$ python benchmarks/script_instructions.py --base {args.base} --requests {args.requests}")
    got = {}
    for name, tree in trees.items():
        with tempfile.TemporaryDirectory(prefix=f"si-{name}-") as workdir:
            keep = None if args.keep is None else args.keep.resolve() / name
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
            got[name] = run_tree(tree, args.requests, Path(workdir), args.port, keep)
    print("\nRedis instructions per call (callgrind), a request's hot path step by step\n")
    print("| step | base | this | this / base |")
    print("| --- | ---: | ---: | ---: |")
    for step in STEPS:
        b, t = got["base"][step], got["this"][step]
        print(f"| {step} | {b:,.0f} | {t:,.0f} | {t / b:.2f} |")
    b, t = sum(got["base"].values()), sum(got["this"].values())
    print(f"| **a request (the six)** | **{b:,.0f}** | **{t:,.0f}** | **{t / b:.2f}** |")


if __name__ == "__main__":
    main()
