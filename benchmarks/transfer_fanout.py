"""``benchmarks/transfer.py``'s consumer TP group (``--tp``): the leader fans each payload out to its
follower ranks over gloo and waits for every rank, as a stage group's leader does (split out of it)."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from stageferry.broker.data.payload_codec import pack_into, plan_payload


def follower_main(rank: int, world: int, port: int) -> None:
    """A follower rank: receive every payload the leader fans out, then meet at the barrier."""
    import torch.distributed as dist

    from stageferry.stages.group.group_channel import GroupChannel, MessageKind

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    channel = GroupChannel(
        rank=rank, world_size=world, device=torch.device("cpu"), cpu_group=dist.group.WORLD, device_group=None
    )
    while channel.receive().kind is not MessageKind.STOP:
        dist.barrier()
    dist.destroy_process_group()


class FanOut:
    """The consumer leader's TP group (gloo, CPU): broadcast what the leader holds, wait for every rank."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from stageferry.embedded_redis import free_port
        from stageferry.stages.group.group_channel import GroupChannel

        self.world = world
        self.dist = dist
        self.lock = threading.Lock()  # one broadcast at a time: concurrent gets (section 4) share the group
        self.procs: list[Any] = []
        if world == 1:
            self.channel = None
            return
        port = free_port()
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, args=(r, world, port)) for r in range(1, world)]
        for p in self.procs:
            p.start()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=world)
        self.channel = GroupChannel(
            rank=0, world_size=world, device=torch.device("cpu"), cpu_group=dist.group.WORLD, device_group=None
        )

    def send(self, incoming: Any) -> None:
        """Fan the payload out from its landing buffers (a NIXL slot) or packed once (inline)."""
        from stageferry.stages.group.group_channel import MessageKind

        if self.channel is None:
            return
        manifest, regions = incoming.manifest, incoming.regions
        if manifest is None or regions is None:
            plan = plan_payload(incoming.payload)
            regions = {r.device: torch.empty(r.nbytes, dtype=torch.uint8) for r in plan.manifest.regions}
            pack_into(plan, regions)
            manifest = plan.manifest
        regions = {k: v.cpu() for k, v in regions.items()}  # gloo: the CPU fan-out this benchmark measures
        with self.lock:
            self.channel.send(MessageKind.JOB, {}, manifest=manifest, buffers=regions)
            self.dist.barrier()

    def close(self) -> None:
        from stageferry.stages.group.group_channel import MessageKind

        if self.channel is not None:
            self.channel.send(MessageKind.STOP, {})
            self.dist.destroy_process_group()
        for p in self.procs:
            p.join(30)
