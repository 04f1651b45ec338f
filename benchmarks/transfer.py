"""A payload hop between two processes: NIXL against inline through Redis Streams, side by side.

    python benchmarks/transfer.py                              # CPU: 4 KiB .. 256 MiB + the task payloads
    python benchmarks/transfer.py --device cuda --sizes ...    # GPU 0 -> GPU 1 (VRAM over NIXL vs via host + Redis)
    python benchmarks/transfer.py --tp 4                       # the consumer is a TP4 group: hop to every rank
    python benchmarks/transfer.py --json out.json              # raw series for benchmarks/chart.py
    python benchmarks/transfer.py --zero-copy                  # + the zero-copy put (model writes into the slot)

Two processes wired like two stage leaders: a producer (this script with ``--role producer``) holding a
real :class:`NixlConnector`, and the consumer (this process) with its own.  Every hop is lock-step: the
consumer asks for one payload, the producer puts it and writes the entry as a stage's hand-off does (XADD
to the stage stream and a push to its wake list, in one script), the consumer reads it as a stage does
(:meth:`StageStream.read`, whose script claims a NIXL payload's lease in the same round trip) and fetches
the payload (``get``) until it holds the tensors; the entry is acknowledged after that, untimed, as a
stage acknowledges it once it handed its output on.  Per size and iteration the paths run
interleaved: NIXL, inline through Redis, and the hardware baseline — a torch memcpy of the same bytes
(CPU) or a torch peer copy GPU 0 → GPU 1 (``--device cuda``).

* NIXL: ``NixlConnector.put`` (inline_max_bytes=0: even 4 KiB goes over NIXL), the reference in the
  entry, ``NixlConnector.get``.  On GPUs the payload lives in VRAM on both sides.
* inline: ``InlineConnector.encode`` (device → host on GPUs), the blob in the same entry, ``decode``
  (host → device on GPUs).
* zero-copy (``--zero-copy``): before the timed put, the producer asks ``NixlConnector.stage`` for the
  payload's output tensors (views of a pool slot) and the "model" writes its tensors into them — the
  model's own work, not timed; then ``put`` of those tensors copies nothing.  Same get as NIXL.

Timestamps are ``time.monotonic_ns()`` (one clock for every process on the host): ``t0`` put starts,
``t1`` put returned (XADD starts), ``t2`` the stream read returned the entry, ``t3`` the consumer leader holds the
payload, ``t4`` every rank of its TP group holds it (``--tp``).  get = t3 − t2, delivery = t3 − t1,
hop = t3 − t0, hop to all ranks = t4 − t0.

Section 4 (scaling) sends bursts of K payloads at once: K puts back to back (a full pool makes a put wait:
back-pressure), K gets in flight together; it prints hop latency, how long puts waited, peak pool
occupancy and both processes' resident memory against K.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import torch  # noqa: E402
from bench_stats import (  # noqa: E402
    TASK_BYTES,
    TASK_OF_SIZE,
    human,
    print_steps,
    rss_mib,
)  # noqa: E402
from step_timer import StepTimer, hop_steps  # noqa: E402
from transfer_fanout import FanOut  # noqa: E402
from transfer_report import ASLEEP, COLD, WARMUP, report  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.broker.control.redis_conn import connect  # noqa: E402
from stageferry.broker.control.resp_link import open_link, run_script  # noqa: E402
from stageferry.broker.control.stream_scripts import WAKE_LUA  # noqa: E402
from stageferry.broker.control.streams import LEASE_FIELD, Entry, StageStream  # noqa: E402
from stageferry.broker.data.connector_contract import Incoming  # noqa: E402
from stageferry.broker.data.inline import InlineConnector  # noqa: E402
from stageferry.broker.data.nixl.connector import NixlConnector  # noqa: E402
from stageferry.broker.data.payload_codec import plan_payload  # noqa: E402
from stageferry.broker.data.staging import write_into  # noqa: E402
from stageferry.config import DataPlaneConfig, Timeouts  # noqa: E402
from stageferry.cpus import HOT_WAIT_S  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import InlinePayload, NixlPayload, PayloadRef  # noqa: E402
from stageferry.stages.group.group import settle_heap  # noqa: E402
from stageferry.testing import TASKS, on_device, sized_payload, tensor_bytes  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = sorted([4 * KiB * 4**i for i in range(9)] + list(TASK_BYTES.values()))  # 4 KiB..256 MiB
INLINE_CAP = 1 << 30
STAGE = "bench"  #: the consumer's stage stream
#: The entry and the stage's wake-up in one script, as a stage's hand-off script writes them (KEYS: the
#: stream, the wake list; ARGV: field, value, ...).
WRITE_LUA = "redis.call('XADD', KEYS[1], '*', unpack(ARGV))\n" + WAKE_LUA


def payload_for(nbytes: int, device: torch.device) -> Any:
    """The task payload of that size, else one uint8 tensor of exactly ``nbytes``; on ``device``."""
    task = TASK_OF_SIZE.get(nbytes)
    payload = TASKS[task][0]() if task else sized_payload(nbytes)
    return on_device(payload, device)


def devices(kind: str) -> tuple[torch.device, torch.device]:
    """(producer, consumer) devices: GPU 0 → GPU 1 when there are two, else both on GPU 0."""
    if kind == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    n = torch.cuda.device_count()
    if n == 0:
        raise SystemExit("--device cuda: no GPU here")
    return torch.device("cuda", 0), torch.device("cuda", min(1, n - 1))


def connector(
    redis: Any, prefix: str, stage: str, pool_bytes: int, device: torch.device, **data_plane: Any
) -> NixlConnector:
    on_gpu = device.type == "cuda"
    config = DataPlaneConfig(
        **data_plane,
        inline_max_bytes=0,
        cpu_pool_bytes=pool_bytes if not on_gpu else 64 * MiB,
        gpu_pool_bytes=pool_bytes if on_gpu else 0,
        inline_fallback_max_bytes=256 * MiB,
        max_payload_bytes=INLINE_CAP,
    )
    conn = NixlConnector(
        redis=redis,
        keys=Keys(prefix),
        stage=stage,
        replica="bench",
        config=config,
        timeouts=Timeouts(pool_wait=120.0, lease=600.0, claim=600.0),
        cuda_device=device if on_gpu else None,
    )
    return conn


def inline_connector(device: torch.device) -> InlineConnector:
    """The benchmark's own inline path (its ``inline`` op), beside the NIXL connector on the same device."""
    on_gpu = device.type == "cuda"
    return InlineConnector(max_bytes=INLINE_CAP, max_payload_bytes=INLINE_CAP, cuda_device=device if on_gpu else None)


def bench_client(url: str) -> Any:
    """The benchmark's own traffic (commands, envelopes): a 256 MiB entry outlasts connect()'s socket timeout."""
    return aioredis.from_url(url, decode_responses=False, socket_timeout=300)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- producer process --------------------------------------------------------------------------------------


async def producer(args: argparse.Namespace) -> None:
    device, _ = devices(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    redis, bench = connect(args.redis_url), bench_client(args.redis_url)
    conn = connector(redis, args.prefix, "bench-producer", args.pool_bytes, device)
    inline = inline_connector(device)
    conn.open()
    assert conn.agent is not None and conn.pools is not None, f"producer has no NIXL agent: {conn.unavailable_reason}"
    payloads: dict[int, Any] = {}
    cmd_key, keys = f"{args.prefix}:bench:cmd", Keys(args.prefix)
    stream_key, wake_key = keys.stage_stream(STAGE), keys.wake(STAGE)
    write, link = bench.register_script(WRITE_LUA), open_link(bench)
    # The command wait stands in for a producer stage's stream wait, and is hot as that is: for
    # HOT_WAIT_S after a command comes and after its hand-off (StageStream), unless the consumer measures
    # an ASLEEP hop (its command, and the one before it, say so).  The hot wait a stage has on 8 CPUs or
    # more (stageferry.cpus), also on a smaller box: this benchmark times the hot wait itself.
    cmd_link, hot_wait = open_link(bench), HOT_WAIT_S
    links = [x for x in (link, cmd_link) if x is not None]
    timer = hop_steps("producer") if args.steps else None

    async def send(op: str, nbytes: int, i: int) -> None:
        if timer is not None:
            timer.tag = f"{op}: "
        if nbytes not in payloads:
            payloads.clear()  # one size at a time: keep memory flat
            payloads[nbytes] = payload_for(nbytes, device)
            sync(device)
        payload = payloads[nbytes]
        if op == "staged":  # the model's part, untimed: ask for the slot's tensors and write into them
            payload = write_into(await conn.stage(f"bench-{i}", payload), payload)
            sync(device)
        t0 = time.monotonic_ns()
        out = await conn.put(f"bench-{i}", payload) if op != "inline" else await inline.encode(payload)
        t1 = time.monotonic_ns()
        fields: dict[str, Any] = {
            "ref": out.ref.model_dump_json(),
            "t0": t0,
            "t1": t1,
            "registrations": conn.agent.registrations,  # type: ignore[union-attr]
            "slots": conn.pools.slots_in_use,  # type: ignore[union-attr]
            "staged": int(out.staged),
        }
        if out.blob is not None:
            fields["blob"] = out.blob
        if isinstance(out.ref, NixlPayload):
            fields[LEASE_FIELD] = out.ref.token  # claimed by the consumer's stream read
        flat = [item for pair in fields.items() for item in pair]
        # as a hand-off writes: the entry and the wake-up, in one script over the hot path's link
        await run_script(link, write, [stream_key, wake_key], flat)
        if timer is not None:
            timer.add("hand-off: the entry (JSON) and its write (one round trip)", (time.monotonic_ns() - t1) / 1e6)

    async with anyio.create_task_group() as tg:
        await tg.start(conn.run)
        if not args.no_settle:
            settle_heap()  # as a stage's leader does once start-up is done
        await bench.rpush(f"{args.prefix}:bench:ready", json.dumps({"pid": os.getpid()}))
        while True:
            if cmd_link is not None:
                item = await cmd_link.call("BLPOP", cmd_key, 1, block_s=1)
            else:
                item = await bench.blpop([cmd_key], timeout=1)
            if item is None:
                continue
            cmd = json.loads(item[1])
            if cmd["op"] == "stop":
                break
            if cmd["op"] == "steps-start" and timer is not None:
                timer.clear()
                continue
            for x in links:  # a command came: hot, as a stage's stream is after a delivery
                x.keep_hot(0.0 if cmd.get("asleep") else hot_wait)
            for j in range(cmd.get("k", 1)):  # a burst: K puts back to back
                await send(cmd["op"], cmd["nbytes"], cmd["i"] + j)
            for x in links:  # handed off: hot, as a stage's stream is after it settles an entry
                x.keep_hot(0.0 if cmd.get("cool_after") else hot_wait)
        tg.cancel_scope.cancel()
    if timer is not None:
        timer.print(f"producer steps ({args.device}; after warm-up)")
        sys.stdout.flush()
    await conn.aclose()
    for x in links:
        await x.aclose()
    await redis.aclose()
    await bench.aclose()


# -- consumer (this process) -------------------------------------------------------------------------------


class Consumer:
    def __init__(self, redis: Any, conn: NixlConnector, prefix: str, device: torch.device, fanout: FanOut) -> None:
        self.redis = redis
        self.conn = conn
        self.inline = inline_connector(device)
        self.device = device
        self.fanout = fanout
        self.cmd_key = f"{prefix}:bench:cmd"
        self.stream = StageStream(  # on the benchmark's client: a 256 MiB inline entry outlasts connect()'s timeout
            redis,
            Keys(prefix),
            STAGE,
            "bench-consumer",
            visibility_ms=600_000,
            max_entry_bytes=2 * INLINE_CAP,
            lease_claim=conn.lease_claim(),
            hot_wait_s=HOT_WAIT_S,  # as a stage's worker takes it on 8 CPUs or more
        )
        self.producer_registrations: list[int] = []
        self.timer: StepTimer | None = None
        from pydantic import TypeAdapter

        self.refs: TypeAdapter[PayloadRef] = TypeAdapter(PayloadRef)

    async def _next(self) -> tuple[int, Entry]:
        """The next new entry (a burst keeps earlier ones in hand, un-acked, while it reads on)."""
        entries: list[Entry] = []
        while not entries:
            entries = await self.stream.read(1, block_ms=1000, new_only=True)
        return time.monotonic_ns(), entries[0]

    async def _fetch(self, op: str, entry: Entry, t2: int, key: str) -> dict[str, float]:
        fields = entry.fields
        ref = self.refs.validate_json(fields["ref"])
        blob = fields.get("blob")
        ctx: AbstractAsyncContextManager[Incoming]
        if op == "inline":
            assert isinstance(ref, InlinePayload), ref
            ctx = self.inline.get(ref, blob, key=key)
        else:
            assert isinstance(ref, NixlPayload), ref
            claimed = entry.claimed(ref.token)
            assert claimed is True, f"the stream read did not claim the lease: {claimed}"
            ctx = self.conn.get(ref, blob, key=key, claimed=claimed)
        async with ctx as incoming:
            sync(self.device)  # on GPUs the inline path's host → device copy must be done to count
            t3 = time.monotonic_ns()
            assert tensor_bytes(incoming.payload) <= incoming.nbytes
            held = self.conn.pools.slots_in_use  # type: ignore[union-attr]
            if self.fanout.world > 1:
                await anyio.to_thread.run_sync(self.fanout.send, incoming)
            t4 = time.monotonic_ns()
        await self.stream.ack(entry.id)  # untimed: a stage acknowledges once its output is handed on
        self.producer_registrations.append(int(fields["registrations"]))
        t0, t1 = int(fields["t0"]), int(fields["t1"])
        staged = op.startswith("staged")
        assert staged == bool(int(fields.get("staged", b"0"))), f"{op}: the put did not take the staging"
        return {
            "put": (t1 - t0) / 1e6,
            "get": (t3 - t2) / 1e6,
            "delivery": (t3 - t1) / 1e6,
            "hop": (t3 - t0) / 1e6,
            "all_ranks": (t4 - t0) / 1e6,
            "producer_slots": float(fields["slots"]),
            "consumer_slots": float(held),
        }

    async def hop(self, op: str, nbytes: int, i: int, next_op: str | None = None) -> dict[str, float]:
        """One lock-step hop; milliseconds of put, get, delivery, hop and hop to all ranks.  Before an
        ``ASLEEP`` hop (``next_op``), the producer is told to let its links sleep after this one."""
        if self.timer is not None:
            self.timer.tag = f"{human(nbytes)} {op}: "
        sent = op
        if op == COLD:  # the zero-copy hop with no payload made ready ahead: the get takes slots and unpacks
            self.conn.consumer.ready.drop()
            sent = "staged"
        hot_wait = self.stream.hot_wait_s
        if op == ASLEEP:  # the zero-copy hop with the links sleeping while they wait (the producer's too: cmd)
            self._heat(0.0)
            sent = "staged"
        cmd = json.dumps(
            {"op": sent, "nbytes": nbytes, "i": i, "asleep": op == ASLEEP, "cool_after": next_op == ASLEEP}
        )
        link = self.stream.script_link  # hot as the stream is (a stage has no command to send: no sleep)
        await (link.call("RPUSH", self.cmd_key, cmd) if link is not None else self.redis.rpush(self.cmd_key, cmd))
        t2, entry = await self._next()
        try:
            return await self._fetch(op, entry, t2, f"bench-{i}")
        finally:
            if op == ASLEEP:  # the next hop starts hot again, as after any other (the ack was cold)
                self._heat(hot_wait)

    def _heat(self, seconds: float) -> None:
        """The stream's hot wait from now on, and its links hot for that long now (0: asleep at once)."""
        self.stream.hot_wait_s = seconds
        for link in self.stream.links:
            link.keep_hot(seconds)

    async def burst(self, nbytes: int, k: int, i0: int) -> dict[str, list[float]]:
        """K NIXL payloads in flight at once: every get starts as soon as its envelope arrives."""
        await self.redis.rpush(self.cmd_key, json.dumps({"op": "nixl", "nbytes": nbytes, "i": i0, "k": k}))
        out: dict[str, list[float]] = {}

        async def one(entry: Entry, t2: int, j: int) -> None:
            row = await self._fetch("nixl", entry, t2, f"bench-{i0 + j}")
            for name, value in row.items():
                out.setdefault(name, []).append(value)

        async with anyio.create_task_group() as tg:
            for j in range(k):
                t2, entry = await self._next()
                tg.start_soon(one, entry, t2, j)
        return out


def baseline_ms(src: torch.Tensor, dst: torch.Tensor) -> float:
    """memcpy (CPU) or peer copy (GPU 0 → GPU 1) of the same bytes, synchronised."""
    sync(src.device)
    t0 = time.perf_counter_ns()
    dst.copy_(src)
    sync(dst.device)
    return (time.perf_counter_ns() - t0) / 1e6


def pool_bytes_for(sizes: list[int]) -> int:
    return max(256 * MiB, 2 * max(sizes) + 16 * MiB)  # two slots of the largest payload fit


def start_producer(args: argparse.Namespace, prefix: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--role", "producer", "--prefix", prefix, "--device", args.device]
    cmd += ["--redis-url", args.redis_url, "--pool-bytes", str(pool_bytes_for(args.sizes))]
    cmd += ["--no-settle"] if args.no_settle else []
    cmd += ["--profile", str(args.profile)] if args.profile else []
    cmd += ["--steps"] if args.steps else []
    cmd += ["--cpus", args.cpus] if args.cpus else []
    return subprocess.Popen(cmd)


async def consumer_main(args: argparse.Namespace, prefix: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    src_dev, device = devices(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool_bytes = pool_bytes_for(args.sizes)
    redis, bench = connect(args.redis_url), bench_client(args.redis_url)
    lanes = {k: getattr(args, k) for k in ("read_lanes", "read_lane_min_bytes", "ucx_threads")}
    conn = connector(
        redis, prefix, "bench-consumer", pool_bytes, device, **{k: v for k, v in lanes.items() if v is not None}
    )
    await anyio.to_thread.run_sync(conn.open)
    assert conn.agent is not None and conn.pools is not None, f"consumer has no NIXL agent: {conn.unavailable_reason}"
    fanout = await anyio.to_thread.run_sync(FanOut, args.tp)
    results: dict[str, Any] = {"transfer": {}, "scaling": {}}
    timer = hop_steps("consumer") if args.steps else None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(conn.run)
            with anyio.fail_after(60):
                _, ready = await bench.blpop([f"{prefix}:bench:ready"], timeout=60)
            producer_pid = json.loads(ready)["pid"]
            c = Consumer(bench, conn, prefix, device, fanout)
            c.timer = timer
            await c.stream.ensure_group()
            ops: tuple[str, ...] = ("nixl", "staged", "inline") if args.zero_copy else ("nixl", "inline")
            if args.zero_copy and args.ready_cold:  # after the copy put's hop, which leaves its shape ready
                ops = ("nixl", COLD, "staged", "inline")
            if args.zero_copy and args.hot_asleep:
                ops = (*ops[:-1], ASLEEP, "inline")
            for i in range(WARMUP):  # connection set-up to the peer, allocator and code paths; not counted
                for op, nxt in zip(ops, (*ops[1:], ops[0]), strict=True):
                    await c.hop(op, args.sizes[0], i, nxt)
            if not args.no_settle:
                settle_heap()
            if timer is not None:
                timer.clear()
                await bench.rpush(f"{prefix}:bench:cmd", json.dumps({"op": "steps-start"}))
            regs_before = conn.agent.registrations
            c.producer_registrations.clear()
            reads_before = conn.counters.reads
            for nbytes in args.sizes:
                src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=src_dev)
                dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
                for i in range(WARMUP):
                    for op, nxt in zip(ops, (*ops[1:], ops[0]), strict=True):
                        await c.hop(op, nbytes, i, nxt)
                    baseline_ms(src, dst)
                row: dict[str, dict[str, list[float]]] = {op: {} for op in ops}
                row["baseline"] = {"copy": []}
                for i in range(args.iters):  # side by side: one of each per iteration
                    for op, nxt in zip(ops, (*ops[1:], ops[0]), strict=True):
                        if op == "inline" and i >= args.inline_iters:  # a 65 MB inline hop takes ~1 s
                            continue
                        for k, v in (await c.hop(op, nbytes, i, nxt)).items():
                            row[op].setdefault(k, []).append(v)
                    row["baseline"]["copy"].append(baseline_ms(src, dst))
                results["transfer"][nbytes] = row
                if timer is not None:
                    for op in [o for o in ops if o != "inline"]:
                        for step, name in (("put", "put (as the producer timed it)"), ("hop", "hop")):
                            timer.times[f"{human(nbytes)} {op}: {name}"] = row[op][step]
                        t1_to_t2 = [d - g for d, g in zip(row[op]["delivery"], row[op]["get"], strict=True)]
                        timer.times[f"{human(nbytes)} {op}: hand-off write → entry in hand"] = t1_to_t2
                del src, dst
                print(f"# measured {human(nbytes)}", file=sys.stderr, flush=True)
            results["registrations"] = {
                "consumer_added": conn.agent.registrations - regs_before,
                "requests": conn.counters.reads - reads_before,
                "producer": sorted(set(c.producer_registrations)),
            }
            for nbytes in args.scaling_sizes:
                for k in args.inflight:
                    rounds: dict[str, list[float]] = {}
                    for r in range(args.scaling_rounds):
                        for name, values in (await c.burst(nbytes, k, 1000 * r)).items():
                            rounds.setdefault(name, []).extend(values)
                    rounds["rss_producer_mib"] = [rss_mib(producer_pid)]
                    rounds["rss_consumer_mib"] = [rss_mib(os.getpid())]
                    results["scaling"].setdefault(nbytes, {})[k] = rounds
                    print(f"# scaling {human(nbytes)} K={k}", file=sys.stderr, flush=True)
            results["pool_slots"] = {n: pool_bytes // _slot_bytes(n) for n in args.scaling_sizes}
            results["ready"] = {"hits": conn.consumer.ready.hits, "made": conn.consumer.ready.made}
            if timer is not None:
                results["steps"] = dict(sorted(timer.times.items()))
            await bench.rpush(f"{prefix}:bench:cmd", json.dumps({"op": "stop"}))
            tg.cancel_scope.cancel()
    finally:
        await anyio.to_thread.run_sync(fanout.close)
        await conn.aclose()
        await c.stream.aclose()
        await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30))
        keys = [k async for k in redis.scan_iter(match=f"{prefix}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
        await bench.aclose()
    return results


def _slot_bytes(nbytes: int) -> int:
    """Pool bytes one payload of this size takes (its packed regions, aligned), for the slot count."""
    return max(1, plan_payload(payload_for(nbytes, torch.device("cpu"))).manifest.total_bytes)


# -- report ------------------------------------------------------------------------------------------------


def profiled(args: argparse.Namespace, func: Any, *call: Any) -> Any:
    """``anyio.run(func, *call)``, under cProfile with ``--profile`` (a diagnostic: it slows every hop)."""
    if not args.profile:
        return anyio.run(func, *call)
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    try:
        return profile.runcall(anyio.run, func, *call)
    finally:
        args.profile.mkdir(parents=True, exist_ok=True)
        profile.dump_stats(args.profile / f"{args.role}.prof")
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        (args.profile / f"{args.role}.txt").write_text(text.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = lambda s: sorted({int(x) for x in s.split(",") if x})  # noqa: E731
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument(
        "--inline-iters", type=int, help="iterations that also take the inline hop (default: all of --iters)"
    )
    parser.add_argument("--sizes", type=sizes, default=DEFAULT_SIZES, help="byte counts; task sizes use task payloads")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="consumer TP size (gloo fan-out from the leader)")
    parser.add_argument("--inflight", type=sizes, default=[1, 2, 4, 8, 16], help="burst sizes for section 4")
    parser.add_argument("--scaling-sizes", type=sizes, default=[TASK_BYTES["FL2VA"], TASK_BYTES["Ref2VA"]])
    parser.add_argument("--scaling-rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the raw series here (for benchmarks/chart.py)")
    parser.add_argument(
        "--zero-copy", action="store_true", help="also the zero-copy put: the model writes into the staged slot"
    )
    parser.add_argument(
        "--ready-cold",
        action="store_true",
        help="with --zero-copy: also the zero-copy hop with no payload made ready ahead (side by side)",
    )
    parser.add_argument(
        "--hot-asleep",
        action="store_true",
        help="with --zero-copy: also the zero-copy hop with both processes' links sleeping while they wait "
        "(no Timeouts.hot_wait; side by side)",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--no-settle", action="store_true", help="skip gc.freeze after start-up (to see the full-collection spike)"
    )
    parser.add_argument("--read-lanes", type=int, help="consumer's data_plane.read_lanes (default: the config's)")
    parser.add_argument("--read-lane-min-bytes", type=int, help="consumer's data_plane.read_lane_min_bytes")
    parser.add_argument("--ucx-threads", type=int, help="consumer's data_plane.ucx_threads")
    parser.add_argument(
        "--profile", type=Path, help="run both processes under cProfile; each writes <dir>/<role>.prof and .txt"
    )
    parser.add_argument(
        "--steps", action="store_true", help="time the steps of put and get in both processes (step_timer.py)"
    )
    parser.add_argument(
        "--cpus",
        help="pin the consumer and the producer to CPUs of their own, as CONSUMER/PRODUCER lists: 2,3/4,5",
    )
    parser.add_argument("--role", choices=["consumer", "producer"], default="consumer", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--pool-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.inline_iters = args.iters if args.inline_iters is None else max(1, min(args.inline_iters, args.iters))
    torch.set_num_threads(1)  # each process one thread, as a leader's data-plane work is; memcpy gets one too
    configure_logging(fmt="json", level="warning", service=f"bench-{args.role}")  # as deployed; to stderr
    if args.cpus:  # before any thread starts (UCX's, torch's): they inherit it
        mine = args.cpus.split("/")[0 if args.role == "consumer" else 1]
        os.sched_setaffinity(0, {int(c) for c in mine.split(",")})
    if args.role == "producer":
        profiled(args, producer, args)
        return 0
    print(f"$ python {' '.join(sys.argv)}\n")
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    proc = start_producer(args, prefix)
    try:
        results = profiled(args, consumer_main, args, prefix, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    ok = report(args, results, *devices(args.device), pool_bytes_for(args.sizes))
    if results.get("steps"):
        print()
        title = "consumer steps, after warm-up (and the hop's own series)"
        print_steps(title, results["steps"], unit="ms", q=99, digits=3)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
