"""Stopping child processes: SIGTERM, wait a bound, SIGKILL what is left, reap — written once.

Used by ``stageferry up`` (its services), the chaos cluster (its replicas), the embedded Redis and the
group supervisor (its ranks).  ``group=True`` signals the process group a child leads (a child started with
``start_new_session=True``), so what it started stops with it; ``term_group=False`` sends the SIGTERM to the
leader alone (a supervisor that drains its ranks itself) and keeps the SIGKILL for the group.
``grace_s=0`` skips the SIGTERM: a kill at once (a crash, or a broken TP group that cannot finish its entry
anyway).

:func:`stop` is for :class:`subprocess.Popen` (it blocks; from async code run it in a thread), and
:func:`astop` for anyio's :class:`~anyio.abc.Process`.  Both return one :class:`Stopped` per process, in
order.  After SIGKILL the wait is bounded too (``reap_s``): a process stuck in the kernel is reported with
``returncode=None`` rather than hanging the caller.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import Process

REAP_S = 10.0
"""How long to wait for a SIGKILLed process to be reaped."""


@dataclass(frozen=True)
class Stopped:
    """How one process ended: its exit code (``None``: not reaped within the bound; negative: the signal
    that ended it) and whether it had to be SIGKILLed after the grace."""

    pid: int
    returncode: int | None
    killed: bool


def send(pid: int, signum: signal.Signals, *, group: bool = False) -> bool:
    """Signal ``pid`` (or the process group it leads); False if it is gone (or not ours to signal)."""
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def stop(
    processes: Sequence[subprocess.Popen[bytes]],
    *,
    grace_s: float,
    group: bool = False,
    term_group: bool | None = None,
    reap_s: float = REAP_S,
) -> list[Stopped]:
    """SIGTERM every running process, wait up to ``grace_s`` for all of them, SIGKILL the rest, reap."""
    if grace_s > 0:
        for proc in processes:
            if proc.poll() is None:
                send(proc.pid, signal.SIGTERM, group=group if term_group is None else term_group)
    deadline = time.monotonic() + grace_s
    killed: set[int] = set()
    for proc in processes:
        if proc.poll() is not None:
            continue
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        if proc.returncode is None:
            send(proc.pid, signal.SIGKILL, group=group)
            killed.add(proc.pid)
    reap_deadline = time.monotonic() + reap_s
    for proc in processes:
        if proc.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, reap_deadline - time.monotonic()))
    return [Stopped(proc.pid, proc.returncode, proc.pid in killed) for proc in processes]


async def astop(
    processes: Sequence[Process],
    *,
    grace_s: float,
    group: bool = False,
    term_group: bool | None = None,
    reap_s: float = REAP_S,
) -> list[Stopped]:
    """:func:`stop` for anyio processes; shielded from cancellation (a stop half done leaks children)."""
    killed: set[int] = set()
    with anyio.CancelScope(shield=True):
        if grace_s > 0:
            for proc in processes:
                if proc.returncode is None:
                    send(proc.pid, signal.SIGTERM, group=group if term_group is None else term_group)
            with anyio.move_on_after(grace_s):
                for proc in processes:
                    await proc.wait()
        for proc in processes:
            if proc.returncode is None:
                send(proc.pid, signal.SIGKILL, group=group)
                killed.add(proc.pid)
        with anyio.move_on_after(reap_s):
            for proc in processes:
                await proc.wait()
    return [Stopped(proc.pid, proc.returncode, proc.pid in killed) for proc in processes]


__all__ = ["REAP_S", "Stopped", "astop", "send", "stop"]
