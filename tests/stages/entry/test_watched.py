"""``run_watched``: the work runs in the caller's task, its watcher only once the work outlasts the first
look, and the watcher ends with the work (the keeper of an entry's claim while its model runs)."""

from __future__ import annotations

import contextvars

import anyio
import pytest

from stageferry.stages.entry.watched import run_watched

pytestmark = pytest.mark.anyio

BOUND: contextvars.ContextVar[str] = contextvars.ContextVar("bound", default="")


class Watcher:
    """A watch that records its start, its looks and its end, and lets the test hold the work until it ran."""

    def __init__(self) -> None:
        self.started = anyio.Event()
        self.looks = 0
        self.cancelled = False
        self.seen = ""

    async def __call__(self) -> None:
        self.seen = BOUND.get()
        self.started.set()
        try:
            while True:
                self.looks += 1
                await anyio.sleep(0.001)
        except BaseException:
            self.cancelled = True
            raise


async def test_work_that_ends_before_the_first_look_never_starts_the_watcher() -> None:
    watcher = Watcher()

    async def work() -> str:
        return "done"

    assert await run_watched(work, watcher, after_s=60.0) == "done"
    assert not watcher.started.is_set() and watcher.looks == 0


async def test_a_long_work_is_watched_until_it_ends_and_the_watcher_is_gone_before_the_return() -> None:
    watcher = Watcher()
    BOUND.set("request-1")

    async def work() -> int:
        await watcher.started.wait()  # the work outlasts the first look
        with anyio.fail_after(30):
            while watcher.looks < 3:
                await anyio.sleep(0.001)
        return 7

    assert await run_watched(work, watcher, after_s=0.01) == 7
    assert watcher.cancelled, "the watcher is cancelled and waited for before run_watched returns"
    assert watcher.seen == "request-1", "the watcher runs in the caller's context (its log bindings)"


async def test_the_works_error_is_raised_as_itself_and_the_watcher_ends() -> None:
    watcher = Watcher()

    async def work() -> None:
        await watcher.started.wait()
        raise ValueError("model failed")

    with pytest.raises(ValueError, match="model failed"):
        await run_watched(work, watcher, after_s=0.0)
    assert watcher.cancelled


async def test_the_watchers_own_error_is_raised_once_the_work_ends() -> None:
    failed = anyio.Event()

    async def watch() -> None:
        failed.set()
        raise RuntimeError("watcher bug")

    async def work() -> str:
        await failed.wait()
        return "done"

    with pytest.raises(RuntimeError, match="watcher bug"):
        await run_watched(work, watch, after_s=0.0)


async def test_a_cancelled_caller_still_waits_for_its_shielded_work_and_ends_the_watcher() -> None:
    watcher = Watcher()
    finished: list[str] = []

    async def work() -> str:
        with anyio.CancelScope(shield=True):  # as the model's call is
            await watcher.started.wait()
            finished.append("work")
        return "done"

    async with anyio.create_task_group() as tg:

        async def caller() -> None:
            await run_watched(work, watcher, after_s=0.0)

        tg.start_soon(caller)
        await watcher.started.wait()
        tg.cancel_scope.cancel()
    assert finished == ["work"] and watcher.cancelled
