"""Loaded by every Python process of a security test (``PYTHONPATH`` puts this directory first).

It records each call that unpickles (``pickle.load``, ``pickle.loads``, ``pickle.Unpickler.load``)
into the file named by ``STAGEFERRY_TEST_PICKLE_LOG``, with the calling frames, so a test can prove that
nothing read from Redis or a peer was ever unpickled.  It changes no behaviour: the real function runs.
"""

from __future__ import annotations

import functools
import os
import pickle
import traceback
from typing import Any

_LOG = os.environ.get("STAGEFERRY_TEST_PICKLE_LOG")


def _record(what: str) -> None:
    if not _LOG:
        return
    stack = "".join(traceback.format_stack(limit=8)[:-2])
    with open(_LOG, "a") as fh:
        fh.write(f"== {what} pid={os.getpid()}\n{stack}")


def _traced(what: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _record(what)
        return fn(*args, **kwargs)

    return wrapper


class _Unpickler(pickle.Unpickler):
    def load(self) -> Any:
        _record("pickle.Unpickler.load")
        return super().load()


if _LOG:
    pickle.load = _traced("pickle.load", pickle.load)
    pickle.loads = _traced("pickle.loads", pickle.loads)
    pickle.Unpickler = _Unpickler  # type: ignore[misc]
