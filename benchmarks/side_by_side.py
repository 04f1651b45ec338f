"""Two variants side by side in one run, alternating: the hop (``transfer.py``) and the throughput
(``throughput.py``), medians of the rounds and the ratio B / A (issue 33).

A variant is a source tree and environment: two trees (a change's before and after) or one tree under two
settings (``STAGEFERRY_REDIS_LINK``: the lean link against one dedicated redis-py connection)::

    python benchmarks/side_by_side.py --a before=/tmp/base33 --b after=.                     # a change
    python benchmarks/side_by_side.py --a link=.:STAGEFERRY_REDIS_LINK=1 \\
        --b redis-py=.:STAGEFERRY_REDIS_LINK=redis-py                                       # the link

Each round runs A then B (B then A in even rounds): ``transfer.py --sizes 359024 --inflight 1`` (the T2VA
hop, NIXL and inline, p50 / p99) and ``throughput.py`` on a fresh private redis-server
(:func:`before_after.run_once`: requests/s and Redis commands per request).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from before_after import run_once  # noqa: E402

#: transfer.py's hop row: | T2VA | 359,024 | NIXL p50 | NIXL p99 | inline p50 | inline p99 | ...
_HOP = re.compile(r"^\| (\w+) \| [\d,]+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", re.M)


def variant(spec: str) -> tuple[str, Path, dict[str, str]]:
    """``name=tree[:VAR=value[,VAR=value]]``."""
    name, _, rest = spec.partition("=")
    tree, _, envs = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in envs.split(",") if kv)
    return name, Path(tree).resolve(), env


def hop_once(tree: Path, env: dict[str, str], iters: int, log: Path) -> dict[str, float]:
    cmd = [sys.executable, str(tree / "benchmarks" / "transfer.py"), "--sizes", "359024", "--iters", str(iters),
           "--scaling-sizes", "", "--inflight", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree)},
                         capture_output=True, text=True, timeout=1800)  # fmt: skip
    log.write_text(out.stdout + "\n--- stderr ---\n" + out.stderr)
    match = _HOP.search(out.stdout)
    if match is None:  # (it exits 1 when its 1.2 ms target does not hold: the figures still count)
        raise SystemExit(f"transfer.py in {tree} failed ({out.returncode}); see {log}")
    _, n50, n99, i50, i99 = match.groups()
    return {"hop NIXL p50 ms": float(n50), "hop NIXL p99 ms": float(n99),
            "hop inline p50 ms": float(i50), "hop inline p99 ms": float(i99)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, type=variant, help="name=tree[:VAR=value,...]")
    parser.add_argument("--b", required=True, type=variant, help="name=tree[:VAR=value,...]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hop-iters", type=int, default=300)
    parser.add_argument("--logs", type=Path)
    parser.add_argument("throughput_args", nargs="*", help="after --: throughput.py's own arguments")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="sf-sbs-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    variants = [args.a, args.b]
    for name, tree, env in variants:
        rev = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        print(f"{name}: {tree} at {rev.stdout.strip() or '?'} {' '.join(f'{k}={v}' for k, v in env.items())}")
    print(f"$ transfer.py --sizes 359024 --iters {args.hop_iters} --inflight 1; throughput.py "
          f"{' '.join(args.throughput_args)}  ({args.rounds} rounds, alternating; logs in {logs})\n")  # fmt: skip
    got: dict[str, dict[str, list[float]]] = {name: {} for name, _, _ in variants}
    print("| round | variant | figure | value |")
    print("| ---: | --- | --- | ---: |")
    for rnd in range(1, args.rounds + 1):
        for name, tree, env in variants if rnd % 2 else variants[::-1]:
            figures = hop_once(tree, env, args.hop_iters, logs / f"round{rnd}-{name}-hop.txt")
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # run_once's throughput.py and its serve processes inherit it
            try:
                rps, per_request = run_once(tree, args.throughput_args, logs / f"round{rnd}-{name}-throughput.txt")
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            figures |= {f"{config} requests/s": v for config, v in rps.items()}
            figures |= {f"{config} commands/request": c.get("total", float("nan")) for config, c in per_request.items()}
            for figure, value in figures.items():
                got[name].setdefault(figure, []).append(value)
                print(f"| {rnd} | {name} | {figure} | {value:.3f} |", flush=True)
    (a, _, _), (b, _, _) = variants
    print(f"\nMedians of the rounds; ratio = {b} / {a} (1.00: the same; hop: below 1 is faster, requests/s: above)\n")
    print(f"| figure | {a} | {b} | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for figure in got[a]:
        va, vb = (statistics.median(got[n].get(figure, [float("nan")])) for n in (a, b))
        print(f"| {figure} | {va:.3f} | {vb:.3f} | {vb / va:.2f} |")


if __name__ == "__main__":
    main()
