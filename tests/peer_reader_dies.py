"""A consumer leader that claims a payload and is SIGKILLed right after the claim or right after posting
the NIXL READ (on CPU, UCX may finish a READ inside the post call, so 'post' can also mean 'done')."""

from __future__ import annotations

import argparse
import json
import os
import signal

import anyio
from pydantic import TypeAdapter

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.broker.data.nixl.consumer import mem_kind_of
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.schemas import NixlPayload, PayloadRef
from stageferry.schemas.nixl import release_notification


async def main(args: argparse.Namespace) -> None:
    async with open_client(args.redis_url) as redis:
        conn = NixlConnector(
            redis=redis,
            keys=Keys(args.prefix),
            stage="diffusion",
            replica="doomed",
            config=DataPlaneConfig(),
            timeouts=Timeouts(claim=8),
        )
        conn.open()
        item = json.loads((await redis.blpop([f"{args.prefix}:test:refs"], timeout=60))[1])
        ref = TypeAdapter(PayloadRef).validate_json(item["ref"])
        assert isinstance(ref, NixlPayload)
        peer = await conn.peers.ensure(ref)
        await conn.consumer.claim(ref)
        if args.die_after == "claim":
            os.kill(os.getpid(), signal.SIGKILL)  # claimed, READ not yet posted
        slots = await conn.pools.acquire_regions(ref.manifest, timeout=5)  # type: ignore[union-attr]
        spec, remote = ref.manifest.regions[0], ref.regions[0]
        local = slots[spec.device]
        conn.agent.start_read(  # type: ignore[union-attr]
            [(local.address, spec.nbytes, local.device_id)],
            mem_kind_of(spec.device),
            [(remote.address, remote.length, remote.device_id)],
            remote.mem_kind,
            peer.name,
            release_notification(ref.token),
        )
        os.kill(os.getpid(), signal.SIGKILL)  # mid-READ: posted, not completed, nothing cleaned up


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--die-after", choices=["claim", "post"], default="post")
    anyio.run(main, parser.parse_args())
