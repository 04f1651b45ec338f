"""A READ posted again on its kept handle against one made fresh, inside real gets (CPU box, DRAM over UCX).

    python benchmarks/repost_gets.py                 # 64 KiB and 1 MiB payloads, 300 gets each way
    python benchmarks/repost_gets.py --sizes 4096 --gets 500

Two connectors in this process (a producer and a consumer leader, real NIXL agents, real Redis), the
producer's background loops running, so each payload's slot is freed by its release and the next payload
of its size is put in the same slot (first fit): its READ repeats the last one's regions.  The consumer
takes the payloads one at a time, 2 ms idle before each (as a stage waits for its next envelope), claimed
by the stream read as a stage's are; in blocks of ``--block`` taking turns, with handles kept
(``IDLE_HANDLES`` as shipped; a block's first get makes the handle and is not counted) and with none kept
(0: every READ makes its handle, as before).  Printed: medians of the get as the stage sees it
(call → payload in hand) and of its READ's post step, each way, and their ratio, measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.data.nixl import agent as agent_module  # noqa: E402
from stageferry.broker.data.nixl.connector import NixlConnector  # noqa: E402
from stageferry.config import DataPlaneConfig, Timeouts  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import NixlPayload  # noqa: E402
from stageferry.testing import sized_payload  # noqa: E402


def make(url: str, prefix: str, stage: str) -> NixlConnector:
    conn = NixlConnector(
        redis=connect(url), keys=Keys(prefix), stage=stage, replica="bench",
        config=DataPlaneConfig(inline_max_bytes=0, cpu_pool_bytes=64 << 20, ready_slots=False),
        timeouts=Timeouts(resend=3.0, transfer=10.0),
    )  # fmt: skip
    conn.open()
    return conn


async def run(args: argparse.Namespace) -> None:
    prefix = f"repost-{time.time_ns()}"
    producer, consumer = make(args.redis_url, prefix, "encoder"), make(args.redis_url, prefix, "diffusion")
    shipped_handles = agent_module.IDLE_HANDLES
    rows = []
    reader = consumer.consumer.reader
    read = reader.read
    seen_steps: list[dict[str, int]] = []

    def read_steps(*a: Any, **k: Any) -> Any:  # keeps the get's own steps dict (its payload.get line's)
        seen_steps.append(k["steps"])
        return read(*a, **k)

    async with anyio.create_task_group() as tg:
        await tg.start(producer.run)
        for nbytes in args.sizes:
            seen: dict[str, dict[str, list[float]]] = {
                "kept": {"get": [], "post": []},
                "fresh": {"get": [], "post": []},
            }
            reposts = {"kept": 0, "fresh": 0}
            block = args.block
            blocks = 2 * (-(-args.gets // (block - 1)) + 1)  # the first two blocks warm up
            for i in range(blocks * block):
                way = "kept" if (i // block) % 2 == 0 else "fresh"
                agent_module.IDLE_HANDLES = shipped_handles if way == "kept" else 0
                while len(producer.leases):  # noqa: ASYNC110 - the last slot freed: this payload goes there
                    await anyio.sleep(0.0005)
                out = await producer.put(f"k-{nbytes}-{i}", sized_payload(nbytes, seed=i))
                assert isinstance(out.ref, NixlPayload)
                await consumer.consumer.claim(out.ref)  # as the stream read claims it
                await anyio.sleep(0.002)
                agent = consumer.agent
                assert agent is not None
                if way == "fresh":  # the kept way's handle is not this READ's to find
                    while agent._idle:
                        agent._free(agent._idle.popitem()[1])
                before = agent.reposts
                seen_steps.clear()
                reader.read = read_steps  # type: ignore[method-assign]
                t = time.perf_counter()
                async with consumer.get(out.ref, None, key=f"k-{i}", claimed=True):
                    held = time.perf_counter()
                reader.read = read  # type: ignore[method-assign]
                if i >= 2 * block and i % block:  # a block's first get makes the handle the rest repost
                    seen[way]["get"].append((held - t) * 1e6)
                    seen[way]["post"].append(float(seen_steps[0]["post"]))
                    reposts[way] += agent.reposts - before
            rows.append(
                (nbytes, {w: {k: statistics.median(v) for k, v in d.items()} for w, d in seen.items()}, reposts)
            )
        tg.cancel_scope.cancel()
    agent_module.IDLE_HANDLES = shipped_handles
    for conn in (consumer, producer):
        await conn.aclose()
        await conn.endpoint.redis.aclose()
    print(f"$ python {' '.join(sys.argv)}\n")
    print(f"medians of about {args.gets} gets each way, in blocks of {args.block} taking turns, 2 ms idle before each")
    print("(µs; the post is the READ's post step, from Reader.read's steps)\n")
    head = ("bytes", "get, fresh handle", "get, kept handle", "kept/fresh", "post, fresh", "post, kept", "reposts")
    print("| " + " | ".join(head) + " |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for nbytes, m, reposts in rows:
        fresh, kept = m["fresh"], m["kept"]
        ratio = kept["get"] / fresh["get"]
        cells = (f"{nbytes:,}", f"{fresh['get']:.1f}", f"{kept['get']:.1f}", f"{ratio:.2f}", f"{fresh['post']:.0f}",
                 f"{kept['post']:.0f}", f"{reposts['kept']} kept / {reposts['fresh']} fresh")  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[65536, 1 << 20])
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--block", type=int, default=20, help="gets in a row each way (the ways take turns)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    configure_logging(fmt="json", level="warning", service="bench-repost")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
