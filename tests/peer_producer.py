"""A producer leader in its own process, for data-plane tests: puts payloads, serves their leases.

``python -m tests.peer_producer --redis-url URL --prefix P --payloads T2VA,FL2VA,bytes:1000 [...]``
puts each payload through a real :class:`NixlConnector` and RPUSHes ``{"key", "ref", "blob"}`` (JSON,
blob base64) to ``<P>:test:refs``; then it keeps serving (notifications, leases, resends) and writes
its resource counters to the hash ``<P>:test:producer`` until ``<P>:test:stop`` exists.  With
``--hold NAME`` it puts nothing until ``<P>:test:<NAME>`` exists (its record is published meanwhile).
"""

from __future__ import annotations

import argparse
import base64
import json
import os

import anyio
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.config import DataPlaneConfig, MetadataMode, Timeouts
from stageferry.errors import DataPlaneError
from stageferry.testing import TASKS, on_device, sized_payload


def build(spec: str, seed: int, device: str = "cpu") -> object:
    """The payload a spec names: a task payload, ``bytes:N``, ``mixed`` (CUDA and CPU leaves), or
    ``gpu:<spec>`` (that payload with every tensor on ``device``)."""
    if spec.startswith("gpu:"):
        return on_device(build(spec.removeprefix("gpu:"), seed), device)
    if spec.startswith("bytes:"):
        return sized_payload(int(spec.split(":", 1)[1]), seed=seed)
    if spec == "mixed":
        fl2va = TASKS["FL2VA"][0]()
        return {
            "gpu": fl2va["visual_latents"]["first_last"].to(device),
            "cpu": fl2va["text"],
            "empty_gpu": torch.empty(0, 3, device=device),
            "ids": torch.arange(9, device=device),
        }
    return TASKS[spec][0]()


async def main(args: argparse.Namespace) -> None:
    keys = Keys(args.prefix)
    config = DataPlaneConfig(
        metadata_mode=MetadataMode(args.mode),
        nixl_backends=tuple(args.backends.split(",")),
        cpu_pool_bytes=args.pool_mib << 20,
        inline_fallback_max_bytes=args.fallback_cap,
    )
    timeouts = Timeouts(lease=args.lease, claim=args.claim, pool_wait=60.0)  # tests never fall back on a slow CI
    async with open_client(args.redis_url) as redis:
        cuda = torch.device(args.device) if args.device.startswith("cuda") else None
        if cuda is not None:
            torch.cuda.set_device(cuda)
        conn = NixlConnector(
            redis=redis, keys=keys, stage="encoder", replica="peer", config=config, timeouts=timeouts, cuda_device=cuda
        )
        conn.open()
        async with anyio.create_task_group() as tg:
            await tg.start(conn.run)
            while args.hold and not await redis.exists(f"{args.prefix}:test:{args.hold}"):
                await anyio.sleep(0.02)
            specs = args.payloads.split(",") * args.repeat
            for i, spec in enumerate(specs):
                key = f"video_sync-peer{i}_0_0"
                try:
                    out = await conn.put(key, build(spec, i, args.device))
                    item = {
                        "key": key,
                        "spec": spec,
                        "seed": i,
                        "ref": out.ref.model_dump_json(),
                        "blob": base64.b64encode(out.blob).decode() if out.blob is not None else None,
                    }
                except DataPlaneError as exc:
                    item = {"key": key, "spec": spec, "seed": i, "error": exc.code}
                await redis.rpush(f"{args.prefix}:test:refs", json.dumps(item))
            while not await redis.exists(f"{args.prefix}:test:stop"):
                agent = conn.agent
                stats = {
                    "pid": os.getpid(),
                    "leases": len(conn.leases),
                    "puts": conn.counters.puts,
                    "slots_in_use": conn.pools.slots_in_use if conn.pools else 0,
                    "registrations": agent.registrations if agent else 0,
                    "open_handles": agent.open_handles() if agent else 0,
                    "unavailable": conn.unavailable_reason or "",
                }
                await redis.hset(f"{args.prefix}:test:producer", mapping=stats)
                await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        await conn.aclose()


if __name__ == "__main__":
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--payloads", default="T2VA")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--mode", default="queried")
    parser.add_argument("--backends", default="UCX")
    parser.add_argument("--pool-mib", type=int, default=256)
    parser.add_argument("--fallback-cap", type=int, default=16 << 20)
    parser.add_argument("--lease", type=float, default=60.0)
    parser.add_argument("--claim", type=float, default=30.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hold", default="")
    anyio.run(main, parser.parse_args())
