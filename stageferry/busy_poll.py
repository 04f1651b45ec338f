"""Busy polling for a stage leader's event loop: look for I/O without sleeping for a while before blocking.

A hop is a chain of wake-ups: the producer's hand-off reply, the consumer's wake from its stream wait, the
READ's completion.  Each one that finds its process asleep in ``epoll_wait`` pays for waking it (on the
GPU hosts, virtual machines, a halted vCPU's exit and re-entry), and the code that runs next runs slower
on a core that just woke: ``benchmarks/hop_python.py --gap-us`` measured the same Python steps of a hop
2–3× slower after a 1 ms sleep than back to back (CUDA process, 2 × H200 host).  A loop that keeps polling
for ``spin`` seconds before it blocks keeps its core awake across the short gaps of a hop, at the price of
one core busy for at most ``spin`` after each event — what NCCL and UCX do in their progress loops.

The selector spins only while the loop has nothing to run: its ``select(timeout)`` polls with a zero
timeout until an event arrives, ``spin`` has passed or the loop's own timeout is up, then blocks for the
rest.  The GIL is released in every poll, so other threads (a model's compute) still run.  Off (``0``),
the loop is asyncio's own.

    anyio.run(main, backend_options={"loop_factory": loop_factory(spin_us=500)})
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from typing import Any

#: Longest a loop may spin before it blocks (a busy core per process, so bounded).
MAX_SPIN_US = 10_000


class BusyPollSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The default selector, polling without a timeout for up to ``spin_s`` before it blocks."""

    def __init__(self, spin_s: float) -> None:
        super().__init__()
        self.spin_s = spin_s
        self.spins = 0
        """Selects that found an event while spinning (they would have slept)."""

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is not None and timeout <= 0:
            return super().select(0)
        started = time.monotonic()
        spin_until = started + (self.spin_s if timeout is None else min(self.spin_s, timeout))
        while True:
            ready = super().select(0)
            if ready:
                self.spins += 1
                return ready
            now = time.monotonic()
            if now >= spin_until:
                break
        return super().select(None if timeout is None else max(0.0, timeout - (now - started)))


def loop_factory(spin_us: int) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """An event-loop factory whose loop busy-polls for ``spin_us`` µs before blocking; None when off (0).

    :class:`ValueError` outside 0..:data:`MAX_SPIN_US`."""
    if not 0 <= spin_us <= MAX_SPIN_US:
        raise ValueError(f"busy poll must be 0..{MAX_SPIN_US} µs (got {spin_us})")
    if spin_us == 0:
        return None
    return lambda: asyncio.SelectorEventLoop(BusyPollSelector(spin_us / 1e6))


def backend_options(spin_us: int) -> dict[str, Any]:
    """``anyio.run``'s ``backend_options`` for a loop busy-polling ``spin_us`` µs (empty when off)."""
    factory = loop_factory(spin_us)
    return {} if factory is None else {"loop_factory": factory}
