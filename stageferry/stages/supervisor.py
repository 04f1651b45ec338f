"""The group supervisor: ``stageferry serve`` starts its group's rank processes, watches them, and when a
rank dies, restarts the whole group — so a bare-metal deployment heals without an orchestrator.

A group whose rank died cannot finish its entry (a collective would hang), so every rank is stopped and
the entry is left to be reclaimed (by the restarted group, or another replica) after the visibility
timeout.  Then the group is started again, after a backoff (:class:`RestartPolicy`): 1 s, doubling up to
30 s, so that a group that dies at start-up (a broken model, a full GPU) does not spin.  The count of
restarts is *consecutive*: a group that ran for ``healthy_s`` (60 s) before dying starts over at the
first backoff.  After ``max_restarts`` consecutive restarts the supervisor gives up and exits 1, so that
whatever runs it (systemd, compose) sees a replica that cannot come up rather than a silent loop.
Every death, restart and the giving up are logged (``group.rank_died``, ``group.restarting``,
``group.gave_up``).

SIGTERM/SIGINT drain as before: the leader finishes its entry, then stops its followers; a supervisor
waiting out a backoff exits at once.  Ranks are started with ``PR_SET_PDEATHSIG`` (see
:func:`stageferry.stages.group.die_with_parent`): if the supervisor itself is killed, its ranks die too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from stageferry.embedded_redis import free_port

log = structlog.get_logger(__name__)

#: How often the supervisor looks at its ranks.
POLL_S = 0.1


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
    consecutive = 0
    generation = 0
    while True:
        generation += 1
        group[:] = _start_ranks(stage, world_size, env=env, args=args)
        log.info(
            "group.started",
            stage=stage,
            tp=world_size,
            ranks=world_size,
            pids=[p.pid for p in group],
            generation=generation,
        )
        started = time.monotonic()
        died = _watch(group, lambda: draining)
        if died is None:  # every rank exited after a drain
            return 0 if all(p.returncode == 0 for p in group) else 1
        failed, exited = died
        ran_s = time.monotonic() - started
        log.error("group.rank_died", stage=stage, failed=failed, exited=exited, ran_s=round(ran_s, 1))
        _stop_all(group)
        if draining:
            return 1
        if ran_s >= policy.healthy_s:
            consecutive = 0
        consecutive += 1
        if consecutive > policy.max_restarts:
            log.error("group.gave_up", stage=stage, restarts=consecutive - 1, max_restarts=policy.max_restarts)
            return 1
        delay = policy.delay(consecutive)
        log.warning("group.restarting", stage=stage, attempt=consecutive, in_s=delay, generation=generation + 1)
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            if draining:
                log.info("group.stopped_while_restarting", stage=stage)
                return 0
            time.sleep(POLL_S)


def _start_ranks(
    stage: str, world_size: int, *, env: dict[str, str], args: tuple[str, ...]
) -> list[subprocess.Popen[bytes]]:
    base = dict(
        os.environ,
        **env,
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),  # a fresh rendezvous per generation
        STAGEFERRY_GROUP_CHILD="1",
    )
    return [
        subprocess.Popen(
            [sys.executable, "-m", "stageferry", "serve", stage, *args],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world_size)
    ]


def _watch(
    procs: list[subprocess.Popen[bytes]], draining: Callable[[], bool]
) -> tuple[list[tuple[int, int]], list[int]] | None:
    """Until every rank has exited (``None``), or one died: (ranks that failed with their codes, ranks
    that exited 0 without a drain)."""
    while True:
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
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


__all__ = ["RestartPolicy", "supervise"]
