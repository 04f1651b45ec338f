"""Redis round trips and commands per call site: an opt-in tally for profiling the control plane.

Off by default and then free: :func:`stageferry.broker.control.redis_conn.connect` only installs it when
``STAGEFERRY_REDIS_TALLY`` names a directory.  With it set, every connection of that process counts

* a **round trip** per packet it sends (one command, one pipeline, one ``MULTI``/``EXEC`` block, one
  ``EVALSHA``), and
* the **commands** in it, by name,

keyed by the *component* that sent it: the innermost ``stageferry`` function on the stack (say
``stages.admission:_admit_batch`` or ``broker.control.streams:handoff``), found by walking the frames —
a cost paid only when the tally is on.  Each process rewrites ``<dir>/<pid>.json`` at most every
:data:`FLUSH_EVERY_S` (on its next send) and at exit; ``benchmarks/throughput.py`` reads the files of
its services before and after the measured requests (:func:`read_dir`) and prints the difference per
request.  The file holds ``{"component COMMAND": [round_trips, commands]}``; a round trip's label is the
set of command names it carried (``"PIPE:EXISTS+HGET+SET"`` for a pipeline).

Nothing is read from Redis here and nothing is written to it: the figures cannot disturb what they count.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

#: Environment variable naming the directory that tallies are written to; unset = no tally.
ENV = "STAGEFERRY_REDIS_TALLY"
#: Longest a process's file lags behind its counts while it keeps talking to Redis.
FLUSH_EVERY_S = 0.25

_SKIP_MODULES = (
    "stageferry.broker.control.redis_conn",
    "stageferry.broker.control.resp_link",
    "stageferry.broker.control.replication",  # WAIT after a write counts for the write's caller
    __name__,
)
#: Functions that only route a call (``StageStream._durable``): the round trip is their caller's.
_PASS_THROUGH: set[Any] = set()


def pass_through(func: Any) -> Any:
    """Mark ``func`` as a router: tallies name the function that called it (a decorator)."""
    _PASS_THROUGH.add(func.__code__)
    return func


class Tally:
    """Per-process counters; one instance (:func:`process_tally`) shared by every tallied connection."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self.round_trips: Counter[str] = Counter()
        self.commands: Counter[str] = Counter()
        self._flushed = 0.0

    def count(self, names: list[str]) -> None:
        """One round trip carrying the commands ``names``, charged to the calling component."""
        if not names:
            return
        where = component()
        label = names[0] if len(names) == 1 else "PIPE:" + "+".join(sorted(set(names)))
        key = f"{where} {label}"
        self.round_trips[key] += 1
        self.commands[key] += len(names)
        now = time.monotonic()
        if now - self._flushed >= FLUSH_EVERY_S:
            self._flushed = now
            self.flush()

    def flush(self) -> None:
        """Rewrite this process's file (atomically: a reader sees the old counts or the new)."""
        if not self.path.parent.is_dir():
            return  # its directory is gone (a benchmark's temporary one, at exit)
        data = {key: [n, self.commands[key]] for key, n in self.round_trips.items()}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)


def component() -> str:
    """The innermost ``stageferry`` (or ``benchmarks``) function on the caller's stack, as ``module:func``."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (
            module.startswith(("stageferry.", "benchmarks", "__main__"))
            and module not in _SKIP_MODULES
            and frame.f_code not in _PASS_THROUGH
        ):
            return f"{module.removeprefix('stageferry.')}:{frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "other"


_TALLY: Tally | None = None


def process_tally() -> Tally | None:
    """This process's tally, made on first use when :data:`ENV` is set; ``None`` (the default) otherwise."""
    global _TALLY
    directory = os.environ.get(ENV)
    if not directory:
        return None
    path = Path(directory)
    if _TALLY is None or _TALLY.path.parent != path:  # a benchmark points each configuration elsewhere
        path.mkdir(parents=True, exist_ok=True)
        _TALLY = Tally(path)
        atexit.register(_TALLY.flush)
    return _TALLY


class TallyMixin:
    """Mixed into a redis-py asyncio connection class by :func:`tallied`: ``pack_command`` notes each
    command's name, ``send_packed_command`` counts the packet that carries them as one round trip."""

    _tally: Tally

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[str] = []

    def pack_command(self, *args: Any) -> Any:
        name = args[0]
        self._pending.append(name.decode() if isinstance(name, bytes) else str(name).upper())
        return super().pack_command(*args)  # type: ignore[misc]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        names, self._pending = self._pending, []
        self._tally.count(names)
        await super().send_packed_command(command, check_health)  # type: ignore[misc]


def tallied(connection_class: type, tally: Tally) -> type:
    """A subclass of ``connection_class`` that counts into ``tally``."""
    return type(
        f"Tallied{connection_class.__name__}",
        (TallyMixin, connection_class),
        {"_tally": tally},
    )


def read_dir(directory: Path) -> dict[str, list[int]]:
    """The sum over every process's file in ``directory``: ``{"component COMMAND": [round_trips, commands]}``."""
    total: dict[str, list[int]] = {}
    for path in directory.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key, (trips, commands) in data.items():
            row = total.setdefault(key, [0, 0])
            row[0] += trips
            row[1] += commands
    return total
