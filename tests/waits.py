"""Waiting on a condition in async tests (never a fixed sleep: they break on a loaded box)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest


async def until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    """Poll the event loop until ``predicate()`` (a value or an awaitable) holds; a test failure naming
    ``what`` if it does not within ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            while not await _value(predicate()):
                await anyio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def _value(v: Any) -> Any:
    return await v if hasattr(v, "__await__") else v


def until_sync(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    """:func:`until` for a thread that is not an event loop's (a model's, a hook called from one)."""
    deadline, tick = time.monotonic() + timeout, threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        tick.wait(0.01)
