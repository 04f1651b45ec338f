"""A stage's dead-letter stream, bounded by bytes and by age.

An entry a stage gives up on (undecodable, too large, delivered too often) goes to
``<p>:stage:<stage>:dlq`` with the reason, so that an operator can see what happened.  Copying the entry
whole would let hostile clients fill Redis through it: stage entries may be up to ``max_entry_bytes``
(32 MiB) each.  So a dead letter keeps what diagnoses the entry, not the entry:

- ``reason`` (at most :data:`REASON_MAX_CHARS`), ``error_code``, ``source_entry`` (the stream entry id),
  ``deliveries``, ``request_id`` (at most :data:`REQUEST_ID_MAX_BYTES`) and ``entry_bytes``;
- each body field (``job``, ``envelope``) whole only up to ``body_max_bytes`` (4 KiB by default);
  beyond that its size (``<name>_bytes``) and sha256 (``<name>_sha256``), never its bytes.

So one dead letter is at most :meth:`DeadLetterPolicy.entry_cap` bytes, and the stream is trimmed on
every write, in the same script: exactly to ``min(maxlen, max_bytes // entry_cap)`` entries (``MAXLEN``),
entries older than ``max_age_s`` by the server's clock are dropped (``MINID``), and the key expires
``max_age_s`` after the last dead letter, so a quiet stream goes away by itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from stageferry.config import Retention

#: Longest reason kept (characters).
REASON_MAX_CHARS = 2000
#: Longest request id kept (bytes); longer ones are cut (the entry id identifies the entry anyway).
REQUEST_ID_MAX_BYTES = 128
#: Fields of a stage entry that carry a body, kept whole only when small.
BODY_FIELDS = ("job", "envelope")
_FIXED_CAP = 1024  # field names, error code, entry id, counts, sizes, digests

# KEYS: dlq stream. ARGV: maxlen, max age ms, ttl s, field, value, field, value, ...
# XADD with an exact MAXLEN, then drop what is older than the age bound by the server's clock: the new
# entry's id is that clock's milliseconds (``*``), so no TIME is needed.  Only commands the stage ACL user
# is granted (``stageferry.acl.STAGE_COMMANDS``; tests/security/test_stage_acl.py runs it as that user).
DEAD_LETTER_LUA = """
local fields = {}
for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], '*', unpack(fields))
local oldest = tonumber(string.match(id, '^%d+')) - tonumber(ARGV[2])
if oldest > 0 then redis.call('XTRIM', KEYS[1], 'MINID', tostring(oldest)) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return id
"""


@dataclass(frozen=True, slots=True)
class DeadLetterPolicy:
    """How much of an entry a dead letter keeps, and how long and large the stream may grow."""

    maxlen: int = 100_000
    max_bytes: int = 256 << 20
    max_age_s: int = 7 * 86_400
    body_max_bytes: int = 4096

    @classmethod
    def from_retention(cls, retention: Retention) -> DeadLetterPolicy:
        return cls(
            maxlen=retention.dlq_maxlen,
            max_bytes=retention.dlq_max_bytes,
            max_age_s=retention.dlq_max_age_s,
            body_max_bytes=retention.dlq_body_max_bytes,
        )

    @property
    def entry_cap(self) -> int:
        """The most bytes (field names and values) one dead letter holds."""
        return REASON_MAX_CHARS * 4 + REQUEST_ID_MAX_BYTES + len(BODY_FIELDS) * self.body_max_bytes + _FIXED_CAP

    @property
    def effective_maxlen(self) -> int:
        """Entries kept: the length bound, or fewer when the byte bound is tighter (at least one)."""
        return max(1, min(self.maxlen, self.max_bytes // self.entry_cap))

    def fields(
        self,
        entry_id: str,
        entry_fields: Mapping[str, bytes],
        *,
        reason: str,
        error_code: str,
        deliveries: int,
        entry_bytes: int | None = None,
    ) -> dict[str, bytes | str]:
        """The dead letter for one entry (see the module docstring for what is kept)."""
        size = entry_bytes if entry_bytes is not None else sum(len(k) + len(v) for k, v in entry_fields.items())
        out: dict[str, bytes | str] = {
            "reason": reason[:REASON_MAX_CHARS],
            "error_code": error_code[:64],
            "source_entry": entry_id[:64],
            "deliveries": str(deliveries),
            "entry_bytes": str(size),
        }
        rid = entry_fields.get("request_id")
        if rid is not None:
            out["request_id"] = rid[:REQUEST_ID_MAX_BYTES]
        for name in BODY_FIELDS:
            body = entry_fields.get(name)
            if body is None:
                continue
            if len(body) <= self.body_max_bytes:
                out[name] = body
            else:
                out[f"{name}_bytes"] = str(len(body))
                out[f"{name}_sha256"] = hashlib.sha256(body).hexdigest()
        return out

    def script_args(self, fields: Mapping[str, bytes | str]) -> list[bytes | str | int]:
        """ARGV for :data:`DEAD_LETTER_LUA`."""
        flat: list[bytes | str | int] = [self.effective_maxlen, self.max_age_s * 1000, self.max_age_s]
        for name, value in fields.items():
            flat += [name, value]
        return flat


__all__ = ["BODY_FIELDS", "DEAD_LETTER_LUA", "DeadLetterPolicy"]
