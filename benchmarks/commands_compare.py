"""Redis commands per request and requests/s of two trees of stageferry, side by side in one run.

    git worktree add /tmp/entry-base <base commit>
    python benchmarks/commands_compare.py --base /tmp/entry-base --replicas 2 --requests 200

Runs ``benchmarks/throughput.py`` of the ``--base`` tree and then of this tree (or ``--this``) (each with its own code:
the script puts its own tree first on the path of itself and of every stage process), T2VA over the NIXL
edge by default, each against a fresh private ``redis-server`` (``INFO commandstats`` counts every
client of a server, so a shared one would add others' commands), ``--rounds`` times in turn.  Printed:
each run's requests/s and commands per request, then the commands per request by name for both trees and
the ratios (this tree / base).

``--clients N`` goes to both trees' throughput.py (its client processes) when the base tree's throughput.py
has that option.  A base from before it (found by looking for ``--clients`` in its throughput.py) submits
from one client, so then this tree runs with ``--clients 1`` too and ``N`` is not used; which of the two
happened is printed first.  Without ``--clients`` each tree runs with its own default, except that against
such an old base this tree, again, runs with one client.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
from bench_stats import machine_facts, median  # noqa: E402

from stageferry.embedded_redis import EmbeddedRedis  # noqa: E402

_ROW = re.compile(r"^\| (\w+) \([\d,]+ B\) \| (\d+)(?: \(\d+ held\))? \| (\w+) \| ([\d.]+) \|")
#: Redis's main thread per request (throughput.py's "where the time goes" heading): its CPU, the scripts'.
_MAIN_THREAD = re.compile(r"main thread ([\d.]+) µs per request, scripts ([\d.]+)")
#: The line naming the client processes (throughput.py with ``--clients``; an older one has none).
_CLIENTS = re.compile(r"shared by (\d+) client process", re.M)


def parse(output: str) -> tuple[float, dict[str, float]]:
    """The requests/s and the commands per request (by name, and ``total``) that throughput.py printed, with
    Redis's main-thread CPU µs per request (``cpu_us``) and the scripts' (``scripts_us``) where it printed them."""
    lines = output.splitlines()
    rps = next(float(m.group(4)) for line in lines if (m := _ROW.match(line)))
    at = next(i for i, line in enumerate(lines) if line.startswith("| payload | replicas | edge | total |"))
    names = [cell.strip() for cell in lines[at].strip("|").split("|")][3:]
    values = [cell.strip() for cell in lines[at + 2].strip("|").split("|")][3:]
    counts = {name: float(value) for name, value in zip(names, values, strict=True)}
    if m := _MAIN_THREAD.search(output):
        counts["cpu_us"], counts["scripts_us"] = float(m.group(1)), float(m.group(2))
    return rps, counts


def clients_of(output: str) -> str:
    """How many client processes throughput.py said it ran ("1, in-process" for one from before ``--clients``)."""
    m = _CLIENTS.search(output)
    return m.group(1) if m else "1, in-process"


def has_clients_option(tree: Path) -> bool:
    """Whether the tree's throughput.py takes ``--clients``."""
    try:
        return "--clients" in (tree / "benchmarks" / "throughput.py").read_text()
    except OSError:
        return False


def clients_args(trees: dict[str, Path], clients: int | None) -> tuple[dict[str, list[str]], str]:
    """Each tree's ``--clients`` arguments, and a line saying what was chosen: ``clients`` for both (nothing:
    their defaults) when the base takes the option, else ``--clients 1`` for a tree that takes it (the old
    base submits from one client)."""
    if has_clients_option(trees["base"]):
        given = [] if clients is None else ["--clients", str(clients)]
        said = f"--clients {clients} to both trees" if given else "each tree's default --clients"
        return {name: given for name in trees}, f"client processes: {said} (the base's throughput.py has --clients)"
    args = {name: ["--clients", "1"] if has_clients_option(tree) else [] for name, tree in trees.items()}
    unused = "" if clients is None else f"; --clients {clients} not used"
    return args, (
        "client processes: the base's throughput.py has no --clients (one client): one for both, "
        f"--clients 1 to a tree that takes it{unused}"
    )


async def run_tree(
    tree: Path, args: argparse.Namespace, workdir: Path, extra: list[str]
) -> tuple[float, dict[str, float], str]:
    async with EmbeddedRedis(data_dir=workdir / "redis") as server:
        command = [
            sys.executable,
            str(tree / "benchmarks" / "throughput.py"),
            "--tasks", args.task, "--replicas", str(args.replicas), "--requests", str(args.requests),
            "--edges", args.edge, "--redis-url", server.url, *extra,
            *(["--entries-in-flight", str(args.entries_in_flight)] if args.entries_in_flight else []),
        ]  # fmt: skip
        done = await anyio.run_process(command, check=False, cwd=tree, env=_env(tree), stderr=subprocess.STDOUT)
    output = done.stdout.decode(errors="replace")
    if done.returncode != 0:
        raise SystemExit(f"{tree}: throughput.py exited {done.returncode}:\n{output[-4000:]}")
    rps, commands = parse(output)
    return rps, commands, output


def _env(tree: Path) -> dict[str, str]:
    import os

    env = dict(os.environ)
    # the tree first; the caller's path after it (a device machine's carried wheels live there)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


async def main_async(args: argparse.Namespace) -> None:
    import tempfile

    trees = {"base": args.base, "this": args.this}
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in trees}
    extra, clients_line = clients_args(trees, args.clients)
    print(clients_line, flush=True)
    with tempfile.TemporaryDirectory(prefix="sf-cmp-") as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                workdir = Path(tmp) / f"{name}-{r}"
                workdir.mkdir()
                rps, commands, output = await run_tree(tree, args, workdir, extra[name])
                runs[name].append((rps, commands))
                if args.verbose:
                    print(f"### {name} ({tree}), round {r + 1}\n\n{output}\n")
                print(
                    f"# {name} round {r + 1}: {rps:.1f} req/s, {commands['total']:.1f} commands/request, "
                    f"Redis main thread {commands.get('cpu_us', 0.0):.1f} µs/request, "
                    f"client processes: {clients_of(output)}",
                    flush=True,
                )
    base_commit = _commit(trees["base"])
    this_commit = _commit(trees["this"])
    print(f"\nmachine: {machine_facts()}")
    print(
        f"{args.task} over {args.edge}, {args.replicas} replica(s) per stage, {args.requests} requests at once, "
        f"{args.rounds} round(s), a fresh redis-server per run; base {base_commit} ({trees['base']}), this "
        f"{this_commit}\n{clients_line}\n"
    )
    print(
        "| tree | requests/s (median) | Redis commands per request (median) | Redis main thread µs per request "
        "(median) | of it in scripts |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    summary = {}
    for name in trees:
        rps = median([r for r, _ in runs[name]])
        total = median([c["total"] for _, c in runs[name]])
        cpu = median([c.get("cpu_us", 0.0) for _, c in runs[name]])
        scripts = median([c.get("scripts_us", 0.0) for _, c in runs[name]])
        summary[name] = (rps, total, cpu)
        print(f"| {name} | {rps:.1f} | {total:.1f} | {cpu:.1f} | {scripts:.1f} |")
    (base_rps, base_total, base_cpu), (this_rps, this_total, this_cpu) = summary["base"], summary["this"]
    cpu_ratio = f", Redis main thread µs per request {this_cpu / base_cpu:.2f}×" if base_cpu and this_cpu else ""
    print(
        f"\nthis / base: requests/s {this_rps / base_rps:.2f}×, commands per request {this_total / base_total:.2f}× "
        f"({base_total:.1f} → {this_total:.1f}){cpu_ratio}\n"
    )
    names = sorted(
        {n for name in trees for _, c in runs[name] for n in c if n not in ("total", "cpu_us", "scripts_us")},
        key=lambda n: -max(c.get(n, 0.0) for name in trees for _, c in runs[name]),
    )
    print("| command | base | this |")
    print("| --- | ---: | ---: |")
    for n in names:
        cells = [median([c.get(n, 0.0) for _, c in runs[name]]) for name in trees]
        print(f"| {n} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")


def _commit(tree: Path) -> str:
    """The tree's commit, when the tree is a git checkout's root; "?" for an unpacked archive (then git
    would name the commit of whatever repository holds it)."""
    top = subprocess.run(["git", "-C", str(tree), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if not top.stdout.strip() or Path(top.stdout.strip()).resolve() != tree.resolve():
        return "? (not a git checkout's root)"
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the tree to compare with (a git worktree of the base commit)")
    parser.add_argument(
        "--this",
        default=str(ROOT),
        help="the tree measured against it (default: this one; a worktree of a commit keeps edits out of the run)",
    )
    parser.add_argument("--task", default="T2VA")
    parser.add_argument("--edge", default="nixl", choices=["nixl", "inline"])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--clients",
        type=int,
        help="throughput.py's --clients for both trees, if the base's throughput.py has it (default: theirs)",
    )
    parser.add_argument("--entries-in-flight", type=int, help="throughput.py's --entries-in-flight, for both trees")
    parser.add_argument("--verbose", action="store_true", help="print each run's whole throughput.py output")
    args = parser.parse_args()
    args.base, args.this = Path(args.base).resolve(), Path(args.this).resolve()
    print(f"$ python {' '.join(sys.argv)}\n")
    anyio.run(main_async, args)


if __name__ == "__main__":
    main()
