"""The faults a soak injects, when, and how: real signals to real processes, and Redis restarts.

A :class:`FaultPlan` is drawn from a seeded RNG (the seed is printed, so a run can be repeated): each
fault gets a kind and a random moment in the run window.  :class:`Injector` carries them out against a
:class:`~stageferry.chaos.cluster.Cluster`:

* ``leader_kill`` / ``follower_kill`` — SIGKILL rank 0, or a rank ≥ 1, of a random replica;
* ``producer_after_publish`` — arm the ``producer_published`` failpoint; the first producer leader
  that hands a NIXL payload on freezes right after publishing it, and is SIGKILLed there;
* ``consumer_mid_read`` — arm ``consumer_read_posted``; the first consumer leader that posts a READ
  freezes with it in flight, and is SIGKILLed there;
* ``redis_restart`` — SIGKILL the AOF Redis (as a crash would) and start it again on the same port;
* ``empty_restart`` — SIGKILL Redis, delete its data (AOF and snapshot) and start it again empty after a
  few seconds, as a Redis without persistence (or with a lost disk) comes back; which requests it had
  then, and in which state, is kept (:attr:`Injector.wiped`) for the audit's accounting;
* ``stall`` — SIGSTOP a random leader for longer than the visibility timeout, then SIGCONT it;
* ``primary_kill`` / ``sentinel_failover`` / ``primary_cut`` — behind Sentinel only: move the master
  under the running pipeline (:mod:`.failover`, which also measures each failover).
* ``hostile_client`` — push what a client user can still push at everyone's intake
  (:mod:`stageferry.chaos.hostile`): an oversized item, junk, stage fields, another job's id.
"""

from __future__ import annotations

import contextlib
import enum
import random
import shutil
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import redis as sync_redis
import structlog

from stageferry import failpoints
from stageferry.chaos import failover
from stageferry.chaos.cluster import Cluster, Replica
from stageferry.chaos.hostile import hostile_client
from stageferry.procs import send

log = structlog.get_logger(__name__)


class FaultKind(enum.StrEnum):
    LEADER_KILL = "leader_kill"
    FOLLOWER_KILL = "follower_kill"
    PRODUCER_AFTER_PUBLISH = "producer_after_publish"
    CONSUMER_MID_READ = "consumer_mid_read"
    REDIS_RESTART = "redis_restart"
    EMPTY_RESTART = "empty_restart"
    STALL = "stall"
    HOSTILE_CLIENT = "hostile_client"
    PRIMARY_KILL = "primary_kill"
    SENTINEL_FAILOVER = "sentinel_failover"
    PRIMARY_CUT = "primary_cut"


#: The faults that need a Sentinel group (``Cluster(sentinel=True)``).
#: How long an empty restart pauses the server's writes at most while it reads what it will wipe (the kill
#: follows at once; the paused clients see their connection drop and retry on the empty server).
WIPE_PAUSE_MS = 30_000

FAILOVER_KINDS = frozenset({FaultKind.PRIMARY_KILL, FaultKind.SENTINEL_FAILOVER, FaultKind.PRIMARY_CUT})


_FAILPOINT_OF = {
    FaultKind.PRODUCER_AFTER_PUBLISH: failpoints.PRODUCER_PUBLISHED,
    FaultKind.CONSUMER_MID_READ: failpoints.CONSUMER_READ_POSTED,
}


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    kind: FaultKind


@dataclass(frozen=True, slots=True)
class FaultPlan:
    seed: int
    faults: tuple[Fault, ...]

    @classmethod
    def draw(cls, seed: int, counts: dict[FaultKind, int], *, window_s: float, start_s: float = 3.0) -> FaultPlan:
        """``counts[kind]`` faults of each kind at uniformly random moments in ``[start_s, window_s]``."""
        rng = random.Random(seed)
        faults = [
            Fault(round(rng.uniform(start_s, max(start_s, window_s)), 2), kind)
            for kind, n in counts.items()
            for _ in range(n)
        ]
        return cls(seed=seed, faults=tuple(sorted(faults, key=lambda f: f.at_s)))


@dataclass
class FaultLog:
    """What was injected (by kind) and what was *missed*: a fault that came due but had nothing to hit —
    no group fully up to kill or stop, nobody reaching its failpoint within the wait, Redis already down
    for another restart — so the run did not test it (:attr:`misses` says which and why)."""

    injected: Counter[str] = field(default_factory=Counter)
    missed: Counter[str] = field(default_factory=Counter)
    lines: list[str] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)

    def note(self, fault: Fault, started: float, ok: bool, detail: str) -> None:
        kind = fault.kind
        (self.injected if ok else self.missed)[kind.value] += 1
        if not ok:
            self.misses.append(f"{kind.value} at {fault.at_s:.1f}s: {detail}")
        took = time.monotonic() - started - fault.at_s
        self.lines.append(f"{fault.at_s:7.1f}s {kind.value:<24} {'ok  ' if ok else 'miss'} {detail} (+{took:.1f}s)")
        log.info("chaos.fault", kind=kind.value, injected=ok, detail=detail)


class Injector:
    """Carries out a plan against a cluster; the RNG for targets is seeded from the plan too."""

    def __init__(
        self,
        cluster: Cluster,
        plan: FaultPlan,
        *,
        stall_s: float,
        failpoint_wait_s: float = 45.0,
        max_entry_bytes: int = 1 << 20,
    ):
        self.cluster = cluster
        self.max_entry_bytes = max_entry_bytes
        self.plan = plan
        self.stall_s = stall_s
        self.failpoint_wait_s = failpoint_wait_s
        self.rng = random.Random(plan.seed + 1)
        self.log = FaultLog()
        self._stopped: set[int] = set()
        #: Each failover fault's measurements, in the order they ran.
        self.failovers: list[failover.Failover] = []
        self._one_failover = anyio.Lock()  # the group settles between two failovers
        #: Request id → its state (``submitted``: only the client's marker) when an empty restart wiped it;
        #: the first wipe of an id counts.
        self.wiped: dict[str, str] = {}

    async def run(self, started: float) -> None:
        """Inject every fault at its moment (relative to ``started``, a ``time.monotonic()``)."""
        try:
            async with anyio.create_task_group() as tg:  # each at its own moment, even while a stall lasts
                for fault in self.plan.faults:
                    tg.start_soon(self._one, fault, started)
        finally:
            self.resume_all()

    async def _one(self, fault: Fault, started: float) -> None:
        delay = started + fault.at_s - time.monotonic()
        if delay > 0:
            await anyio.sleep(delay)
        ok, detail = await self.inject(fault.kind)
        self.log.note(fault, started, ok, detail)

    async def inject(self, kind: FaultKind) -> tuple[bool, str]:
        if kind in FAILOVER_KINDS:
            return await self._failover(kind)
        if kind is FaultKind.REDIS_RESTART:
            return await self._restart_redis()
        if kind is FaultKind.EMPTY_RESTART:
            return await self._restart_redis_empty()
        if kind in _FAILPOINT_OF:
            return await self._at_failpoint(_FAILPOINT_OF[kind])
        if kind is FaultKind.STALL:
            return await self._stall()
        if kind is FaultKind.HOSTILE_CLIENT:
            return await hostile_client(self.cluster, max_entry_bytes=self.max_entry_bytes)
        return await self._kill_rank(follower=kind is FaultKind.FOLLOWER_KILL)

    async def _pick(self, *, follower: bool) -> tuple[Replica, int, int] | None:
        """A random (replica, rank, pid) whose group is fully up — a leader, or a follower rank — waiting
        (bounded) while groups restart after earlier faults."""
        deadline = time.monotonic() + self.failpoint_wait_s
        while time.monotonic() < deadline:
            targets = []
            for replica in self.cluster.replicas:
                ranks = replica.ranks()
                if len(ranks) == replica.tp:
                    targets += [(replica, r, pid) for r, pid in sorted(ranks.items()) if (r >= 1) == follower]
            if targets:
                return self.rng.choice(targets)
            await anyio.sleep(0.2)
        return None

    async def _kill_rank(self, *, follower: bool) -> tuple[bool, str]:
        target = await self._pick(follower=follower)
        if target is None:
            return False, "no live target"
        replica, rank, pid = target
        ok = send(pid, signal.SIGKILL)
        return ok, f"{replica.consumer} rank {rank} pid {pid}"

    async def _at_failpoint(self, name: str) -> tuple[bool, str]:
        directory = self.cluster.failpoint_dir
        failpoints.arm(directory, name, hold_s=self.failpoint_wait_s + 30)
        deadline = time.monotonic() + self.failpoint_wait_s
        while time.monotonic() < deadline:
            pids = failpoints.hits(directory, name)
            if pids:
                for pid in pids:
                    send(pid, signal.SIGKILL)
                return True, f"pid {pids[0]} at {name}"
            await anyio.sleep(0.05)
        failpoints.disarm(directory, name)
        for pid in failpoints.hits(directory, name):  # reached just as we gave up
            send(pid, signal.SIGKILL)
            return True, f"pid {pid} at {name}"
        return False, f"nobody reached {name} in {self.failpoint_wait_s}s"

    async def _restart_redis(self) -> tuple[bool, str]:
        if not self.cluster.redis.running:
            return False, "Redis is down already (another restart)"
        await self.cluster.redis.kill()
        await anyio.sleep(self.rng.uniform(0.2, 1.5))
        await self.cluster.redis.start()
        self.cluster.redis_restarts += 1
        return True, f"SIGKILL + restart on port {self.cluster.redis.port} (AOF)"

    async def _failover(self, kind: FaultKind) -> tuple[bool, str]:
        group = self.cluster.group
        if group is None:
            return False, "no Sentinel group (run the soak with --sentinel)"
        async with self._one_failover:
            try:
                done = await failover.inject(
                    group, kind.value, prefix=self.cluster.prefix, settle_s=self.failpoint_wait_s,
                    rng_pause=self.rng.uniform(0.2, 1.5),
                )  # fmt: skip
            except TimeoutError as exc:
                return False, str(exc)
        self.failovers.append(done)
        detail = f"master {done.old_port} -> {done.new_port}, first write after {done.first_write_s:.2f}s"
        if done.stale is not None:
            st = done.stale
            refused = "never" if st.refused_after_s is None else f"{st.refused_after_s:.1f}s"
            detail += (
                f"; stale writer: {st.accepted} taken, {len(st.acknowledged)} acknowledged"
                f" ({st.lost_acknowledged} of them lost), NOREPLICAS after {refused}"
            )
        return True, detail

    async def _restart_redis_empty(self) -> tuple[bool, str]:
        redis = self.cluster.redis
        if not redis.running:
            return False, "Redis is down already (another restart)"
        try:
            seen = await anyio.to_thread.run_sync(self._requests_now)
        except sync_redis.RedisError as exc:
            return False, f"could not read the requests before the wipe: {exc}"
        await redis.kill()
        assert redis.data_dir is not None
        for path in (redis.data_dir / "appendonlydir", *redis.data_dir.glob("*.rdb")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        down_s = self.rng.uniform(1.0, 5.0)
        await anyio.sleep(down_s)
        await redis.start()
        self.cluster.redis_restarts += 1
        for rid, state in seen.items():
            self.wiped.setdefault(rid, state)
        return True, f"SIGKILL, data deleted, restart empty after {down_s:.1f}s ({len(seen)} requests wiped)"

    def _requests_now(self) -> dict[str, str]:
        """Every request Redis knows now (a record, or only a client's marker), with its state — and will
        know until it is killed: writes are paused first (``CLIENT PAUSE … WRITE``; reads go on), so a
        submission acknowledged between this read and the kill cannot escape the wipe's accounting.  The
        pause ends with the server (or here, if the read fails)."""
        keys = self.cluster.keys
        client = self.cluster.client()
        client.client_pause(WIPE_PAUSE_MS, all=False)
        try:
            out: dict[str, str] = {}
            for pattern, state_of in ((keys.submitted("*"), None), (keys.request("*"), "state")):
                stem = pattern[:-1]
                for raw in client.scan_iter(match=pattern, count=1000):
                    key = raw.decode(errors="replace")
                    rid = key[len(stem) :]
                    state = client.hget(key, state_of) if state_of else None
                    out[rid] = state.decode() if state else out.get(rid, "submitted")
            return out
        except sync_redis.RedisError:
            with contextlib.suppress(sync_redis.RedisError):
                client.client_unpause()
            raise
        finally:
            client.close()

    async def _stall(self) -> tuple[bool, str]:
        target = await self._pick(follower=False)
        if target is None:
            return False, "no live leader"
        replica, _rank, pid = target
        if not send(pid, signal.SIGSTOP):
            return False, f"{replica.consumer} leader gone"
        self._stopped.add(pid)
        try:
            await anyio.sleep(self.stall_s)
        finally:
            send(pid, signal.SIGCONT)
            self._stopped.discard(pid)
        return True, f"{replica.consumer} leader pid {pid} stopped {self.stall_s:.1f}s"

    def resume_all(self) -> None:
        for pid in list(self._stopped):
            send(pid, signal.SIGCONT)
        self._stopped.clear()
        for name in failpoints.POINTS:
            failpoints.disarm(self.cluster.failpoint_dir, name)
            for pid in failpoints.hits(self.cluster.failpoint_dir, name):
                send(pid, signal.SIGKILL)
