"""Concurrent synchronous requests through the HTTP gateway: all answered, Redis connections bounded.

    python benchmarks/gateway_concurrency.py                   # 1000 concurrent POST /v1/videos/sync
    python benchmarks/gateway_concurrency.py --requests 300 --replicas 2

Everything real and on 127.0.0.1 only: a private ``redis-server`` (or ``--redis-url``), ``stageferry
serve`` processes for an ``encoder`` and a ``diffusion`` stage running the payload-only model
(``stageferry.stages.passthrough``: no compute, a small payload carried inline), and the gateway as its
own ``stageferry gateway`` process.  ``--requests`` sync requests are fired at once from one httpx
async client (its connection pool sized to the burst), each waiting for its video.

Printed: how many were answered, how many 200, the error answers by status and code, latency p50/p99
(request sent → answer), Redis connections (``CLIENT LIST``; everyone's: stages, gateway, this script)
before, at most during and after the burst, the most clients blocked at once in ``XREAD`` (the
gateway's waits; 1 with the shared reader), and ``/health`` probed every half second during the burst
from a process of its own (``health_probe.py``; a probe on this script's own loop, shared with the
burst, is printed too: it times that loop as well, which is how 17-20 s figures were measured for a
gateway that answered within 2 s).
Before the shared reader, each waiting request held a pooled connection of its own (300 concurrent →
200 × 503 ``MaxConnectionsError``, ``/health`` 503, 110 connections left open).

``--code DIR`` runs the services and the gateway from another checkout (e.g. an older commit, for a
before/after comparison); this script itself only talks HTTP and reads ``CLIENT LIST``.

Bounded in time: ``--deadline`` seconds for the whole burst (default 900); what has not answered by
then counts as unanswered.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import httpx  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from bench_stats import machine_facts, pct  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.cli.launcher import ServiceGroup, wait_for_workers  # noqa: E402
from stageferry.embedded_redis import EmbeddedRedis, free_port  # noqa: E402

STAGES = ("encoder", "diffusion")
FORM = {"size": "256x144", "seconds": "1", "num_inference_steps": "1"}


def pipeline_toml() -> str:
    stages = "".join(
        f'[[stages]]\nname = "{name}"\nmodel = "stageferry.stages.passthrough:factory"\ntp = 1\ndevice = "cpu"\n\n'
        for name in STAGES
    )
    return (
        '[data_plane]\nconnector = "inline"\ninline_max_bytes = 1048576\n\n'
        "[limits]\nmax_entry_bytes = 4194304\n\n"
        f"{stages}"
    )


async def redis_clients(admin: aioredis.Redis) -> tuple[int, int]:
    """(connected clients except this admin connection, clients blocked in XREAD)."""
    text = (await admin.execute_command("CLIENT", "LIST")).decode()
    lines = [line for line in text.splitlines() if line.strip()]
    blocked = [line for line in lines if " flags=b" in line and " cmd=xread" in line]
    return len(lines) - 1, len(blocked)


async def burst(base: str, admin: aioredis.Redis, n: int, deadline_s: float) -> dict[str, Any]:
    """Fire ``n`` sync requests at once; sample connections and /health while they run."""
    answers: list[tuple[int, str, float]] = []
    samples: list[tuple[int, int]] = []
    health: collections.Counter[int] = collections.Counter()
    problems: collections.Counter[str] = collections.Counter()
    health_s: list[float] = []
    health_apart: collections.Counter[int] = collections.Counter()
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    timeout = httpx.Timeout(deadline_s, connect=60)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as http:
        running = True

        async def one(i: int) -> None:
            started = time.perf_counter()
            try:
                r = await http.post("/v1/videos/sync", data={**FORM, "prompt": f"burst {i}", "seed": str(i)})
                code = "" if r.status_code == 200 else r.json().get("error", {}).get("code", "?")
                answers.append((r.status_code, code, time.perf_counter() - started))
            except httpx.HTTPError as exc:
                answers.append((0, type(exc).__name__, time.perf_counter() - started))

        async def sample() -> None:
            # A fresh connection per probe, as an orchestrator's probe makes (no keep-alive races).
            async with httpx.AsyncClient(base_url=base, timeout=30, headers={"Connection": "close"}) as probe:
                while running:
                    samples.append(await redis_clients(admin))
                    asked = time.perf_counter()
                    try:
                        answer = await probe.get("/health")
                        health[answer.status_code] += 1
                        if answer.status_code != 200:
                            problems.update(answer.json().get("problems", ["?"]))
                    except httpx.HTTPError as exc:
                        health[0] += 1
                        problems[type(exc).__name__] += 1
                    health_s.append(time.perf_counter() - asked)
                    await anyio.sleep(0.5)

        probe_cmd = [sys.executable, str(ROOT / "benchmarks" / "health_probe.py"), base]
        started = time.perf_counter()
        async with await anyio.open_process(probe_cmd, stdout=subprocess.PIPE) as probe_proc:
            with anyio.move_on_after(deadline_s):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sample)
                    async with anyio.create_task_group() as requests:
                        for i in range(n):
                            requests.start_soon(one, i)
                    running = False
            running = False
            wall = time.perf_counter() - started
            probe_proc.terminate()
            assert probe_proc.stdout is not None
            probed = ""
            async for chunk in probe_proc.stdout:
                probed += chunk.decode()
    apart = [line.split(" ", 2) for line in probed.splitlines() if line.strip()]
    for status, _seconds, listed in apart:
        health_apart[int(status)] += 1
        if status != "200":
            problems.update(json.loads(listed) or ["?"])
    await anyio.sleep(2.0)  # let the gateway settle, then count what stays open
    return {"answers": answers, "samples": samples or [(0, 0)], "health": health, "wall": wall,
            "problems": problems, "health_s": health_s or [0.0], "after": await redis_clients(admin),
            "health_apart": health_apart, "apart_s": [float(s) for _, s, _ in apart] or [0.0]}  # fmt: skip


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="sf-gwc-") as tmp:
        work = Path(tmp)
        os.chdir(work)  # children run `python -m stageferry`: the working directory must not shadow --code
        server = None if args.redis_url else EmbeddedRedis(extra_args=("--maxclients", "10000"))
        if server is not None:
            await server.start()
        url = args.redis_url or server.url  # type: ignore[union-attr]
        prefix = f"gwc-{uuid.uuid4().hex[:8]}"
        pipeline = work / "pipeline.toml"
        pipeline.write_text(pipeline_toml())
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(args.code), os.environ.get("PYTHONPATH")])),
            "STAGEFERRY_REDIS_URL": url,
            "STAGEFERRY_PREFIX": prefix,
            "STAGEFERRY_PIPELINE": str(pipeline),
            "STAGEFERRY_LOG_FORMAT": "json",
            "STAGEFERRY_LOG_LEVEL": "warning",
            "OMP_NUM_THREADS": "1",
        }
        services = ServiceGroup(env, work / "logs")
        admin = aioredis.Redis.from_url(url)
        port = free_port()
        try:
            for stage in STAGES:
                for r in range(args.replicas):
                    argv = ["env", f"STAGEFERRY_REPLICA={stage}{r}", sys.executable, "-m", "stageferry", "serve", stage]
                    await services.start(f"{stage}-{r}", argv)
            gateway = [sys.executable, "-m", "stageferry", "gateway", "--port", str(port), "--sync-timeout", "600"]
            await services.start("gateway", gateway)
            await wait_for_workers(admin, Keys(prefix), list(STAGES), timeout=180)
            base = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=base, timeout=10) as http:
                with anyio.fail_after(120):
                    while True:
                        try:
                            if (await http.get("/health")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        await anyio.sleep(0.2)
                warm = await http.post("/v1/videos/sync", data={**FORM, "prompt": "warm-up"}, timeout=120)
                assert warm.status_code == 200, warm.text
            before = await redis_clients(admin)
            result = await burst(base, admin, args.requests, args.deadline)
        finally:
            await services.stop()
            await admin.aclose()
            if server is not None:
                await server.stop()
    report(args, before, result)


def report(args: argparse.Namespace, before: tuple[int, int], r: dict[str, Any]) -> None:
    answers = r["answers"]
    ok = [a for a in answers if a[0] == 200]
    errors = collections.Counter(f"{status} {code}" for status, code, _ in answers if status != 200)
    latencies = [a[2] for a in answers if a[0] != 0] or [0.0]
    during = max(total for total, _ in r["samples"])
    blocked = max(b for _, b in r["samples"])
    health = r["health"]
    print(f"machine: {machine_facts()}")
    print(f"{args.requests} concurrent POST /v1/videos/sync, payload-only models, {args.replicas} replica(s)/stage")
    print(f"services and gateway run the code in {args.code}\n")
    print("| requests | answered | ok (200) | errors | latency p50 / p99 (s) | wall (s) "
          "| Redis conns before / max during / after | max blocked XREAD | /health 200 / probes |")  # fmt: skip
    print("| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {args.requests} | {len(answers)} | {len(ok)} | {', '.join(f'{n} × {e}' for e, n in errors.items()) or '-'} "
        f"| {pct(latencies, 50):.2f} / {pct(latencies, 99):.2f} | {r['wall']:.1f} "
        f"| {before[0]} / {during} / {r['after'][0]} | {blocked} | {health[200]} / {sum(health.values())} |"
    )
    apart, inside = r["apart_s"], r["health_s"]
    print(
        f"\n/health answer time during the burst, probed from a process of its own: p50 {pct(apart, 50):.2f} s, "
        f"max {max(apart):.2f} s, {r['health_apart'][200]} × 200 of {sum(r['health_apart'].values())} probes"
    )
    print(
        f"(probed from this script's event loop, which the {args.requests} requests share, so it times that loop "
        f"too: p50 {pct(inside, 50):.2f} s, max {max(inside):.2f} s)"
    )
    for problem, n in r["problems"].items():
        print(f"/health problem ({n}×): {problem}")
    unanswered = args.requests - len(answers)
    if unanswered:
        print(f"\n{unanswered} requests unanswered within {args.deadline:g}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=1, help="service replicas per stage")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole burst")
    parser.add_argument("--redis-url", default=None, help="default: a private redis-server")
    parser.add_argument(
        "--code", type=Path, default=ROOT, help="checkout whose stageferry the services and gateway run (before/after)"
    )
    args = parser.parse_args()
    print(f"$ python {' '.join(sys.argv)}\n")
    anyio.run(main_async, args)


if __name__ == "__main__":
    main()
