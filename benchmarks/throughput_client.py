"""One client process of ``benchmarks/throughput.py``: submits its share of the requests and waits for them.

    STAGEFERRY_REDIS_URL=... STAGEFERRY_PREFIX=... STAGEFERRY_PIPELINE=... \\
        python benchmarks/throughput_client.py --requests 500 --first-seed 1000 --warm-up-seed 3

Started by throughput.py (``--clients`` of them per configuration) with the configuration's environment: it
opens its own :class:`~stageferry.client.Client` (``Client.from_settings``), runs one warm-up job (its
connections opened, its scripts loaded), and then talks to its parent in JSON lines on its stdin/stdout:

1. it writes ``{"ready": true}`` and waits for the parent's ``go`` line (the barrier: every client starts
   submitting when the parent says so, after the parent has taken its "before" figures);
2. it submits all of its requests, ``--in-flight`` at a time (1: one by one), as fast as it can, then
   waits for all of them at once;
3. it writes its report — ``started`` (when it read ``go``), per request ``submitted`` and ``done`` (after
   the submit returned / after the wait returned), ``failed`` (requests that ended other than ``done``)
   and ``hops`` (the diffusion stage's payload get, ms) — and waits for its stdin to close, then exits.

Times are ``time.monotonic()`` seconds: ``CLOCK_MONOTONIC``, one clock for every process of a Linux host,
so the parent compares them across its clients.  The report is JSON of plain numbers: nothing read from
Redis is passed on as an object.
The protocol has the process's stdout to itself: fd 1 is pointed at stderr at start, so a library's log
line cannot land in it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402

from stageferry.broker.control import tally  # noqa: E402
from stageferry.client import Client  # noqa: E402
from stageferry.config import Settings  # noqa: E402
from stageferry.schemas import RequestState  # noqa: E402

#: The job every request of the benchmark submits (with its own seed).
JOB = {"task": "t2va", "prompt": "throughput", "num_inference_steps": 1}


def protocol_channel() -> TextIO:
    """The pipe to the parent (this process's stdout at start), line-buffered; fd 1 then points at stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


async def read_parent_line() -> str:
    """The parent's next line on stdin ("" once it has closed it)."""
    return await anyio.to_thread.run_sync(sys.stdin.readline)


def flush_tally() -> None:
    """This process's round-trip counts (``STAGEFERRY_REDIS_TALLY``), written now: the file otherwise only
    follows on the next send, and the parent reads it before and after the measured requests."""
    own = tally.process_tally()
    if own is not None:
        own.flush()


async def submit_and_wait(client: Client, requests: int, first_seed: int, in_flight: int = 1) -> dict[str, Any]:
    """Submit ``requests`` jobs, ``in_flight`` at a time (each submission is two round trips: one after
    another, a client submits at the rate of its round trips), then wait for all of them; the report's
    figures."""
    started = time.monotonic()
    rids: list[str] = [""] * requests
    submitted: list[float] = [0.0] * requests
    turn = iter(range(requests))

    async def submitter() -> None:
        for i in turn:  # the shared iterator hands each index to one submitter
            rids[i] = await client.submit({**JOB, "seed": first_seed + i})
            submitted[i] = time.monotonic()

    async with anyio.create_task_group() as tg:
        for _ in range(min(in_flight, requests)):
            tg.start_soon(submitter)
    done = [0.0] * requests
    hops: list[float] = []
    failed = 0

    async def wait_one(i: int) -> None:
        nonlocal failed
        status = await client.wait(rids[i], timeout=600)
        done[i] = time.monotonic()
        if status.state is not RequestState.DONE:
            failed += 1
            return
        hops.extend(t.transfer_seconds * 1e3 for t in status.timings if t.stage == "diffusion")

    async with anyio.create_task_group() as tg:
        for i in range(requests):
            tg.start_soon(wait_one, i)
    return {"started": started, "submitted": submitted, "done": done, "failed": failed, "hops": hops}


async def main_async(args: argparse.Namespace, channel: TextIO) -> None:
    async with Client.from_settings(Settings()) as client:
        await client.wait(await client.submit({**JOB, "seed": args.warm_up_seed}), timeout=120)
        flush_tally()
        channel.write(json.dumps({"ready": True}) + "\n")
        if (await read_parent_line()).strip() != "go":
            raise SystemExit("throughput_client: the parent closed its pipe before saying go")
        report = await submit_and_wait(client, args.requests, args.first_seed, args.in_flight)
        flush_tally()
        channel.write(json.dumps(report) + "\n")
        await read_parent_line()  # "": the parent has taken its "after" figures and let this process go


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, required=True, help="this process's share of the requests")
    parser.add_argument("--first-seed", type=int, required=True, help="the seed of its first request (+1 each)")
    parser.add_argument("--warm-up-seed", type=int, default=0)
    parser.add_argument("--in-flight", type=int, default=1, help="submissions outstanding at once")
    args = parser.parse_args()
    anyio.run(main_async, args, protocol_channel())


if __name__ == "__main__":
    main()
