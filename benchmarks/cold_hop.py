"""The first hop against warm hops, side by side: peers connected on the first request (as before issue 39)
or ahead of it (the upstream watch), in one run.

    python benchmarks/cold_hop.py                        # T2VA-sized payload, DRAM, 4 rounds per mode
    python benchmarks/cold_hop.py --bytes 11158136 --device cuda --rounds 3

Each round makes a fresh producer and consumer connector (two real NIXL agents in this process, a new
key prefix), starts them as a stage does, then sends ``--hops`` payloads the way stages do: put, the
hand-off's write (entry + wake-up), the consumer's stream read (whose script claims the lease), get; it
times each get as the stage's status shows it (``transfer s``: peer lookup, checks, READ, release) and the
whole hop (put start → payload held and released).  Mode ``on-request``
gives the consumer no upstream stage, so its first payload loads the producer's agent (what the code did
before); mode ``ahead`` names the producer's stage as upstream and waits until the watch connected it
(how long that took is shown) before the first put.  In both, the control plane is as a stage's is
before its first entry (the hand-off's script loaded, the stream read once): the whole first hop then
differs from a warm one by the data plane's cold costs alone.  The modes alternate round by round; a first round,
not counted, takes the process's own first-use costs (imports, first agent, allocator).  Printed: the
first hop of each round, the median of the warm hops (hops 2..N) and first/warm, then medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from transfer import WRITE_LUA, connector, payload_for  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.control.streams import LEASE_FIELD, StageStream  # noqa: E402
from stageferry.broker.data.nixl.upstream import UpstreamWatch  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import NixlPayload, PayloadRef  # noqa: E402

PRODUCER_STAGE, CONSUMER_STAGE = "bench-enc", "bench-dif"


async def one_round(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    prefix = f"coldhop-{uuid.uuid4().hex[:8]}"
    device = torch.device(args.device)
    redis_p, redis_c = connect(args.redis_url), connect(args.redis_url)
    # Both agents live in this process: a CUDA IPC handle cannot be opened by the process that made it, so
    # the same-GPU copy (benchmarks/same_gpu.py) is off and a GPU hop here is NIXL's.
    producer = connector(redis_p, prefix, PRODUCER_STAGE, args.pool_bytes, device, same_gpu_copy=False)
    consumer = connector(redis_c, prefix, CONSUMER_STAGE, args.pool_bytes, device, same_gpu_copy=False)
    if mode == "ahead":  # what build_connectors does for a stage with an input edge
        consumer.upstream = UpstreamWatch(consumer.endpoint, consumer.peers, PRODUCER_STAGE)
    for conn in (producer, consumer):
        await anyio.to_thread.run_sync(conn.open)
        assert conn.agent is not None, conn.unavailable_reason
    keys = Keys(prefix)
    stream = StageStream(
        consumer.endpoint.redis, keys, CONSUMER_STAGE, f"{CONSUMER_STAGE}-0", visibility_ms=600_000,
        lease_claim=consumer.lease_claim(),
    )  # fmt: skip
    await stream.ensure_group()
    write = producer.endpoint.redis.register_script(WRITE_LUA)
    refs: TypeAdapter[PayloadRef] = TypeAdapter(PayloadRef)
    payload = payload_for(args.bytes, device)
    transfer_ms: list[float] = []
    hop_ms: list[float] = []
    connect_ms = None
    async with anyio.create_task_group() as tg:
        await tg.start(producer.run)  # publishes the producer's record (and its stage index entry)
        started = time.perf_counter()
        await tg.start(consumer.run)  # with an upstream: one round of the watch before it reports started
        if mode == "ahead":
            while producer.name not in consumer.peers:  # noqa: ASYNC110  (polled: it has no event)
                await anyio.sleep(0.001)
            connect_ms = (time.perf_counter() - started) * 1e3
        # Both modes, as a stage is before its first entry: its scripts loaded (the hand-off's write here)
        # and its stream read once, empty.  The modes then differ only in the peer's connection.
        await producer.endpoint.redis.script_load(WRITE_LUA)
        assert not await stream.read(1, block_ms=1)
        for i in range(args.hops):
            t0 = time.perf_counter()
            ref = (await producer.put(f"r{i}_0_0", payload)).ref
            assert isinstance(ref, NixlPayload)
            await write(
                keys=[keys.stage_stream(CONSUMER_STAGE), keys.wake(CONSUMER_STAGE)],
                args=["ref", ref.model_dump_json(), LEASE_FIELD, ref.token],
            )
            (entry,) = await stream.read(1, block_ms=1000)
            got = refs.validate_json(entry.fields["ref"])
            async with consumer.get(got, None, key=f"r{i}_0_0", claimed=entry.claimed(ref.token)) as incoming:
                assert incoming.transport.value == "nixl", incoming.fallback_reason
                transfer_ms.append(incoming.seconds * 1e3)
            hop_ms.append((time.perf_counter() - t0) * 1e3)
            await stream.ack(entry.id)
        tg.cancel_scope.cancel()
    await stream.aclose()
    await consumer.aclose()
    await producer.aclose()
    for r in (redis_p, redis_c):
        await r.aclose()
    return {"mode": mode, "transfer": transfer_ms, "hop": hop_ms, "connect_ms": connect_ms}


def row(result: dict[str, Any], label: str) -> list[str]:
    warm_t, warm_h = statistics.median(result["transfer"][1:]), statistics.median(result["hop"][1:])
    first_t, first_h = result["transfer"][0], result["hop"][0]
    con = "-" if result["connect_ms"] is None else f"{result['connect_ms']:.1f}"
    return [label, result["mode"], con, f"{first_t:.3f}", f"{warm_t:.3f}", f"{first_t / warm_t:.2f}×",
            f"{first_h:.3f}", f"{warm_h:.3f}", f"{first_h / warm_h:.2f}×"]  # fmt: skip


async def run(args: argparse.Namespace) -> None:
    header = ["round", "mode", "connect ms", "1st get ms", "warm get ms", "1st/warm",
              "1st hop ms", "warm hop ms", "1st/warm"]  # fmt: skip
    rows = [header]
    rows.append(row(await one_round(args, "on-request"), "warm-up (not counted)"))
    results: dict[str, list[dict[str, Any]]] = {"on-request": [], "ahead": []}
    for r in range(args.rounds):
        for mode in ("on-request", "ahead") if r % 2 == 0 else ("ahead", "on-request"):
            result = await one_round(args, mode)
            results[mode].append(result)
            rows.append(row(result, str(r + 1)))
    print(f"$ python {' '.join(sys.argv)}\n")
    print(f"{args.bytes:,} bytes on {args.device}, {args.hops} hops per round (warm = median of hops 2..N)\n")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for line in rows:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
    print("\nmedians over rounds:")
    for mode, rs in results.items():
        first = statistics.median(x["transfer"][0] for x in rs)
        warm = statistics.median(statistics.median(x["transfer"][1:]) for x in rs)
        first_h = statistics.median(x["hop"][0] for x in rs)
        warm_h = statistics.median(statistics.median(x["hop"][1:]) for x in rs)
        print(f"  {mode:<11} first get {first:.3f} ms, warm get {warm:.3f} ms: first/warm {first / warm:.2f}×;"
              f"  first hop {first_h:.3f} ms, warm hop {warm_h:.3f} ms: {first_h / warm_h:.2f}×")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=359_024)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--hops", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pool-bytes", type=int, default=256 << 20)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configure_logging(fmt="json", level="warning", service="bench-cold-hop")
    anyio.run(run, args)


if __name__ == "__main__":
    main()
