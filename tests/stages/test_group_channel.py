"""Headers of a stage group's messages ride the payload's group, in one broadcast, never a gloo round trip.

Two real rank processes (gloo).  To see which group a header takes, the channel gets two *different*
gloo groups over the same ranks: the ``cpu`` one (what a GPU group uses for media and CPU regions) and
the ``device`` one (NCCL's place on GPUs).  Each rank counts the broadcasts it took part in per group,
and the follower checks it received exactly what the leader sent: a header that fits the frame, one
that does not (its tail follows), media, and payload regions — the first of a shape in its own
broadcast, the next ones inline in the frame (its size announced by the previous header), a larger
shape on its own again, then inline.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stageferry.broker.data.payload_codec import pack_into, plan_payload, unpack
from stageferry.embedded_redis import free_port
from stageferry.schemas import DeviceKind
from stageferry.stages.group import pack_payload
from stageferry.stages.group_channel import FRAME_BYTES, GroupChannel, MessageKind

pytestmark = pytest.mark.timeout(120)

BIG = "x" * (FRAME_BYTES * 3 + 17)  # a header three frames long


def _payload(n: int = 1000, seed: int = 0) -> dict[str, torch.Tensor]:
    return {"text": torch.arange(n, dtype=torch.float32) + seed, "ids": torch.arange(7, dtype=torch.int64) - seed}


#: Payload messages after the first: (step, size, seed); same shape twice, a larger one twice.
MORE = [("inline", 1000, 1), ("larger", 5000, 2), ("larger inline", 5000, 3)]


def _rank(rank: int, port: int, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        cpu, device = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        channel = GroupChannel(rank=rank, world_size=2, device=torch.device("cpu"), cpu_group=cpu, device_group=device)
        plan = plan_payload(_payload())
        steps: list[tuple[str, dict[str, int]]] = []
        if rank == 0:
            region = torch.empty(plan.manifest.total_bytes, dtype=torch.uint8)
            pack_into(plan, {DeviceKind.CPU: region})
            channel.send(MessageKind.JOB, {"request_id": "r1", "job": "{}"})
            steps.append(("small", channel.collectives()))
            channel.send(MessageKind.JOB, {"request_id": "r2", "job": BIG})
            steps.append(("big", channel.collectives()))
            channel.send(MessageKind.JOB, {"request_id": "r3"}, media={"ref": b"\x00media\xff"})
            steps.append(("media", channel.collectives()))
            channel.send(
                MessageKind.JOB, {"request_id": "r4"}, manifest=plan.manifest, buffers={DeviceKind.CPU: region}
            )
            steps.append(("payload", channel.collectives()))
            for name, n, seed in MORE:
                manifest, buffers = pack_payload(_payload(n, seed))
                channel.send(MessageKind.JOB, {"request_id": name}, manifest=manifest, buffers=buffers)
                steps.append((name, channel.collectives()))
            channel.send(MessageKind.STOP)
            out.put(("leader", steps))
        else:
            got = []
            for name in ("small", "big", "media", "payload", *(m[0] for m in MORE)):
                message = channel.receive()
                steps.append((name, channel.collectives()))
                got.append(message)
            stop = channel.receive()
            small, big, media, payload, *more = got
            assert payload.manifest is not None
            held = unpack(payload.manifest, payload.buffers, copy=False)
            exact = []
            for message, (_, n, seed) in zip(more, MORE, strict=True):
                assert message.manifest is not None
                rebuilt = unpack(message.manifest, message.buffers, copy=False)
                exact.append(all(torch.equal(rebuilt[k], v) for k, v in _payload(n, seed).items()))
            out.put(
                (
                    "follower",
                    steps,
                    small.header["request_id"],
                    big.header["job"] == BIG,
                    media.media,
                    all(torch.equal(held[k], v) for k, v in _payload().items()) and all(exact),
                    stop.kind.value,
                )
            )
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def test_headers_take_one_broadcast_on_the_device_group_and_none_on_gloo() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        item = out.get(timeout=100)
        assert item[0] != "error", item[2]
        results[item[0]] = item
    for p in procs:
        p.join(30)
    _, leader = results["leader"]
    _, follower, request_id, big_ok, media, payload_ok, stop = results["follower"]
    # Both sides took part in the same broadcasts, step by step.
    assert leader == follower
    steps = dict(leader)
    # A header that fits: one broadcast, on the device group; nothing on the cpu (gloo) group.
    assert steps["small"] == {"cpu": 0, "device": 1}
    # A header longer than the frame: the frame, then one broadcast for its tail.
    assert steps["big"] == {"cpu": 0, "device": 3}
    # Media bytes (sizes in the header) ride gloo: one broadcast per item.
    assert steps["media"] == {"cpu": 1, "device": 4}
    # A CPU payload region rides gloo; its header still does not.
    assert steps["payload"] == {"cpu": 2, "device": 5}
    # The same shape again: inline in the frame the last header announced — one broadcast, none on gloo.
    assert steps["inline"] == {"cpu": 2, "device": 6}
    # A larger shape does not fit that frame: its own broadcast; the next one of that shape is inline.
    assert steps["larger"] == {"cpu": 3, "device": 7}
    assert steps["larger inline"] == {"cpu": 3, "device": 8}
    assert request_id == "r1" and big_ok and media == {"ref": b"\x00media\xff"} and payload_ok
    assert stop == "stop"


def test_a_buffer_shorter_than_its_region_is_refused_before_any_broadcast() -> None:
    """A short buffer would broadcast fewer bytes than followers wait for (NCCL then hangs)."""
    channel = GroupChannel(rank=0, world_size=2, device=torch.device("cpu"), cpu_group=None, device_group=None)
    plan = plan_payload({"blob": torch.zeros(359_024, dtype=torch.uint8)})  # region padded to 359,040
    with pytest.raises(ValueError, match="region of 359040"):
        channel.send(
            MessageKind.JOB,
            {},
            manifest=plan.manifest,
            buffers={DeviceKind.CPU: torch.zeros(359_024, dtype=torch.uint8)},
        )
    assert channel.collectives() == {"cpu": 0, "device": 0}
