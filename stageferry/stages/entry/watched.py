"""Run a piece of work with a watcher beside it that starts only if the work outlasts a first look.

The work is awaited in the caller's own task; the watcher is started from a timer, ``after_s`` after the
work began, and only if the work is still running then, and it is cancelled and waited for when the work
ends.  Work that ends before the first look pays for a timer only: no task is made, none is cancelled, and
nothing waits for a turn of the event loop to end them (what a task group of the two costs every time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")


async def run_watched(
    work: Callable[[], Awaitable[T]], watch: Callable[[], Coroutine[Any, Any, None]], *, after_s: float
) -> T:
    """``work()``'s result, awaited in this task; ``watch()`` runs beside it from ``after_s`` on, if the
    work has not ended by then, and is cancelled (and waited for) when it ends.

    ``work``'s error is raised as itself; so is an error ``watch`` raised (other than its cancellation),
    once the work has ended — a watcher should handle its own failures, since the work goes on unwatched
    after one.  The watcher runs in a copy of this task's context (its log bindings).  A cancellation of
    this task's scope while the work runs (a shielded work, such as a model's call, runs to its end) is
    raised once the work has ended, as a task group's end would; the work's result is then dropped."""
    loop = asyncio.get_running_loop()
    watcher: asyncio.Task[None] | None = None

    def start() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(after_s, start)
    try:
        result = await work()
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait([watcher])  # only the watcher's end: this task's own cancellation passes
            error = None if watcher.cancelled() else watcher.exception()
            if error is not None:
                raise error
    await anyio.lowlevel.checkpoint_if_cancelled()
    return result


__all__ = ["run_watched"]
