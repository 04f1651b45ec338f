"""The group supervisor: ``stageferry serve`` starts its group's rank processes, watches them, and when a
rank dies, restarts the whole group — so a bare-metal deployment heals without an orchestrator.

A group whose rank died cannot finish its entry (a collective would hang), so every rank is stopped and
the entry is left to be reclaimed (by the restarted group, or another replica) after the visibility
timeout.  Then the group is started again, after a backoff (:class:`RestartPolicy`): 1 s, doubling up to
30 s, so that a group that dies at start-up (a broken model, a full GPU) does not spin.  The count of
restarts is *consecutive*: a group that ran for ``healthy_s`` (60 s) before dying starts over at the
first backoff.  After ``max_restarts`` consecutive restarts the supervisor gives up and exits 1, so that
whatever runs it (systemd, compose) sees a replica that cannot come up rather than a silent loop; before
it exits it puts ``gave-up`` in place of the replica's heartbeat
(:func:`~stageferry.broker.control.liveness.record_gave_up`), so ``/health`` names the replica at once.
Every death, restart and the giving up are logged (``group.rank_died``, ``group.restarting``,
``group.gave_up``).

A poison request is not a group that cannot stay up: each entry that kills the stage is dead-lettered
after ``limits.max_crashes`` deaths (:class:`~stageferry.stages.entry.entry_guard.EntryGuard`), and the leader
then tells its supervisor how many deaths were charged to it (:func:`report_settled_crashes`, one line on
a pipe the supervisor hands every rank, :data:`REPORT_FD_ENV`).  Those deaths are taken off the
consecutive count (``group.crashes_settled``): three poison jobs are three dead letters, not six deaths
in a row and a replica that gave up.

SIGTERM/SIGINT drain as before: the leader finishes its entry, then stops its followers; a supervisor
waiting out a backoff exits at once.  Ranks are started with ``PR_SET_PDEATHSIG`` (see
:func:`stageferry.stages.group.group.die_with_parent`): if the supervisor itself is killed, its ranks die too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import record_gave_up
from stageferry.broker.control.redis_conn import open_client
from stageferry.embedded_redis import free_port
from stageferry.errors import ControlPlaneError
from stageferry.procs import stop

log = structlog.get_logger(__name__)

#: How often the supervisor looks at its ranks.
POLL_S = 0.1
#: The environment variable naming (as a file descriptor) the pipe a leader reports settled crashes on.
REPORT_FD_ENV = "STAGEFERRY_SUPERVISOR_FD"
#: How long a supervisor that gives up tries to record it in Redis.
RECORD_TIMEOUT_S = 5.0
_SETTLED = b"settled"


def report_settled_crashes(crashes: int) -> None:
    """Leader side: an entry that killed the stage ``crashes`` times was dead-lettered; tell the
    supervisor (if there is one), which takes those deaths off its consecutive count.  Never blocks nor
    raises: a full or closed pipe loses the report, never the leader."""
    fd = os.environ.get(REPORT_FD_ENV, "")
    if not fd.isdigit() or crashes <= 0:
        return
    with contextlib.suppress(OSError):
        os.write(int(fd), b"%s %d\n" % (_SETTLED, crashes))  # one short write: atomic on a pipe


class _Reports:
    """The supervisor's end of the report pipe: counts the crashes its leaders settled."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._pending = b""
        self.settled = 0

    def drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.read_fd, 4096)
            except BlockingIOError:
                return
            if not chunk:
                return
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            for line in lines:
                word, _, count = line.partition(b" ")
                if word == _SETTLED and count.isdigit():
                    self.settled += int(count)

    def take(self) -> int:
        """Crashes settled since the last call."""
        self.drain()
        settled, self.settled = self.settled, 0
        return settled

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """When and how often a supervisor restarts its group."""

    #: Consecutive restarts (no healthy period in between) before giving up; 0 never restarts.
    max_restarts: int = 5
    #: First delay before a restart; doubled for each consecutive one, up to ``max_backoff_s``.
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    #: A group that ran this long before a rank died counts as healthy: the count and delay start over.
    healthy_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before consecutive restart number ``attempt`` (1, 2, ...)."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(0, attempt - 1)))


def supervise(
    stage: str,
    world_size: int,
    *,
    env: dict[str, str],
    args: tuple[str, ...] = (),
    policy: RestartPolicy | None = None,
) -> int:
    """Run ``world_size`` rank processes of ``stage`` (each ``serve stage *args``), restarting the group
    when a rank dies (see the module docstring); returns the supervisor's exit code."""
    policy = policy or RestartPolicy()
    group: list[subprocess.Popen[bytes]] = []
    draining = False

    def drain(signum: int, _frame: Any) -> None:
        nonlocal draining
        draining = True
        if group and group[0].poll() is None:
            group[0].send_signal(signal.SIGTERM)  # the leader drains, then stops the followers

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    reports = _Reports()
    try:
        return _supervise(stage, world_size, env, args, policy, group, lambda: draining, reports)
    finally:
        reports.close()


def _supervise(
    stage: str,
    world_size: int,
    env: dict[str, str],
    args: tuple[str, ...],
    policy: RestartPolicy,
    group: list[subprocess.Popen[bytes]],
    draining: Callable[[], bool],
    reports: _Reports,
) -> int:
    consecutive = 0
    generation = 0
    while True:
        generation += 1
        group[:] = _start_ranks(stage, world_size, env=env, args=args, report_fd=reports.write_fd)
        log.info(
            "group.started",
            stage=stage,
            tp=world_size,
            ranks=world_size,
            pids=[p.pid for p in group],
            generation=generation,
        )
        started = time.monotonic()
        died = _watch(group, draining, reports)
        if died is None:  # every rank exited after a drain
            return 0 if all(p.returncode == 0 for p in group) else 1
        failed, exited = died
        ran_s = time.monotonic() - started
        log.error("group.rank_died", stage=stage, failed=failed, exited=exited, ran_s=round(ran_s, 1))
        _stop_all(group)
        if draining():
            return 1
        if ran_s >= policy.healthy_s:
            consecutive = 0
        settled = reports.take()
        if settled and consecutive:
            log.info("group.crashes_settled", stage=stage, crashes=settled, consecutive=max(0, consecutive - settled))
            consecutive = max(0, consecutive - settled)
        consecutive += 1
        if consecutive > policy.max_restarts:
            log.error("group.gave_up", stage=stage, restarts=consecutive - 1, max_restarts=policy.max_restarts)
            _record_gave_up(stage, env)
            return 1
        delay = policy.delay(consecutive)
        log.warning("group.restarting", stage=stage, attempt=consecutive, in_s=delay, generation=generation + 1)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            if draining():
                log.info("group.stopped_while_restarting", stage=stage)
                return 0
            time.sleep(POLL_S)


def _record_gave_up(stage: str, env: dict[str, str]) -> None:
    """``gave-up`` in place of the replica's heartbeat (bounded: Redis may be what is broken)."""
    url, replica = env.get("STAGEFERRY_REDIS_URL"), env.get("STAGEFERRY_REPLICA")
    if not url or not replica:
        return
    keys = Keys(env.get("STAGEFERRY_PREFIX", "sf"))

    async def record() -> None:
        with anyio.fail_after(RECORD_TIMEOUT_S):
            async with open_client(url) as redis:
                await record_gave_up(redis, keys, stage, replica)

    try:
        anyio.run(record)
    except (TimeoutError, ControlPlaneError) as exc:
        log.warning("group.gave_up_not_recorded", stage=stage, error=getattr(exc, "message", "timed out"))


def _start_ranks(
    stage: str, world_size: int, *, env: dict[str, str], args: tuple[str, ...], report_fd: int
) -> list[subprocess.Popen[bytes]]:
    base = dict(
        os.environ,
        **env,
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),  # a fresh rendezvous per generation
        STAGEFERRY_GROUP_CHILD="1",
        **{REPORT_FD_ENV: str(report_fd)},
    )
    return [
        subprocess.Popen(
            [sys.executable, "-m", "stageferry", "serve", stage, *args],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            pass_fds=(report_fd,),
        )
        for rank in range(world_size)
    ]


def _watch(
    procs: list[subprocess.Popen[bytes]], draining: Callable[[], bool], reports: _Reports
) -> tuple[list[tuple[int, int]], list[int]] | None:
    """Until every rank has exited (``None``), or one died: (ranks that failed with their codes, ranks
    that exited 0 without a drain).  Reads the leaders' reports as they come (the pipe never fills)."""
    while True:
        reports.drain()
        codes = [p.poll() for p in procs]
        if all(code is not None for code in codes) and draining():
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        exited_early = [rank for rank, code in enumerate(codes) if code == 0 and not draining()]
        if failed or exited_early:
            return failed, exited_early
        time.sleep(POLL_S)


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """A broken group cannot finish its entry (it will be reclaimed): stop every rank now."""
    stop(procs, grace_s=0)


__all__ = ["REPORT_FD_ENV", "RestartPolicy", "report_settled_crashes", "supervise"]
