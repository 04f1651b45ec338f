"""The Python work of one NIXL hop that is the same for every payload of one shape, step by step.

    python benchmarks/hop_python.py                 # T2VA payload, 2,000 rounds
    python benchmarks/hop_python.py --task FL2VA

A diagnostic for issue 20's "the hop's fixed cost": no Redis, no NIXL transfer, nothing that waits, so
the medians are the CPU time the put and the get spend in our own code (and pydantic's and torch's) per
hop.  Each round runs the steps in hop order on fresh objects, as a stage does: the producer plans and
packs the payload into a pool slot, leases it (:meth:`Producer.lease`: token, seal, the envelope's
:class:`NixlPayload`) and serialises the ref as the envelope does; the consumer parses that JSON, validates
the manifest and the descriptors (the seal included), takes a slot, unpacks and releases.  The producer's
lease table and pool are real (the pool is not registered with NIXL); the lease is freed after each round.
Medians after 200 warm-up rounds.  Run it against two trees (``PYTHONPATH``) alternately to compare.
"""

from __future__ import annotations

import argparse
import hmac
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import torch  # noqa: E402
from bench_stats import print_steps  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from transfer import on_device  # noqa: E402

from stageferry.broker.control.keys import Keys  # noqa: E402
from stageferry.broker.data.inline import InlineConnector  # noqa: E402
from stageferry.broker.data.nixl.endpoint import Endpoint  # noqa: E402
from stageferry.broker.data.nixl.leases import LeaseTable, check_fresh  # noqa: E402
from stageferry.broker.data.nixl.producer import Producer  # noqa: E402
from stageferry.broker.data.nixl.staged_outputs import Stagings  # noqa: E402
from stageferry.broker.data.payload_codec import (  # noqa: E402
    pack_into,
    plan_payload,
    unpack,
    validate_manifest,
    validate_remote_regions,
)
from stageferry.broker.data.pool import MemoryPool, PoolSet  # noqa: E402
from stageferry.config import DataPlaneConfig, Timeouts  # noqa: E402
from stageferry.logs import configure_logging  # noqa: E402
from stageferry.schemas import DeviceKind, PayloadRef  # noqa: E402
from stageferry.schemas.nixl import lease_seal  # noqa: E402
from stageferry.testing import TASKS  # noqa: E402

WARMUP = 200
MAX_PAYLOAD = 1 << 30


def endpoint(name: str, device: torch.device) -> Endpoint:
    kind = DeviceKind.CUDA if device.type == "cuda" else DeviceKind.CPU
    pools = PoolSet({kind: MemoryPool(kind, 256 << 20, device=device, registrar=None)})
    return Endpoint(
        redis=None,  # type: ignore[arg-type]  # nothing here talks to Redis
        keys=Keys("hop-python"),
        stage=name,
        name=f"{name}-bench-00000000",
        incarnation="0000000000000000",
        seal_key=b"k" * 32,
        config=DataPlaneConfig(max_payload_bytes=MAX_PAYLOAD),
        timeouts=Timeouts(),
        inline=InlineConnector(max_bytes=MAX_PAYLOAD, max_payload_bytes=MAX_PAYLOAD, cuda_device=None),
        agent=object(),  # type: ignore[arg-type]  # lease() only asserts one is there (queried metadata)
        pools=pools,
    )


async def run(task: str, rounds: int, device: torch.device, gap_s: float, spin: bool) -> dict[str, list[float]]:
    payload = on_device(TASKS[task][0](), device)
    prod_ep, cons_ep = endpoint("p", device), endpoint("c", device)
    leases = LeaseTable(prod_ep)
    producer = Producer(prod_ep, leases, Stagings(prod_ep))
    assert prod_ep.pools is not None and cons_ep.pools is not None
    arenas = prod_ep.pools.arenas()
    adapter: TypeAdapter[Any] = TypeAdapter(PayloadRef)
    steps: dict[str, list[float]] = {}
    clock = time.perf_counter

    def timed(name: str, started: float) -> float:
        now = clock()
        steps.setdefault(name, []).append((now - started) * 1e6)
        return now

    for i in range(rounds + WARMUP):
        if gap_s and spin:
            until = clock() + gap_s  # idle, but awake (spinning)
            while clock() < until:
                pass
        elif gap_s:
            time.sleep(gap_s)  # noqa: ASYNC251 - idle, as a stage is between hops (its loop blocked in epoll)
        t = first = clock()
        plan = plan_payload(payload)
        t = timed("put: plan", t)
        put_slots = await prod_ep.pools.acquire_regions(plan.manifest, timeout=1.0)
        t = timed("put: take slot", t)
        pack_into(plan, {k: s.view for k, s in put_slots.items()})
        t = timed("put: pack (copy)", t)
        ref = producer.lease(f"k{i}", plan.manifest, put_slots)
        t = timed("put: lease (token, seal, NixlPayload)", t)
        raw = ref.model_dump_json()
        t = timed("envelope: ref to JSON (producer)", t)
        timed("producer total", first)
        t = second = clock()
        got = adapter.validate_json(raw)
        t = timed("envelope: ref from JSON (consumer)", t)
        validate_manifest(got.manifest, max_payload_bytes=MAX_PAYLOAD)
        t = timed("get: validate manifest", t)
        validate_remote_regions(got.manifest, got.regions, arenas)
        if not hmac.compare_digest(got.seal, lease_seal(prod_ep.seal_key, got.agent, got.token, got.regions)):
            raise SystemExit("seal mismatch")
        check_fresh(got)
        t = timed("get: descriptor + seal checks", t)
        mine = await cons_ep.pools.acquire_regions(got.manifest, timeout=1.0)
        t = timed("get: acquire slot", t)
        unpack(got.manifest, {k: s.view for k, s in mine.items()}, copy=False)
        t = timed("get: unpack (views)", t)
        cons_ep.pools.release_all(mine)
        t = timed("get: release slot", t)
        timed("consumer total", second)
        leases.free(ref.token, reason="bench")
    return {name: values[WARMUP:] for name, values in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="T2VA", choices=sorted(TASKS))
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="pools and payload on cuda:0")
    parser.add_argument("--gap-us", type=int, default=0, help="sleep this long before each round (idle between hops)")
    parser.add_argument("--gap-spin", action="store_true", help="spend the gap spinning instead of sleeping")
    args = parser.parse_args()
    torch.set_num_threads(1)
    configure_logging(fmt="json", level="warning", service="bench-hop-python")
    steps = anyio.run(run, args.task, args.rounds, torch.device(args.device), args.gap_us / 1e6, args.gap_spin)
    print(f"$ python {' '.join(sys.argv)}\n")
    gap = f"gap {args.gap_us} µs" + (" spinning" if args.gap_spin else "")
    title = f"step ({args.task}, {TASKS[args.task][1]:,} bytes, {args.device}, {gap})"
    print_steps(title, steps, unit="µs", q=90, digits=1)


if __name__ == "__main__":
    main()
