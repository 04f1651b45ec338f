"""Run an entry's work with a watcher beside it that starts only if the work outlasts a first look.

While a stage's model runs, :class:`~stageferry.stages.entry.worker.StageWorker` keeps watching the entry
(the cancel flag, progress, the claim's renewal); its first look is due :data:`WATCH_EVERY_S` after the work
starts.  Most entries' work ends before that (a hop's model call, a first stage's media checks), so the
watcher is started only when that moment comes, from a timer, and the work runs in the caller's own task.
A task group of the two paid, for every entry, the watcher's start, its cancellation and the group's end:
two or three more turns of a busy event loop (``benchmarks/step_timer.py``'s model steps: 7 of a 2-core
box's 11 ms; round 6 of issue 39 on the GPU host 1.8 of 3.1 ms), while the entry held its place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def run_watched(
    work: Callable[[], Awaitable[T]], watch: Callable[[], Coroutine[Any, Any, None]], *, after_s: float
) -> T:
    """``work()``'s result, awaited in this task; ``watch()`` runs beside it from ``after_s`` on, if the
    work has not ended by then, and is cancelled (and waited for) when it ends.

    ``work``'s error is raised as itself.  ``watch`` should handle its own failures: an error it raises
    (other than its cancellation) is raised here once the work has ended.  The watcher runs in a copy of
    this task's context (its log bindings) and is not cancelled by a cancellation of this task before the
    work ends: a shielded work (the model) keeps its watcher until it returns."""
    loop = asyncio.get_running_loop()
    watcher: asyncio.Task[None] | None = None

    def start() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(after_s, start)
    try:
        return await work()
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
            with anyio.CancelScope(shield=True), contextlib.suppress(asyncio.CancelledError):
                await watcher


__all__ = ["run_watched"]
