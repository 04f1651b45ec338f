"""The hot path's Redis round trips, redis-py against the lean link (stageferry/broker/control/resp_link.py).

Two processes, as in a hop: a *writer* runs a hand-off-like script (XADD-free: one LPUSH on the wake list,
carrying its send time) every ``--gap-us``, and a *waiter* waits on that list with the stage's own
wait-and-read shape (``BLPOP`` + ``EVALSHA`` in one pipeline).  Printed per client, p50 / p90 in µs:

* ``write round trip``: the writer's script call, send to reply;
* ``write → in hand``: the writer's send to the waiter holding both replies (the hop's "hand-off write →
  entry in hand").

Three clients: ``redis-py`` (its pooled client, as the stages use it without the link), ``redis-py 1-conn``
(redis-py without its pool: a ``single_connection_client`` for the writer's script, and one dedicated
connection for the waiter's pipeline, written with one ``send_packed_command`` and read reply by reply),
and ``link``.

Both clients run in the same invocation, in alternating blocks (redis-py, link, redis-py, link), each
block its own pair of processes::

    python benchmarks/resp_link.py --rounds 1500 --gap-us 1000
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.asyncio import Redis  # noqa: E402

from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.control.resp_link import open_link, run_script  # noqa: E402

WRITE = "return redis.call('LPUSH', KEYS[1], ARGV[1])"
READ = "return redis.call('LRANGE', KEYS[1], 0, -1)"  # a small script, as the read is
KEY, STOP = "bench:resp_link:wake", b"stop"


CLIENTS = ("redis-py", "redis-py 1-conn", "link")


async def _writer(url: str, client: str, rounds: int, gap_s: float, out: mp.Queue) -> None:
    redis = Redis.from_url(url, single_connection_client=True) if client == "redis-py 1-conn" else connect(url)
    link = open_link(redis) if client == "link" else None
    script = redis.register_script(WRITE)
    await asyncio.sleep(0.3)  # the waiter is waiting
    times = []
    for _ in range(rounds):
        await asyncio.sleep(gap_s)
        t0 = time.perf_counter()
        await run_script(link, script, [KEY], [repr(t0)])
        times.append(time.perf_counter() - t0)
    await run_script(link, script, [KEY], [STOP])
    out.put(times)
    if link is not None:
        await link.aclose()
    await redis.aclose()


async def _waiter(url: str, client: str, out: mp.Queue) -> None:
    redis = connect(url)
    link = open_link(redis) if client == "link" else None
    read = redis.register_script(READ)
    await read(keys=["bench:resp_link:none"], args=[])  # loaded
    wait, cmd = ("BLPOP", KEY, 1), ("EVALSHA", read.sha, 1, "bench:resp_link:none")
    own = await redis.connection_pool.get_connection() if client == "redis-py 1-conn" else None
    lags = []
    while True:
        if link is not None:
            woken, _ = await link.send([wait, cmd], block_s=1)
        elif own is not None:  # one dedicated connection: both commands in one write, replies in order
            await own.send_packed_command(own.pack_commands([wait, cmd]))
            woken, _ = await own.read_response(), await own.read_response()
        else:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.execute_command(*wait)
                pipe.execute_command(*cmd)
                woken, _ = await pipe.execute()
        now = time.perf_counter()
        if woken is None:
            continue
        if woken[1] == STOP:
            break
        lags.append(now - float(woken[1]))
    out.put(lags)
    if link is not None:
        await link.aclose()
    if own is not None:
        await redis.connection_pool.release(own)
    await redis.aclose()


def _run(target: str, *args: object) -> None:
    coro = _writer if target == "writer" else _waiter
    asyncio.run(coro(*args))  # type: ignore[arg-type]


def block(url: str, client: str, rounds: int, gap_s: float) -> tuple[list[float], list[float]]:
    ctx = mp.get_context("spawn")
    wq, lq = ctx.Queue(), ctx.Queue()
    waiter = ctx.Process(target=_run, args=("waiter", url, client, lq))
    writer = ctx.Process(target=_run, args=("writer", url, client, rounds, gap_s, wq))
    waiter.start()
    writer.start()
    writes, lags = wq.get(timeout=600), lq.get(timeout=600)
    writer.join(30)
    waiter.join(30)
    return writes, lags


def pcts(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e6:.1f} | {xs[int(len(xs) * 0.9)] * 1e6:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--gap-us", type=int, default=1000, help="idle time between rounds (a hop's idle)")
    parser.add_argument("--blocks", type=int, default=2, help="alternating blocks per client")
    args = parser.parse_args()
    got: dict[str, tuple[list[float], list[float]]] = {client: ([], []) for client in CLIENTS}
    for _ in range(args.blocks):
        for client in got:
            writes, lags = block(args.redis_url, client, args.rounds, args.gap_us / 1e6)
            got[client][0].extend(writes[50:])  # the first rounds connect and warm up
            got[client][1].extend(lags[50:])
    print(
        f"| client (gap {args.gap_us} µs, {args.blocks} × {args.rounds} rounds) | write round trip p50 | p90 "
        "| write → in hand p50 | p90 |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for client, (writes, lags) in got.items():
        print(f"| {client} | {pcts(writes)} | {pcts(lags)} |")
    link_p50 = statistics.median(got["link"][1])
    for client in CLIENTS[:-1]:
        print(f"\nwrite → in hand, {client} / link (p50): {statistics.median(got[client][1]) / link_p50:.2f}×", end="")
    print()


if __name__ == "__main__":
    main()
