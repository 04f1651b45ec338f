"""``benchmarks/throughput.py`` from two source trees, alternating in one run on one box: the before/after
figures of a change that must not change them (issue 36: "without Sentinel nothing changes").

    git worktree add /tmp/sf-before <commit>
    python benchmarks/before_after.py --before /tmp/sf-before --rounds 2 -- --tasks T2VA --replicas 1 --requests 100

Each round runs the before tree's benchmark, then this tree's (``--after``), each against a fresh private
``redis-server`` on loopback (a plain ``redis://`` URL, so that ``INFO commandstats`` counts this run's
commands only), each tree's own code (``PYTHONPATH``) in the same interpreter.  Printed: every run's
requests/s and Redis commands per request by configuration, then per configuration the median of the
rounds, before and after, and the ratio after / before.  The arguments after ``--`` go to throughput.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
#: A row of throughput.py's throughput table: | T2VA (1,234 B) | 1 | nixl | 32.4 | ...
_RPS = re.compile(r"^\| (\w+) \([\d,]+ B\) \| (\d+) \| (\w+) \| ([\d.]+) \|", re.M)
#: Its commands table: the header (| payload | replicas | edge | total | xadd | ...) and a row per configuration.
_HEADER = re.compile(r"^\| payload \| replicas \| edge \| total \| (.*) \|$", re.M)
_COMMANDS = re.compile(r"^\| (\w+) \| (\d+) \| (\w+) \| ([\d.]+) \| (.*) \|$", re.M)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Commands = dict[str, float]  #: per request: "total" and each command by name


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def run_once(tree: Path, bench_args: list[str], log: Path) -> tuple[dict[str, float], dict[str, Commands]]:
    """One throughput.py run of ``tree`` on a fresh redis-server: requests/s and commands per request,
    by configuration."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="sf-ba-redis-") as data:
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", data, "--daemonize", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while not _answers(port):  # redis-py, not redis-cli: the GPU host has only redis-server
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"redis-server on port {port} did not start")
                time.sleep(0.1)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            cmd = [sys.executable, str(tree / "benchmarks" / "throughput.py"), "--redis-url",
                   f"redis://127.0.0.1:{port}/0", *bench_args]  # fmt: skip
            out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
        finally:
            server.terminate()
            server.wait(10)
    log.write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"throughput.py in {tree} failed ({out.returncode}); see {log}")
    throughput, _, rest = out.stdout.partition("## CPU")
    commands = rest.partition("## Redis commands per request")[2].partition("\n## ")[0]  # up to the next table
    rps = {f"{t} x{n} {e}": float(v) for t, n, e, v in _RPS.findall(throughput)}
    header = _HEADER.search(commands)
    names = [n.strip() for n in header.group(1).split("|")] if header else []
    per_request = {
        f"{t} x{n} {e}": {"total": float(total), **{k: float(v) for k, v in zip(names, cells.split("|"), strict=True)}}
        for t, n, e, total, cells in _COMMANDS.findall(commands)
    }
    return rps, per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the source tree before the change")
    parser.add_argument("--after", type=Path, default=ROOT, help="the source tree after it (default: this one)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--logs", type=Path, help="keep each run's full output here")
    parser.add_argument("bench_args", nargs="*", help="after --: throughput.py's own arguments")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs redis-server on PATH")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="sf-ba-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for name, tree in trees.items():
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"{name}: {tree} at {rev.stdout.strip() or '?'}")
    print(f"$ throughput.py {' '.join(args.bench_args)}  ({args.rounds} rounds, alternating; logs in {logs})\n")
    rps: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    cmds: dict[str, dict[str, list[Commands]]] = {"before": {}, "after": {}}
    print("| round | code | configuration | requests/s | Redis commands per request | of them WAIT |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    for rnd in range(1, args.rounds + 1):
        order = list(trees.items()) if rnd % 2 else list(trees.items())[::-1]  # neither always first
        for name, tree in order:
            r, c = run_once(tree, args.bench_args, logs / f"round{rnd}-{name}.txt")
            for config in r:
                counts = c.get(config, {})
                rps[name].setdefault(config, []).append(r[config])
                cmds[name].setdefault(config, []).append(counts)
                total, wait = counts.get("total", float("nan")), counts.get("wait", 0.0)
                print(f"| {rnd} | {name} | {config} | {r[config]:.1f} | {total:.1f} | {wait:.1f} |", flush=True)
    print("\nMedians of the rounds; ratio = after / before (1.00: no change)\n")
    print("| configuration | req/s before | after | ratio | commands/request before | after | ratio | WAIT after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for config in rps["before"]:
        rb, ra = (statistics.median(rps[n].get(config, [float("nan")])) for n in trees)
        cb, ca = (_median(cmds[n].get(config, []), "total") for n in trees)
        wait = _median(cmds["after"].get(config, []), "wait")
        print(f"| {config} | {rb:.1f} | {ra:.1f} | {ra / rb:.2f} | {cb:.1f} | {ca:.1f} | {ca / cb:.2f} | {wait:.1f} |")
    print("\nCommands per request whose medians differ by more than 1, before -> after:")
    for config in rps["before"]:
        runs = cmds["before"][config] + cmds["after"].get(config, [])
        for command in sorted({k for c in runs for k in c} - {"total"}):
            b, a = (_median(cmds[n].get(config, []), command) for n in trees)
            if abs(a - b) > 1:
                print(f"  {config}: {command} {b:.1f} -> {a:.1f}")
    print("  (end)")


def _median(runs: list[Commands], command: str) -> float:
    return statistics.median([c.get(command, 0.0) for c in runs]) if runs else float("nan")


if __name__ == "__main__":
    main()
