"""A stage group's header mailbox (host shared memory): order, wrap-around, long headers, late and
missing followers, and no file left in ``/dev/shm`` — after a clean stop and after a SIGKILLed leader.

Mapped twice in one process (the same file, two mappings) for the ring's rules; real rank processes over
gloo for the channel's use of it.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stageferry.embedded_redis import free_port
from stageferry.stages.group import mailbox
from stageferry.stages.group.group import pack_payload
from stageferry.stages.group.group_channel import GroupChannel, MessageKind
from stageferry.stages.group.mailbox import LONG, SLOTS, Mailbox, MailboxError, reclaim

pytestmark = pytest.mark.timeout(120)


def _ours(directory: Path = mailbox.SHM_DIR) -> set[str]:
    return {p.name for p in directory.glob(mailbox.PREFIX + "*")}


def _made_by(names: Any, pids: list[int]) -> set[str]:
    """The mailbox files among ``names`` that these processes created (their names carry the creator's
    pid): other tests, on another pytest worker, may have theirs in /dev/shm meanwhile."""
    return {n for n in names if any(f"-{pid}-" in n for pid in pids)}


def test_messages_arrive_in_order_across_many_wraps_of_the_ring(tmp_path: Path) -> None:
    leader = Mailbox.create(3, directory=tmp_path)
    one = Mailbox.attach(leader.path.name, leader.token, rank=1, directory=tmp_path)
    two = Mailbox.attach(leader.path.name, leader.token, rank=2, directory=tmp_path)
    sent = [os.urandom(n) for n in (0, 1, 300, leader.capacity, *range(5, 5 * 5 * SLOTS, 5))]
    got: dict[int, list[bytes]] = {1: [], 2: []}
    for i, data in enumerate(sent):
        leader.post(data)
        if i % 3 == 0:  # the readers lag behind by a few messages, never by a whole ring
            for rank, reader in ((1, one), (2, two)):
                while len(got[rank]) <= i:
                    got[rank].append(reader.take()[0])
    for rank, reader in ((1, one), (2, two)):
        while len(got[rank]) < len(sent):
            got[rank].append(reader.take()[0])
    assert got[1] == sent and got[2] == sent
    assert len(sent) > 4 * SLOTS


def test_the_leader_never_overwrites_a_slot_a_reader_has_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mailbox, "ACK_TIMEOUT_S", 0.05)
    leader = Mailbox.create(3, directory=tmp_path)
    one = Mailbox.attach(leader.path.name, leader.token, rank=1, directory=tmp_path)
    Mailbox.attach(leader.path.name, leader.token, rank=2, directory=tmp_path)  # attached, never reads
    for i in range(SLOTS):
        leader.post(b"m%d" % i)
    with pytest.raises(MailboxError, match="has not read message 1"):
        leader.post(b"one too many")
    assert [one.take()[0] for _ in range(SLOTS)] == [b"m%d" % i for i in range(SLOTS)]


def test_a_reader_attaching_after_the_first_posts_reads_them_all(tmp_path: Path) -> None:
    leader = Mailbox.create(2, directory=tmp_path)
    for i in range(5):
        leader.post(b"early %d" % i)
    late = Mailbox.attach(leader.path.name, leader.token, rank=1, directory=tmp_path)
    assert [late.take()[0] for _ in range(5)] == [b"early %d" % i for i in range(5)]


def test_a_header_longer_than_a_slot_is_refused_or_announced_as_long(tmp_path: Path) -> None:
    leader = Mailbox.create(2, directory=tmp_path)
    reader = Mailbox.attach(leader.path.name, leader.token, rank=1, directory=tmp_path)
    with pytest.raises(ValueError, match="slot"):
        leader.post(b"x" * (leader.capacity + 1))
    leader.post(b"", flags=LONG, length=10 << 20)
    assert reader.take() == (b"", LONG, 10 << 20)


def test_a_wrong_token_or_name_is_not_this_groups_mailbox(tmp_path: Path) -> None:
    leader = Mailbox.create(2, directory=tmp_path)
    with pytest.raises(MailboxError, match="not this group's"):
        Mailbox.attach(leader.path.name, b"\x00" * 16, rank=1, directory=tmp_path)
    with pytest.raises(MailboxError, match="not a mailbox name"):
        Mailbox.attach("../etc/passwd", leader.token, rank=1, directory=tmp_path)
    with pytest.raises(MailboxError, match="cannot open"):
        Mailbox.attach(leader.path.name, leader.token, rank=1, directory=tmp_path / "another-host")
    with pytest.raises(MailboxError, match="not this group's"):
        Mailbox.attach(leader.path.name, leader.token, rank=2, directory=tmp_path)  # no such reader


def _create_and_die(directory: str) -> None:
    Mailbox.create(2, directory=Path(directory))
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_sigkilled_leaders_mailbox_is_reclaimed_by_the_next_one(tmp_path: Path) -> None:
    child = mp.get_context("spawn").Process(target=_create_and_die, args=(str(tmp_path),))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    (left,) = _ours(tmp_path)
    assert f"-{child.pid}-" in left
    alive = Mailbox.create(2, directory=tmp_path)  # reclaims the dead one's, keeps its own
    assert _ours(tmp_path) == {alive.path.name}
    assert reclaim(tmp_path) == []  # a live creator's file stays
    alive.unlink()
    assert _ours(tmp_path) == set()


# ---------------------------------------------------------------------- real ranks


LONG_JOB = "j" * (100 << 10)  # longer than a slot: the header's bytes follow the carrier


def _rank(rank: int, port: int, elsewhere: str, out: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if elsewhere and rank == 1:  # this follower looks in another directory: as if on another host
            mailbox.SHM_DIR = Path(elsewhere)
        dist.init_process_group("gloo", rank=rank, world_size=2)
        group = dist.group.WORLD
        channel = GroupChannel(rank=rank, world_size=2, device=torch.device("cpu"), cpu_group=group, device_group=group)
        manifest, buffers = pack_payload({"x": torch.arange(2000, dtype=torch.int32)})
        if rank == 0:
            channel.send(MessageKind.NOOP)
            out.put(("linked", channel.uses_mailbox, sorted(_ours())))
            channel.send(MessageKind.JOB, {"job": LONG_JOB}, manifest=manifest, buffers=buffers)
            for i in range(3 * SLOTS):  # far more than a ring while the follower sleeps
                channel.send(MessageKind.FAIL, {"i": i})
            channel.send(MessageKind.JOB, {"job": "short"}, manifest=manifest, buffers=buffers)
            channel.send(MessageKind.STOP)
            out.put(("leader", channel.collectives()))
        else:
            first = channel.receive()
            time.sleep(1.0)  # a slow follower: the leader waits for its slots, nothing is overwritten
            expected = torch.arange(2000, dtype=torch.int32)
            long = channel.receive()
            exact = [torch.equal(long.payload["x"], expected)]
            fails = [channel.receive().header["i"] for _ in range(3 * SLOTS)]
            short = channel.receive()
            exact.append(torch.equal(short.payload["x"], expected))  # a carrier's payload: until the next receive
            stop = channel.receive()
            out.put(
                (
                    "follower",
                    channel.uses_mailbox,
                    first.kind.value,
                    long.header["job"] == LONG_JOB,
                    fails,
                    short.header["job"],
                    exact,
                    stop.kind.value,
                    channel.collectives(),
                )
            )
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))


def _run(elsewhere: str) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, elsewhere, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(3):
        item = out.get(timeout=100)
        assert item[0] != "error", item[2]
        results[item[0]] = item
    for p in procs:
        p.join(30)
    results["pids"] = [p.pid for p in procs]
    return results


def test_a_group_sends_headers_by_mailbox_and_leaves_nothing_in_dev_shm() -> None:
    results = _run("")
    pids = results["pids"]
    _, used, linked_files = results["linked"]
    _, follower_used, first, long_ok, fails, short, exact, stop, follower_calls = results["follower"]
    assert used and follower_used
    # Unlinked as soon as the follower mapped it: nothing of this group's in /dev/shm even while it runs.
    assert _made_by(linked_files, pids) == set()
    assert first == "noop" and long_ok and fails == list(range(3 * SLOTS)) and short == "short"
    assert exact == [True, True] and stop == "stop"
    # One carrier per message, plus the long header's bytes; the payload's region rode the carrier on the
    # second job (the first announced its size), and had its own broadcast on the first.
    messages = 1 + 1 + 3 * SLOTS + 1 + 1
    assert results["leader"][1] == follower_calls == {"cpu": 1, "device": messages + 1}
    assert _made_by(_ours(), pids) == set()


def test_a_follower_that_cannot_map_the_mailbox_makes_the_whole_group_keep_frames(tmp_path: Path) -> None:
    results = _run(str(tmp_path))
    _, used, _ = results["linked"]
    _, follower_used, first, long_ok, fails, short, exact, stop, _ = results["follower"]
    assert not used and not follower_used
    assert first == "noop" and long_ok and fails == list(range(3 * SLOTS)) and short == "short"
    assert exact == [True, True] and stop == "stop"
    assert _made_by(_ours(), results["pids"]) == set()
