"""Write a random-weight diffusers checkpoint the diffusers pair can load (no downloads):

    python examples/diffusers/make_checkpoint.py ltx2 /tmp/stageferry-tiny/ltx2     # tiny LTX-2 (t2va, i2va)
    python examples/diffusers/make_checkpoint.py wan /tmp/stageferry-tiny/wan       # tiny Wan 2.1 T2V
    python examples/diffusers/make_checkpoint.py wan-1.3b /tmp/wan-1.3b --dtype bfloat16   # Wan2.1-T2V-1.3B's
                                                                       # DiT and UMT5-XXL's sizes, random weights

The tiny ones are the checkpoints of tests/integrations (diffusers' own fast-test configurations, with an
offline character tokenizer); then run one job through both stages (docs/diffusers.md):

    stageferry --pipeline examples/diffusers/ltx2-tiny.toml up --width 64 --height 64 --fps 25 \\
        --duration 0.36 --steps 2
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from stageferry.integrations.diffusers.tiny import write_checkpoint, write_wan_1_3b  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family", choices=["ltx2", "wan", "wan-1.3b"])
    parser.add_argument("path")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="where the random weights are made (cuda: much faster)")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.family == "wan-1.3b":
        path = write_wan_1_3b(args.path, dtype=args.dtype, device=args.device)
    else:
        path = write_checkpoint(args.family, args.path)
    print(f"wrote {path} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
