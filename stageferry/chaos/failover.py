"""The failover faults of a soak behind Sentinel, and what each one measured.

* ``primary_kill`` — SIGKILL the master; the killed node is started again a moment later (an
  orchestrator's restart) and rejoins as a replica;
* ``sentinel_failover`` — ``SENTINEL FAILOVER``: the master hands over to a replica;
* ``primary_cut`` — the master's port cut off (its packets dropped) from everyone but one *stale writer*,
  which keeps writing to it as a client stuck on the wrong side of a partition would.  The sentinels
  elect a new master; the old one, without replicas for ``min-replicas-max-lag``, must start refusing
  writes (``NOREPLICAS``), and of what it took meanwhile nothing was acknowledged by ``WAIT`` — it is
  thrown away when the old master rejoins as a replica, and no acknowledged write is.

Each fault waits for a settled group first (every node up, the replicas linked), and records the failover
time: from the fault to the first write that succeeds on the new master, through a fresh client that
asks the sentinels (the clients of the pipeline find the new master by themselves).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import anyio
import hiredis
import redis as sync_redis
import structlog

from stageferry.chaos.sentinels import SentinelGroup, sync_client

log = structlog.get_logger(__name__)

#: The loopback address the stale writer sends from (the cut spares it).
STALE_SOURCE = "127.0.0.2"


@dataclass
class StaleWrites:
    """What the stale writer saw on the cut-off master: writes taken, acknowledged, refused."""

    accepted: int = 0
    acknowledged: list[str] = field(default_factory=list)  # keys WAIT said a replica had
    refused_after_s: float | None = None  # cut → the first NOREPLICAS
    lost_acknowledged: int = 0  # acknowledged, yet not on the new master afterwards (must be 0)


@dataclass
class Failover:
    kind: str
    started: float  # time.monotonic() of the fault
    first_write_s: float  # fault → the first successful write on the new master
    old_port: int
    new_port: int
    stale: StaleWrites | None = None

    @property
    def window(self) -> tuple[float, float]:
        return self.started, self.started + self.first_write_s


async def first_write(
    group: SentinelGroup, old_port: int, started: float, *, key: str, timeout: float
) -> tuple[float, int]:
    """Seconds from ``started`` until a write succeeds on a master other than ``old_port``; its port."""
    deadline = started + timeout
    while time.monotonic() < deadline:
        port = await anyio.to_thread.run_sync(_write_once, group, old_port, key)
        if port is not None:
            return time.monotonic() - started, port
        await anyio.sleep(0.01)
    raise TimeoutError(f"no write succeeded on a new master within {timeout:.0f}s")


def _write_once(group: SentinelGroup, old_port: int, key: str) -> int | None:
    try:
        client = sync_client(group.url(), socket_timeout=1, retries=0)
        try:
            client.set(key, str(time.time()), ex=120)
            port = int(client.connection_pool.get_master_address()[1])  # type: ignore[attr-defined]
        finally:
            client.close()
    except (sync_redis.RedisError, OSError):
        return None
    return port if port != old_port else None


async def inject(group: SentinelGroup, kind: str, *, prefix: str, settle_s: float, rng_pause: float) -> Failover:
    """Carry out one failover fault (after the group settles) and measure it."""
    await group.wait_settled(timeout=settle_s)
    probe = f"{prefix}:chaos-probe"
    if kind == "primary_kill":
        started = time.monotonic()
        old = (await group.kill_primary()).port
        took, new = await first_write(group, old, started, key=probe, timeout=settle_s)
        await anyio.sleep(rng_pause)
        await group.heal()  # the orchestrator restarts it: it comes back a replica
        return Failover(kind, started, took, old, new)
    if kind == "sentinel_failover":
        started = time.monotonic()
        old = await anyio.to_thread.run_sync(group.failover)
        took, new = await first_write(group, old, started, key=probe, timeout=settle_s)
        return Failover(kind, started, took, old, new)
    if kind == "primary_cut":
        return await _cut(group, prefix=prefix, settle_s=settle_s)
    raise ValueError(f"not a failover fault: {kind}")


async def _cut(group: SentinelGroup, *, prefix: str, settle_s: float) -> Failover:
    stale = StaleWrites()
    stop = threading.Event()
    started = time.monotonic()
    old = await anyio.to_thread.run_sync(lambda: group.cut_primary(spare=STALE_SOURCE))
    writer = threading.Thread(target=_stale_writer, args=(old, prefix, started, stale, stop), daemon=True)
    writer.start()
    try:
        took, new = await first_write(group, old, started, key=f"{prefix}:chaos-probe", timeout=settle_s)
        deadline = time.monotonic() + group.max_lag_s + settle_s
        while stale.refused_after_s is None and time.monotonic() < deadline:  # noqa: ASYNC110 (a thread sets it)
            await anyio.sleep(0.05)
    finally:
        stop.set()
        await anyio.to_thread.run_sync(writer.join, 10)
        group.restore_primary()
    await group.heal()
    await group.wait_settled(timeout=settle_s)
    stale.lost_acknowledged = await anyio.to_thread.run_sync(_missing, group, stale.acknowledged)
    log.info("chaos.stale_writes", accepted=stale.accepted, acknowledged=len(stale.acknowledged),
             refused_after_s=stale.refused_after_s, lost_acknowledged=stale.lost_acknowledged)  # fmt: skip
    return Failover("primary_cut", started, took, old, new, stale)


def _stale_writer(port: int, prefix: str, started: float, out: StaleWrites, stop: threading.Event) -> None:
    """Write to the cut-off master as a client on its side of the partition would: ``SET`` then ``WAIT 1``."""
    i = 0
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1, source_address=(STALE_SOURCE, 0)) as sock:
                reader = hiredis.Reader()
                while not stop.is_set():
                    key = f"{prefix}:chaos-stale:{i}"
                    sock.sendall(f"SET {key} 1 EX 120\r\nWAIT 1 100\r\n".encode())
                    set_reply, acked = _replies(sock, reader, 2)
                    i += 1
                    if isinstance(set_reply, hiredis.ReplyError):
                        if "NOREPLICAS" in str(set_reply) and out.refused_after_s is None:
                            out.refused_after_s = time.monotonic() - started
                    else:
                        out.accepted += 1
                        if isinstance(acked, int) and acked >= 1:
                            out.acknowledged.append(key)
                    stop.wait(0.05)
        except OSError:
            stop.wait(0.1)


def _replies(sock: socket.socket, reader: hiredis.Reader, n: int) -> list[object]:
    out: list[object] = []
    while len(out) < n:
        reply = reader.gets()
        if reply is False:
            data = sock.recv(65536)
            if not data:
                raise OSError("closed")
            reader.feed(data)
            continue
        out.append(reply)
    return out


def _missing(group: SentinelGroup, keys: list[str]) -> int:
    if not keys:
        return 0
    with group.node_client(group.primary()) as client:
        return sum(1 for key in keys if not client.exists(key))


__all__ = ["STALE_SOURCE", "Failover", "StaleWrites", "first_write", "inject"]
