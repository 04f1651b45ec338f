"""Checks for compose/smoke.sh, run on the host with the standard library only.

smoke_check.py status TASK STATUS_JSON [--nixl]   a done request; prints its hops; --nixl: the
                                                  encoder→diffusion payload must have crossed over NIXL
smoke_check.py jsonlog SERVICE LOG_FILE           every line a service logged is a JSON object
"""

from __future__ import annotations

import json
import sys


def status(task: str, path: str, must_nixl: bool) -> str:
    """The request's output path; exits non-zero unless it is done (and over NIXL when required)."""
    with open(path) as f:
        s = json.load(f)
    if s["state"] != "done":
        sys.exit(f"{task}: state {s['state']}: {s.get('error')}")
    hops = {t["stage"]: t for t in s["timings"]}
    d, r = hops["diffusion"], s["result"]
    seconds = ", ".join(f"{name} {t['seconds']:.2f}" for name, t in hops.items())
    print(
        f"  {task}: done; {r['location']} ({r['bytes']:,} bytes); encoder->diffusion via {d['transport']}, "
        f"{d['payload_bytes']:,} bytes in {d['transfer_seconds']:.4f} s; stage seconds: {seconds}"
    )
    if must_nixl and d["transport"] != "nixl":
        sys.exit(f"{task}: the payload crossed via {d['transport']}, not nixl")
    return str(r["location"])


def jsonlog(service: str, path: str) -> None:
    with open(path, errors="replace") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    bad = []
    for ln in lines:
        try:
            if not isinstance(json.loads(ln), dict):
                bad.append(ln)
        except ValueError:
            bad.append(ln)
    sample = f"; not JSON: {bad[:3]}" if bad else ""
    print(f"  {service}: {len(lines)} lines, {len(lines) - len(bad)} JSON objects{sample}")
    if bad or not lines:
        sys.exit(1)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "status":
        location = status(args[0], args[1], "--nixl" in args[2:])
        with open(args[1] + ".location", "w") as out:
            out.write(location)
    elif cmd == "jsonlog":
        jsonlog(args[0], args[1])
    else:
        sys.exit(f"unknown check {cmd!r}")
