"""A stage group's header mailbox: the leader's message headers to its followers through host shared memory.

Why: on a GPU group a header that rides the device broadcast costs an upload on the leader and a download
plus an event wait on every follower before it can be read — ≈ 0.1 ms of torch calls per job on the
2 × H200 host (``benchmarks/fanout_phases.py``), as long as the broadcast of a T2VA payload itself.  Every
rank of a group runs on one host (the supervisor starts them all; :meth:`GroupChannel.link` checks it and
falls back to the frame path otherwise), so the header can be plain bytes in memory every rank maps.

Layout of the file (little-endian)::

    0     magic "SFMBOX01", version u32, slots u32, slot bytes u32, readers u32, token (16 bytes)
    64    reader acks: one u64 per rank, a cache line each (the last sequence number that rank read)
    ...   slots, each ``slot bytes`` long: seq u64, length u32, flags u32, crc32 u32, pad, then the bytes

The leader writes a slot's bytes, then its length, flags and checksum, then its sequence number; a reader
takes a slot when its sequence number is the one it expects *and* the checksum matches (so a reader that
sees the number before the bytes — a weakly ordered CPU — just reads again), then acks it.  The leader
reuses a slot only once every reader acked the message it held.  Never pickle: the bytes are the channel's
msgpack header, checked there like any header from the leader.

Names and cleanup: the leader creates ``/dev/shm/stageferry-gc-<pid namespace>-<pid>-<n>-<random>``
(0600, exclusive), the followers map it during the group's handshake, and the leader unlinks it as soon as
they did: the mappings live on, and no file is left behind whatever happens to the processes later.  A
leader killed *during* the handshake leaves its file; the next leader created in the same pid namespace
removes every such file whose creator is gone (:func:`reclaim`).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
PREFIX = "stageferry-gc-"
MAGIC = b"SFMBOX01"
VERSION = 1
SLOTS = 16
SLOT_BYTES = 64 << 10
_SLOT_HEAD = struct.Struct("<QIII")  # seq, length, flags, crc
_SLOT_DATA = 32  # a slot's bytes start here
_META = struct.Struct("<8sIIII16s")
_ACKS = 64
_LINE = 64
_U64 = struct.Struct("<Q")
#: A slot flag: the header was too long for a slot; ``length`` bytes of it follow over the device group.
LONG = 1
#: How a reader waits (as :class:`stageferry.stages.group.frames.Staging` does): spin, then poll, then block.
SPIN_S = 0.002
POLL_S = 0.0001
POLL_FOR_S = 1.0
#: How long the leader waits for a slot every reader has read before it calls the group broken.
ACK_TIMEOUT_S = 300.0
_serial = itertools.count()
_NAME_BYTES = 256  # the handshake's fixed-size record: name length, name, token


class MailboxError(RuntimeError):
    """The mailbox cannot be used (not on this host, wrong file) or a reader stopped reading; a
    ``RuntimeError`` so a stage group treats it like a failed collective."""


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def reclaim(directory: Path | None = None) -> list[str]:
    """Remove mailboxes of this pid namespace whose creator is dead (a leader killed mid-handshake)."""
    directory = SHM_DIR if directory is None else directory
    removed = []
    mine = f"{PREFIX}{_pid_namespace()}-"
    for path in directory.glob(mine + "*"):
        try:
            pid = int(path.name[len(mine) :].split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
            continue  # alive (or a reused pid: the file then simply stays)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path.name)
    return removed


class Mailbox:
    """One group's mapped mailbox, as the leader (:meth:`create`) or a follower (:meth:`attach`) sees it."""

    def __init__(self, path: Path, mm: mmap.mmap, token: bytes, *, rank: int, readers: int, slots: int) -> None:
        self.path = path
        self.token = token
        self._mm = mm
        self._view = memoryview(mm)
        self._rank = rank
        self._readers = readers
        self._slots = slots
        self._base = -(-(_ACKS + _LINE * readers) // 4096) * 4096
        self._seq = 0  # the leader's last sent / a follower's last read
        self._acked = 0  # the leader's known minimum over its readers' acks

    # ------------------------------------------------------------------ setup

    @classmethod
    def create(cls, readers: int, *, directory: Path | None = None, slots: int = SLOTS) -> Mailbox:
        """The leader's new mailbox for ranks ``0 .. readers - 1`` (rank 0 itself writes)."""
        directory = SHM_DIR if directory is None else directory
        reclaim(directory)
        token = secrets.token_bytes(16)
        path = directory / f"{PREFIX}{_pid_namespace()}-{os.getpid()}-{next(_serial)}-{token[:4].hex()}"
        base = -(-(_ACKS + _LINE * readers) // 4096) * 4096
        size = base + slots * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        _META.pack_into(mm, 0, MAGIC, VERSION, slots, SLOT_BYTES, readers, token)
        return cls(path, mm, token, rank=0, readers=readers, slots=slots)

    @classmethod
    def attach(cls, name: str, token: bytes, *, rank: int, directory: Path | None = None) -> Mailbox:
        """A follower's mapping of the leader's mailbox; :class:`MailboxError` unless it is the very
        file the leader made (same token): a follower on another host finds no such file."""
        if "/" in name or not name.startswith(PREFIX):
            raise MailboxError(f"not a mailbox name: {name!r}")
        path = (SHM_DIR if directory is None else directory) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise MailboxError(f"cannot open the group's mailbox {name}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < _META.size:
                raise MailboxError(f"mailbox {name} is {size} bytes")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, slots, slot_bytes, readers, stored = _META.unpack_from(mm, 0)
        base = -(-(_ACKS + _LINE * readers) // 4096) * 4096
        ok = (magic, version, slot_bytes, stored) == (MAGIC, VERSION, SLOT_BYTES, token)
        if not ok or not 0 < rank < readers or not 0 < slots <= 1 << 16 or size != base + slots * SLOT_BYTES:
            mm.close()
            raise MailboxError(f"{name} is not this group's mailbox")
        return cls(path, mm, token, rank=rank, readers=readers, slots=slots)

    def unlink(self) -> None:
        """Remove the name (the leader, once every follower mapped it); the mappings stay valid."""
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._view.release()
        self._mm.close()

    @property
    def capacity(self) -> int:
        """The longest header a slot holds."""
        return SLOT_BYTES - _SLOT_DATA

    # ------------------------------------------------------------------ leader

    def post(self, data: bytes, *, flags: int = 0, length: int | None = None) -> None:
        """Write the next message (``data``, or with :data:`LONG` only its ``length``) into its slot."""
        seq = self._seq + 1
        if seq - self._slots > self._acked:
            self._wait_acks(seq - self._slots)
        n = len(data)
        if n > self.capacity:
            raise ValueError(f"header of {n} bytes in a {self.capacity}-byte slot")
        off = self._base + (seq % self._slots) * SLOT_BYTES
        self._view[off + _SLOT_DATA : off + _SLOT_DATA + n] = data
        size = n if length is None else length
        crc = _crc(seq, size, flags, data)
        _SLOT_HEAD.pack_into(self._mm, off, 0, size, flags, crc)
        _U64.pack_into(self._mm, off, seq)  # last: the slot is now the reader's
        self._seq = seq

    def _wait_acks(self, needed: int) -> None:
        started = time.perf_counter()
        while True:
            self._acked = min(_U64.unpack_from(self._mm, _ACKS + _LINE * r)[0] for r in range(1, self._readers))
            if self._acked >= needed:
                return
            waited = time.perf_counter() - started
            if waited > ACK_TIMEOUT_S:
                raise MailboxError(f"a follower has not read message {needed} for {waited:.0f} s")
            if waited > SPIN_S:
                time.sleep(POLL_S)

    # ------------------------------------------------------------------ followers

    def take(self, block: Callable[[], None] | None = None) -> tuple[bytes, int, int]:
        """The next message: ``(bytes, flags, length)``.  Spins for :data:`SPIN_S`, polls every
        :data:`POLL_S` until :data:`POLL_FOR_S`, then calls ``block`` once (a GPU follower waits there for
        the broadcast that follows the header, so an idle follower sleeps in the driver) and polls on."""
        seq = self._seq + 1
        off = self._base + (seq % self._slots) * SLOT_BYTES
        started = time.perf_counter()
        blocked = block is None
        while True:
            got = self._read(seq, off)
            if got is not None:
                self._seq = seq
                _U64.pack_into(self._mm, _ACKS + _LINE * self._rank, seq)
                return got
            waited = time.perf_counter() - started
            if waited >= POLL_FOR_S and not blocked:
                assert block is not None
                block()
                blocked = True
            elif waited >= SPIN_S:
                time.sleep(POLL_S)

    def _read(self, seq: int, off: int) -> tuple[bytes, int, int] | None:
        stored, size, flags, crc = _SLOT_HEAD.unpack_from(self._mm, off)
        if stored != seq:
            if stored > seq:
                raise MailboxError(f"mailbox slot holds message {stored}, expected {seq}: a reader fell behind")
            return None
        n = size if not flags & LONG else 0
        if n > self.capacity:
            return None  # not all written yet (or corrupt: the checksum decides below on a re-read)
        data = self._view[off + _SLOT_DATA : off + _SLOT_DATA + n].tobytes()
        if _crc(seq, size, flags, data) != crc:
            return None
        return data, flags, size


def _crc(seq: int, size: int, flags: int, data: bytes) -> int:
    return zlib.crc32(struct.pack("<QII", seq, size, flags), zlib.crc32(data))


def handshake(rank: int, world_size: int, group: Any) -> Mailbox | None:
    """Every rank of a group (collective over its gloo ``group``): this rank's mailbox, or ``None`` on
    every rank unless every follower mapped the leader's.

    The leader creates it and broadcasts its name and token (a fixed-size record, never pickle); each
    follower maps it and checks the token — a follower on another host finds no such file — and one
    all-reduce agrees.  The leader then unlinks the name: from here on nothing is left in ``/dev/shm``."""
    record = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    box: Mailbox | None = None
    if rank == 0:
        try:
            box = Mailbox.create(world_size)
        except OSError:
            box = None  # no /dev/shm here
        else:
            named = bytes([len(box.path.name)]) + box.path.name.encode() + box.token
            record[: len(named)] = torch.frombuffer(bytearray(named), dtype=torch.uint8)
    dist.broadcast(record, src=0, group=group)
    raw = record.numpy().tobytes()
    if rank != 0 and raw[0]:
        n = raw[0]
        try:
            box = Mailbox.attach(raw[1 : 1 + n].decode("ascii"), raw[1 + n : 17 + n], rank=rank)
        except (MailboxError, UnicodeDecodeError):
            box = None
    flag = torch.tensor([1 if box is not None else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if box is None:
        return None
    if rank == 0:
        box.unlink()
    if not flag.item():
        box.close()
        return None
    return box
