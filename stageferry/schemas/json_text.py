"""JSON text from outside — a client's form field or submission, a peer's record — parsed with the
standard library, every failure a ``ValueError``.

``json.loads`` recurses once per nesting level: ``"[" * 5000`` raises :class:`RecursionError`, which is
no ``ValueError`` and which no caller of a parser expects.  It went past their ``except ValueError`` and
out of the request: an internal error at the gateway, and a stage worker that died before it could refuse
the entry (and again on each redelivery, before any crash mark could count it).  :func:`loads` raises
``json.JSONDecodeError`` for it, as for any other text that is not JSON, so the caller's refusal covers it.
"""

from __future__ import annotations

import json
from typing import Any


def loads(raw: str | bytes | bytearray) -> Any:
    """``json.loads(raw)``; ``json.JSONDecodeError`` (a ``ValueError``) also for nesting too deep to parse."""
    try:
        return json.loads(raw)
    except RecursionError:
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes | bytearray) else raw
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


__all__ = ["loads"]
