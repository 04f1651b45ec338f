"""Wall time per call of named functions, inside a running benchmark: a diagnostic for the hop's steps.

    timer = StepTimer()
    timer.wrap(Consumer, "_wait_all", "wait for DONE")         # a method (sync or async)
    timer.wrap(consumer_module, "unpack", "unpack")            # a module-level function, as its caller sees it
    ...
    timer.print("consumer steps")                               # medians and p99 per step, in ms

Unlike cProfile, only the wrapped functions pay (one ``perf_counter`` pair per call), so the hop keeps its
shape and the step times add up to roughly the hop.  Async functions are timed from the call to the
return, awaits included: a step that waits on the event loop counts its wait.  ``transfer.py --steps``
wraps the steps of the put, the stream read and the get in its two processes.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import time
from typing import Any


class StepTimer:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self.tag = ""
        """Prefix of the step names recorded from now on (say the kind of hop running)."""

    def add(self, name: str, ms: float) -> None:
        self.times.setdefault(self.tag + name, []).append(ms)

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Replace ``owner.attr`` (a class's method or a module's function) with a timed version."""
        func = getattr(owner, attr)
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await func(*args, **kwargs)
                finally:
                    self.add(name, (time.perf_counter() - started) * 1e3)

            setattr(owner, attr, timed_async)
            return

        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.add(name, (time.perf_counter() - started) * 1e3)

        setattr(owner, attr, timed)

    def clear(self) -> None:
        """Forget what was recorded (after a warm-up)."""
        self.times.clear()

    def print(self, title: str) -> None:
        from bench_stats import print_steps  # benchmarks/ is on the path of a benchmark's own process

        print_steps(title, dict(sorted(self.times.items())), unit="ms", q=99, digits=3)


def hop_steps(role: str) -> StepTimer:
    """A timer wrapped around the steps of the NIXL hop on one side: ``producer`` (the put) or
    ``consumer`` (the stream read's parse and the get, down to the READ's post, wait and release)."""
    from pydantic import TypeAdapter

    from stageferry.broker.control import streams
    from stageferry.broker.data import pool
    from stageferry.broker.data.nixl import consumer, peers, producer, reads, releases, staged_outputs
    from stageferry.schemas.nixl import Sealer

    timer = StepTimer()
    owner: object  # a class or a module (both loops below): what StepTimer.wrap takes
    if role == "producer":
        for owner, attr, name in (
            (producer.Producer, "_put", "put (all of it)"),
            (producer, "plan_payload", "put: plan the payload"),
            (staged_outputs.Staging, "fill", "put: fill the staged slot (+ CUDA sync)"),
            (producer, "pack_into", "put: pack into a slot (copy put)"),
            (producer.Producer, "acquire", "put: take a slot (copy put)"),
            (producer.Producer, "lease", "put: lease, seal, NixlPayload"),
            (staged_outputs.Stagings, "stage", "stage (the model's slot tensors, untimed in the hop)"),
        ):
            timer.wrap(owner, attr, name)
        return timer
    for owner, attr, name in (
        (streams.StageStream, "_entries", "read: rows → entries"),
        (TypeAdapter, "validate_json", "parse the ref (TypeAdapter.validate_json)"),
        (consumer, "validate_manifest", "get: validate the manifest"),
        (peers.Peers, "ensure", "get: peer lookup"),
        (consumer, "validate_remote_regions", "get: descriptor bounds"),
        (Sealer, "seal", "get: seal (the peer's Sealer)"),
        (consumer, "check_fresh", "get: lease fresh"),
        (pool.PoolSet, "acquire_regions", "get: take a slot"),
        (reads.Reader, "read", "get: READ (post, wait, release notification)"),
        (reads.Reader, "_post", "get: READ: post"),
        (reads.Reader, "_wait_all", "get: READ: wait for DONE"),
        (releases.Releases, "send", "release notification (the loop's next turn, after the get)"),
        (consumer, "unpack", "get: unpack"),
        (consumer.Consumer, "_route", "get: route label"),
        (consumer.Consumer, "_fetch", "get: all of it (to the payload in hand)"),
    ):
        timer.wrap(owner, attr, name)
    return timer


#: ``throughput.py --steps``: the directory each stage process writes its entry steps to (:func:`entry_steps`).
STEPS_ENV = "STAGEFERRY_BENCH_STEPS"
_WRITE_EVERY_S = 0.5


class FileTimer(StepTimer):
    """A :class:`StepTimer` that rewrites ``path`` (JSON: step → ms) at most every half second, for a
    process that is killed rather than asked to report (a stage service)."""

    def __init__(self, path: Any) -> None:
        super().__init__()
        self.path = path
        self._written = 0.0

    def add(self, name: str, ms: float) -> None:
        super().add(name, ms)
        now = time.monotonic()
        if now - self._written >= _WRITE_EVERY_S:
            self._written = now
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.times))
            tmp.replace(self.path)


def entry_steps(stage: str, directory: str) -> StepTimer:
    """A timer wrapped around a stage leader's steps of an entry (in its ``stageferry serve`` process; the
    null model's factory installs it when :data:`STEPS_ENV` is set), from the read to the hand-off: where
    a replica's time per entry goes.  Async steps count their awaits: the model's step counts the wait
    for the model behind other entries in hand, the thread hop there and back, and the model's run,
    which is also timed alone, in its thread."""
    from pathlib import Path

    from stageferry.broker.control import streams
    from stageferry.stages.entry import handoff, worker
    from stageferry.stages.group import group

    timer = FileTimer(Path(directory) / f"{stage}-{os.getpid()}.json")
    for owner, attr, name in (
        (worker.StageWorker, "process", "entry: all of it (admission to hand-off)"),
        (streams.StageStream, "read", "read (its wait included)"),
        (worker.StageWorker, "_admitted", "admission (parse + script)"),
        (worker.StageWorker, "_compute_holding_claim", "model: wait for it, hop, run, hop back"),
        (group.GroupCompute, "__call__", "model: hop, run, hop back"),
        (group.GroupCompute, "_run", "model: run (in its thread)"),
        (handoff.HandOn, "hand_on", "hand-off: put + script"),
        (streams.StageStream, "hand_off", "hand-off: script"),
        (handoff.HandOn, "store_result", "last stage: store + finish script"),
        (streams.StageStream, "finish", "last stage: finish script"),
    ):
        timer.wrap(owner, attr, name)
    time_thread_hops(timer, group.GroupCompute)
    return timer


def time_thread_hops(timer: StepTimer, compute: Any) -> None:
    """Split the model's hop (``compute.__call__`` around ``compute._run`` in the model thread) into its
    waits: behind the items queued before it (the thread busy), the free thread's wake-up until its run
    starts (a thread switch, and the GIL taken from a busy event loop), and the way back to the loop
    after the run (a busy event loop's turn: 2-3 ms of an entry on the loaded 2-core box, round 31)."""
    import contextvars

    hop: contextvars.ContextVar[dict[str, float]] = contextvars.ContextVar("step_timer_hop")
    thread = {"ended": 0.0}  # the model thread's last run's end (one model thread a process)
    call, run = compute.__call__, compute._run

    @functools.wraps(call)
    async def timed_call(*args: Any, **kwargs: Any) -> Any:
        marks = {"submitted": time.perf_counter()}
        hop.set(marks)  # the call copies the context for its run: the run finds these marks
        try:
            return await call(*args, **kwargs)
        finally:
            if "ended" in marks:
                timer.add("model: hop back (thread → loop)", (time.perf_counter() - marks["ended"]) * 1e3)

    @functools.wraps(run)
    def timed_run(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        marks = hop.get(None)
        if marks is not None:
            free = max(marks["submitted"], thread["ended"])
            timer.add("model: queued behind earlier runs", (free - marks["submitted"]) * 1e3)
            timer.add("model: hop there (free thread → run)", (started - free) * 1e3)
        try:
            return run(*args, **kwargs)
        finally:
            thread["ended"] = time.perf_counter()
            if marks is not None:
                marks["ended"] = thread["ended"]

    compute.__call__, compute._run = timed_call, timed_run
