"""The transfer sweep as a chart (PNG): bandwidth against payload size, one line per path and machine.

    python benchmarks/chart.py results/raw/transfer_cpu_h200host.json:"CPU (32-core host)" \\
        results/raw/transfer_gpu_2xH200.json:"GPU 2×H200" -o benchmarks/results/transfer_sweep.png

Each input is a ``--json`` file written by ``benchmarks/transfer.py``; per size it plots the median
delivery bandwidth (bytes / (XADD → held)) of NIXL and of the inline path through Redis, and the
hardware baseline (memcpy on CPU, torch peer copy on GPU).  Needs matplotlib (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TASK_MARKS = {359_024: "T2VA", 11_158_136: "FL2VA", 64_963_792: "Ref2VA"}


Transfer = dict[str, dict[str, dict[str, list[float]]]]


def series(transfer: Transfer, path: str, key: str) -> tuple[list[int], list[float]]:
    """(sizes, GB/s) of one path's median ``key`` time (ms) per size."""
    sizes = sorted(int(n) for n in transfer)
    return sizes, [int(n) / statistics.median(transfer[str(n)][path][key]) / 1e6 for n in sizes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="FILE.json:LABEL")
    parser.add_argument("-o", "--output", type=Path, default=Path("benchmarks/results/transfer_sweep.png"))
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    styles = {"nixl": "-", "inline": "--", "baseline": ":"}
    for spec in args.inputs:
        file, _, label = spec.partition(":")
        data = json.loads(Path(file).read_text())
        transfer = data["transfer"]
        gpu = data["args"].get("device") == "cuda"
        names = {
            "nixl": "NIXL",
            "inline": "inline through Redis",
            "baseline": "torch peer copy" if gpu else "memcpy",
        }
        for path, key in (("nixl", "delivery"), ("inline", "delivery"), ("baseline", "copy")):
            sizes, gbs = series(transfer, path, key)
            ax.plot(sizes, gbs, styles[path], marker="o", markersize=3, label=f"{label}: {names[path]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    bottom = ax.get_ylim()[0]
    for nbytes, name in TASK_MARKS.items():
        ax.axvline(nbytes, color="grey", linewidth=0.6, alpha=0.5)
        ax.text(nbytes, bottom * 1.5, f" {name}", rotation=90, fontsize=8, color="grey")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("GB/s (median; NIXL and inline: XADD → consumer holds the tensors)")
    ax.set_title("stageferry payload hop: NIXL vs inline through Redis vs the hardware copy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
