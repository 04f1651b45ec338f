"""Probe a gateway's ``/health`` from a process of its own: ``python benchmarks/health_probe.py URL``.

Prints one line per probe — ``<status> <seconds> <problems as JSON>`` — every ``--every`` seconds until
killed.  A fresh connection per probe, as an orchestrator's probe makes.  Run apart from whatever loads
the gateway: a probe in the same process as a thousand in-flight requests times that process's own
event loop, not the gateway (``gateway_concurrency.py`` measured ``/health`` at up to 19.9 s that way
while this probe, in the same burst, measured 1.9 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="the gateway's base URL")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between probes")
    args = parser.parse_args()
    while True:
        asked = time.perf_counter()
        try:
            answer = httpx.get(f"{args.url}/health", timeout=60, headers={"Connection": "close"})
            problems = answer.json().get("problems", []) if answer.status_code != 200 else []
            status = answer.status_code
        except (httpx.HTTPError, ValueError) as exc:
            status, problems = 0, [type(exc).__name__]
        print(status, f"{time.perf_counter() - asked:.4f}", json.dumps(problems), flush=True)
        time.sleep(args.every)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(0)
