"""How long an idle stage takes to exit after SIGTERM, and where the time goes (issue 34 item 15).

Starts a real ``stageferry serve <stage>`` (TP1 and TP2, the NIXL connector on, a private Redis), waits for
its heartbeat, leaves it idle for a moment, sends SIGTERM and times the process's exit.  The stage's JSON
log gives the phases: signal → ``worker.stopped`` → ``group.stopped`` (connectors and NIXL agent closed)
→ the last line → the process reaped (interpreter teardown: atexit, thread joins, C++ destructors).

    python benchmarks/idle_exit.py [--runs 3] [--idle 2] [--model stageferry.stages.reference.encoder:factory]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import anyio

from stageferry.embedded_redis import EmbeddedRedis
from tests.procs import Services, write_pipeline

PHASES = ("service.draining", "worker.stopped", "nixl.agent.closed", "group.stopped")


def _at(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def one_run(tmp: Path, redis_url: str, model: str, tp: int, idle_s: float, run: int) -> dict[str, float]:
    pipeline = write_pipeline(
        tmp / f"p{tp}-{run}.toml",
        [  # two stages: the encoder has an output hop, so a NIXL agent (a one-stage pipeline has no connector)
            {"name": "encoder", "model": model, "tp": tp, "device": "cpu"},
            {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "device": "cpu"},
        ],
        data_plane={"connector": "nixl"},
    )
    with Services(tmp, redis_url=redis_url, prefix=f"idle-exit-{tp}-{run}", pipeline=pipeline, extra_env={}) as svc:
        proc = svc.start("encoder", "a")
        svc.wait_live("encoder", "encoder-a", timeout=180)
        time.sleep(idle_s)  # a benchmark: the stage sits idle on purpose
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        reaped = time.time()
        log = max(tmp.glob(f"encoder-a-{len(svc.procs) - 1}.log"), key=os.path.getmtime)
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    out = {"exit_s": reaped - sent, "code": float(code)}
    for name in PHASES:
        times = [_at(e) for e in events if e.get("event") == name and _at(e) >= sent - 0.5]
        if times:
            out[name] = max(times) - sent
    out["last_line"] = max(_at(e) for e in events) - sent
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle", type=float, default=2.0)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--model", default="stageferry.stages.reference.encoder:factory")
    args = parser.parse_args()
    async with EmbeddedRedis() as redis:
        with tempfile.TemporaryDirectory(prefix="idle-exit-") as tmp:
            for tp in args.tp:
                for run in range(args.runs):
                    row = await anyio.to_thread.run_sync(one_run, Path(tmp), redis.url, args.model, tp, args.idle, run)
                    cells = "  ".join(f"{k}={v:.2f}" for k, v in row.items())
                    print(f"tp={tp} run={run}  {cells}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    anyio.run(main)
