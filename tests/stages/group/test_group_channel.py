"""Headers of a stage group's messages ride the payload's group, in one broadcast, never a gloo round trip.

Two real rank processes (gloo).  To see which group a header takes, the channel gets two *different*
gloo groups over the same ranks: the ``cpu`` one (what a GPU group uses for media and CPU regions) and
the ``device`` one (NCCL's place on GPUs).  Each rank counts the broadcasts it took part in per group,
and the follower checks it received exactly what the leader sent: a header that fits the frame, one
that does not (its tail follows), media, and payload regions — the first of a shape in its own
broadcast, the next ones inline in the frame (its size announced by the previous header), a larger
shape on its own again, then inline, then inline once more — into the frame it kept, with the payload's
views handed out afresh.  Over gloo always; over NCCL (CUDA payloads, the frames on the GPUs) where two
GPUs are present.  Both with headers in the group's mailbox (:mod:`stageferry.stages.group.mailbox`; the frame
is then a *carrier* with no head) and without (frames carry them).
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
from stageferry.stages.group.group import pack_payload
from stageferry.stages.group.group_channel import FRAME_BYTES, GroupChannel, MessageKind

pytestmark = pytest.mark.timeout(120)

BIG = "x" * (FRAME_BYTES * 3 + 17)  # a header three frames long


def _payload(n: int = 1000, seed: int = 0, on: torch.device | None = None) -> dict[str, torch.Tensor]:
    return {
        "text": torch.arange(n, dtype=torch.float32, device=on) + seed,
        "ids": torch.arange(7, dtype=torch.int64, device=on) - seed,
    }


#: Payload messages after the first: (step, size, seed); same shape twice, a larger one three times.
MORE = [("inline", 1000, 1), ("larger", 5000, 2), ("larger inline", 5000, 3), ("kept frame", 5000, 4)]


def _rank(rank: int, port: int, backend: str, mailbox: bool, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            on = torch.device("cuda", rank)
            torch.cuda.set_device(on)
            dist.init_process_group("nccl", rank=rank, world_size=2, device_id=on)
            cpu, device = dist.new_group(backend="gloo"), dist.group.WORLD
        else:
            on = torch.device("cpu")
            dist.init_process_group("gloo", rank=rank, world_size=2)
            cpu, device = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
        channel = GroupChannel(rank=rank, world_size=2, device=on, cpu_group=cpu, device_group=device, mailbox=mailbox)
        kind = DeviceKind.CUDA if on.type == "cuda" else DeviceKind.CPU
        plan = plan_payload(_payload(on=on))
        steps: list[tuple[str, dict[str, int]]] = []
        if rank == 0:
            region = torch.empty(plan.manifest.total_bytes, dtype=torch.uint8, device=on)
            pack_into(plan, {kind: region})
            channel.send(MessageKind.JOB, {"request_id": "r1", "job": "{}"})
            steps.append(("small", channel.collectives()))
            channel.send(MessageKind.JOB, {"request_id": "r2", "job": BIG})
            steps.append(("big", channel.collectives()))
            channel.send(MessageKind.JOB, {"request_id": "r3"}, media={"ref": b"\x00media\xff"})
            steps.append(("media", channel.collectives()))
            channel.send(MessageKind.JOB, {"request_id": "r4"}, manifest=plan.manifest, buffers={kind: region})
            steps.append(("payload", channel.collectives()))
            for name, n, seed in MORE:
                manifest, buffers = pack_payload(_payload(n, seed, on))
                channel.send(MessageKind.JOB, {"request_id": name}, manifest=manifest, buffers=buffers)
                steps.append((name, channel.collectives()))
            channel.send(MessageKind.STOP)
            out.put(("leader", steps, channel.uses_mailbox))
        else:
            got, exact = [], []
            held: Any = None
            for name in ("small", "big", "media", "payload", *(m[0] for m in MORE)):
                message = channel.receive()
                steps.append((name, channel.collectives()))
                got.append(message)
                # Checked on arrival: an inline payload holds until the next receive (the frame is kept).
                if name == "payload":
                    assert message.manifest is not None
                    rebuilt = unpack(message.manifest, message.buffers, copy=False)
                    exact.append(all(torch.equal(rebuilt[k], v) for k, v in _payload(on=on).items()))
                    exact.append(all(torch.equal(message.payload[k], v) for k, v in _payload(on=on).items()))
                for step, n, seed in MORE:
                    if step == name:
                        exact.append(all(torch.equal(message.payload[k], v) for k, v in _payload(n, seed, on).items()))
                if name == "kept frame":  # same frame, same bytes as the last one's; views and dicts anew
                    same = message.payload["text"].data_ptr() == held["text"].data_ptr()
                    shape = tuple(message.payload["text"].shape)
                    exact.append(
                        same and message.payload is not held and shape == (5000,) and "extra" not in message.payload
                    )
                    exact.append(message.buffers[kind].data_ptr() == got[-2].buffers[kind].data_ptr())
                if name == "larger inline":
                    held = message.payload
                    held["text"].unsqueeze_(0)  # a model editing its input's shape in place
                    held["extra"] = None
            stop = channel.receive()
            small, big, media, *_ = got
            out.put(
                (
                    "follower",
                    steps,
                    small.header["request_id"],
                    big.header["job"] == BIG,
                    media.media,
                    exact,
                    stop.kind.value,
                    channel.uses_mailbox,
                )
            )
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


#: Broadcasts after each step, by group.  On gloo a CPU region rides the ``cpu`` group; on NCCL a CUDA
#: region rides the device group (frames and regions alike), and only media take gloo.
EXPECTED = {
    ("gloo", False): {
        "small": {"cpu": 0, "device": 1},
        "big": {"cpu": 0, "device": 3},
        "media": {"cpu": 1, "device": 4},
        "payload": {"cpu": 2, "device": 5},
        "inline": {"cpu": 2, "device": 6},
        "larger": {"cpu": 3, "device": 7},
        "larger inline": {"cpu": 3, "device": 8},
        "kept frame": {"cpu": 3, "device": 9},
    },
    ("nccl", False): {
        "small": {"cpu": 0, "device": 1},
        "big": {"cpu": 0, "device": 3},
        "media": {"cpu": 1, "device": 4},
        "payload": {"cpu": 1, "device": 6},
        "inline": {"cpu": 1, "device": 7},
        "larger": {"cpu": 1, "device": 9},
        "larger inline": {"cpu": 1, "device": 10},
        "kept frame": {"cpu": 1, "device": 11},
    },
    # Headers by mailbox: no broadcast for a long header's tail (it fits a slot); every message still
    # takes one carrier broadcast, which a region of the announced size rides with no copy.
    ("gloo", True): {
        "small": {"cpu": 0, "device": 1},
        "big": {"cpu": 0, "device": 2},
        "media": {"cpu": 1, "device": 3},
        "payload": {"cpu": 2, "device": 4},
        "inline": {"cpu": 2, "device": 5},
        "larger": {"cpu": 3, "device": 6},
        "larger inline": {"cpu": 3, "device": 7},
        "kept frame": {"cpu": 3, "device": 8},
    },
    ("nccl", True): {
        "small": {"cpu": 0, "device": 1},
        "big": {"cpu": 0, "device": 2},
        "media": {"cpu": 1, "device": 3},
        "payload": {"cpu": 1, "device": 5},
        "inline": {"cpu": 1, "device": 6},
        "larger": {"cpu": 1, "device": 8},
        "larger inline": {"cpu": 1, "device": 9},
        "kept frame": {"cpu": 1, "device": 10},
    },
}


@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
            ),
        ),
    ],
)
@pytest.mark.parametrize("mailbox", [True, False], ids=["mailbox", "frames"])
def test_headers_take_one_broadcast_on_the_device_group_and_none_on_gloo(backend: str, mailbox: bool) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, backend, mailbox, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        item = out.get(timeout=100)
        assert item[0] != "error", item[2]
        results[item[0]] = item
    for p in procs:
        p.join(30)
    _, leader, leader_mailbox = results["leader"]
    _, follower, request_id, big_ok, media, exact, stop, follower_mailbox = results["follower"]
    assert leader_mailbox == follower_mailbox == mailbox
    # Both sides took part in the same broadcasts, step by step.
    assert leader == follower
    # A header that fits: one broadcast, on the device group; nothing on the cpu (gloo) group.  A header
    # longer than the frame: the frame, then one broadcast for its tail.  Media bytes (sizes in the
    # header) ride gloo, one broadcast each.  The first payload of a shape: the frame, then its region;
    # the same shape again: inline in the frame the last header announced — one broadcast, none on gloo;
    # a larger shape does not fit that frame: its own broadcast, and the next ones of that shape inline.
    assert dict(leader) == EXPECTED[backend, mailbox]
    # Every payload arrived bit-exact; the kept frame's third payload reused the frame, in fresh views.
    assert request_id == "r1" and big_ok and media == {"ref": b"\x00media\xff"}
    assert exact == [True] * 8
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
