"""Failpoints: named places in the services where a fault runner can freeze a process on purpose.

Some faults must land at an exact point of the protocol — a producer *right after* it published a
payload, a consumer *while* its NIXL READ is in flight — which no outside observer can hit reliably by
timing alone.  A service started with ``STAGEFERRY_FAILPOINTS=<dir>`` checks, at each named point,
whether the runner has armed it (a file ``<dir>/<name>.armed``).  The first process to get there takes
the arm atomically (a rename, so exactly one process fires per arming), records its pid in the file's
new name ``<dir>/<name>.hit.<pid>``, and then holds still — blocking its event loop on purpose — until
the runner SIGKILLs it (or the hold, read from the armed file, runs out).  The kill itself is a real
SIGKILL of a real process, sent by the runner.

Without the environment variable :func:`failpoint` returns at once: services pay one global lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "STAGEFERRY_FAILPOINTS"
DEFAULT_HOLD_S = 30.0

#: The points services check, by name (the runner arms these).
PRODUCER_PUBLISHED = "producer_published"
CONSUMER_READ_POSTED = "consumer_read_posted"
POINTS = (PRODUCER_PUBLISHED, CONSUMER_READ_POSTED)

_DIR: Path | None = Path(os.environ[ENV]) if os.environ.get(ENV) else None


def failpoint(name: str) -> bool:
    """Hold here if ``name`` is armed (this process took the arm); False (at once) otherwise."""
    if _DIR is None:
        return False
    armed = _DIR / f"{name}.armed"
    hit = _DIR / f"{name}.hit.{os.getpid()}"
    try:
        os.rename(armed, hit)
    except OSError:  # not armed, or another process took it first
        return False
    try:
        hold = float(hit.read_text() or DEFAULT_HOLD_S)
    except (OSError, ValueError):
        hold = DEFAULT_HOLD_S
    time.sleep(hold)  # frozen where the fault belongs; the runner kills us here
    return True


def arm(directory: Path, name: str, *, hold_s: float = DEFAULT_HOLD_S) -> None:
    """Arm ``name`` once (runner side); the next process to reach it freezes there."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text(str(hold_s))
    os.replace(tmp, directory / f"{name}.armed")


def disarm(directory: Path, name: str) -> None:
    """Take back an arm that nobody reached."""
    (directory / f"{name}.armed").unlink(missing_ok=True)


def hits(directory: Path, name: str) -> list[int]:
    """Pids frozen at ``name`` (runner side), oldest arming first; the hit files are consumed."""
    pids = []
    for path in sorted(directory.glob(f"{name}.hit.*"), key=lambda p: p.stat().st_mtime):
        try:
            pids.append(int(path.name.rsplit(".", 1)[1]))
        except ValueError:
            continue
        path.unlink(missing_ok=True)
    return pids
