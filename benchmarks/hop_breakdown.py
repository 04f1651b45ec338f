"""Where a small payload's hop goes: each step of the product's hop timed on its own, in one process.

    python benchmarks/hop_breakdown.py                   # T2VA-sized payload, 400 hops
    python benchmarks/hop_breakdown.py --bytes 4096 --progress-delay-us 0

A diagnostic, not a comparison: producer and consumer connectors live in one process (two NIXL agents,
CMA between them), and the hop is unrolled into its steps through the connector's own internals, so the
numbers say which step to work on: the put; the hand-off's write (the entry and the stage's wake-up, one
round trip); the consumer's stream read (:meth:`StageStream.read`, whose script also claims the payload's
lease: no claim round trip of its own); parsing the reference, validation, peer lookup, slot
acquisition; the READs (posted all at once, without a notification), the wait for DONE and the release
notification; then unpacking and releasing.  In one process the entry is already there when the read
runs, so the wake-up that a waiting consumer also pays is not in it (``transfer.py`` has the whole hop
between two processes).  "wake-ups" counts the READ wait's returns to the event loop per hop.  A second
series times the whole ``connector.get`` as a stage calls it.  Medians after 50 warm-up hops.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402
from bench_stats import print_steps  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from transfer import WRITE_LUA, connector, payload_for  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.control.streams import LEASE_FIELD, StageStream  # noqa: E402
from stageferry.broker.data.nixl.agent import NixlAgent  # noqa: E402
from stageferry.broker.data.payload_codec import plan_payload, unpack, validate_manifest, validate_remote_regions  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import NixlPayload, PayloadRef  # noqa: E402

WARMUP = 50


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    prefix = f"breakdown-{uuid.uuid4().hex[:6]}"
    cpu = torch.device("cpu")
    producer = connector(connect(args.redis_url), prefix, "p", 64 << 20, cpu)
    consumer = connector(connect(args.redis_url), prefix, "c", 64 << 20, cpu)
    for conn in (producer, consumer):
        conn.agent = NixlAgent(conn.name, progress_delay_us=args.progress_delay_us)
        await anyio.to_thread.run_sync(conn.open)
    keys = Keys(prefix)
    stream = StageStream(
        consumer.endpoint.redis, keys, "c", "c-0", visibility_ms=600_000, lease_claim=consumer.lease_claim()
    )
    await stream.ensure_group()
    write = producer.endpoint.redis.register_script(WRITE_LUA)
    refs: TypeAdapter[PayloadRef] = TypeAdapter(PayloadRef)
    payload = payload_for(args.bytes, cpu)
    steps: dict[str, list[float]] = {}

    def timed(name: str, started: float) -> float:
        now = time.perf_counter()
        steps.setdefault(name, []).append((now - started) * 1e3)
        return now

    async def hand_off(ref: NixlPayload) -> None:
        """What a producer stage's hand-off writes: the entry and the wake-up, one round trip."""
        await write(
            keys=[keys.stage_stream("c"), keys.wake("c")], args=["ref", ref.model_dump_json(), LEASE_FIELD, ref.token]
        )

    async with anyio.create_task_group() as tg:
        await tg.start(producer.run)
        await tg.start(consumer.run)
        for i in range(args.hops + WARMUP):
            t = begin = time.perf_counter()
            plan_payload(payload)
            t = timed("plan (part of put)", t)
            ref = (await producer.put(f"k{i}", payload)).ref
            t = timed("put", t)
            await hand_off(ref)  # type: ignore[arg-type]
            t = timed("hand-off write (XADD + wake-up)", t)
            (entry,) = await stream.read(1, block_ms=1000)
            t = timed("stream read (its script claims the lease)", t)
            ref = refs.validate_json(entry.fields["ref"])
            assert isinstance(ref, NixlPayload)
            t = got = timed("parse the ref", t)
            validate_manifest(ref.manifest, max_payload_bytes=1 << 30)
            t = timed("validate manifest", t)
            peer = await consumer.peers.ensure(ref)
            validate_remote_regions(ref.manifest, ref.regions, peer.arenas)
            t = timed("peer + descriptor checks", t)
            slots = await consumer.pools.acquire_regions(ref.manifest, timeout=5)  # type: ignore[union-attr]
            t = timed("acquire slot", t)
            cons = consumer.consumer
            wakeups = cons.wakeups
            t = critical = time.perf_counter()
            handles = [
                cons.reader._post(spec, remote, slots[spec.device], peer)
                for spec, remote in zip(ref.manifest.regions, ref.regions, strict=True)
                if spec.nbytes
            ]
            t = timed("  post READs, no notification (CPU: CMA copies here)", t)
            await cons.claim(ref, entry.claimed(ref.token))  # the read's claim: no round trip here
            await cons.reader._wait_all(handles, time.monotonic() + 30)
            t = timed("  wait for DONE", t)
            cons.reader.releases.send(ref, peer.name)
            for h in handles:
                consumer.agent.release(h)  # type: ignore[union-attr]
            t = timed("  notify release", t)
            timed("READ (critical path)", critical)
            steps.setdefault("wake-ups per hop (count)", []).append(float(cons.wakeups - wakeups))
            unpack(ref.manifest, {k: s.view for k, s in slots.items()}, copy=False)
            t = timed("unpack", t)
            consumer.pools.release_all(slots)  # type: ignore[union-attr]
            t = timed("release slot", t)
            timed("get total (parsed ref → held, released)", got)
            timed("hop (put start → held, released)", begin)
            await stream.ack(entry.id)  # untimed, as a stage acknowledges after handing its output on
        for i in range(args.hops + WARMUP):
            ref = (await producer.put(f"g{i}", payload)).ref
            await hand_off(ref)  # type: ignore[arg-type]
            (entry,) = await stream.read(1, block_ms=1000)
            t = time.perf_counter()
            ref = refs.validate_json(entry.fields["ref"])
            async with consumer.get(ref, None, key=f"g{i}", claimed=entry.claimed(ref.token)):  # type: ignore[union-attr]
                pass
            timed("connector.get (whole, as a stage calls it, with the parse)", t)
            await stream.ack(entry.id)
        tg.cancel_scope.cancel()
    await stream.aclose()
    await producer.aclose()
    await consumer.aclose()
    return {name: values[WARMUP:] for name, values in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=359_024)
    parser.add_argument("--hops", type=int, default=400)
    parser.add_argument("--progress-delay-us", type=int, default=1000)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configure_logging(fmt="json", level="warning", service="bench-breakdown")
    steps = anyio.run(run, args)
    print(f"$ python {' '.join(sys.argv)}\n")
    title = f"step ({args.bytes:,} bytes, progress delay {args.progress_delay_us} µs)"
    print_steps(title, steps, unit="ms", q=99, digits=3)


if __name__ == "__main__":
    main()
