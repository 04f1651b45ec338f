"""Every error stageferry raises, under one root.

Errors of the libraries underneath (redis-py, nixl, pydantic) are translated into the most specific
class here at exactly one boundary each (``broker/control/redis_conn.py``, ``broker/data/nixl_agent.py``,
``schemas``), keeping the original as ``__cause__``.  Each class carries a stable ``code``, which is what
a request's failed/rejected status shows, so that clients branch on codes, never on message text::

    StageferryError
    ├── ConfigError                  bad settings or pipeline file (start-up only)
    ├── RejectedError                the request itself is invalid: never retried
    │   ├── JobValidationError       job fields out of range, unknown task/LoRA, bad media
    │   ├── EnvelopeError            a stage-to-stage entry that does not parse
    │   └── ManifestError            manifest/descriptors that fail validation before any native call
    ├── ControlPlaneError            Redis unreachable, timed out, protocol trouble
    │   ├── QueueFullError           the first stage's stream is at its bound (back-pressure)
    │   └── AccessDeniedError        Redis refused our credentials or an ACL forbids a command/key
    ├── DataPlaneError               moving payload bytes failed (may fall back or recompute)
    │   ├── NixlUnavailableError     NIXL could not be loaded or no agent could be made
    │   ├── HandshakeError           the producer's agent metadata is missing, stale or untrusted
    │   ├── ClaimError               the payload could not be claimed (lease expired, already taken)
    │   ├── PayloadUnavailableError  the producer's copy is gone: recompute upstream
    │   ├── TransferError            a READ failed or timed out
    │   │   └── PeerDisconnectedError  the peer went away mid-transfer
    │   ├── PoolExhaustedError       no slot freed within the back-pressure timeout
    │   └── PayloadTooLargeError     above every cap that applies (pool, inline, total)
    ├── StageFailedError             a stage's model raised; the request fails with the cause
    ├── GroupBrokenError             a rank of the stage group is gone: the replica stops, the entry is
    │                                reclaimed elsewhere (never a request failure)
    ├── DeadlineExceededError        the request's deadline passed
    └── CancelledRequestError        the client cancelled the request
"""

from __future__ import annotations

from typing import Any, ClassVar


class StageferryError(Exception):
    """Root of all stageferry errors; ``code`` is the stable, machine-readable name."""

    code: ClassVar[str] = "internal"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The shape a status carries: code, message and plain-JSON details."""
        return {"code": self.code, "message": self.message, "details": self.details}


class ConfigError(StageferryError):
    code = "config"


class RejectedError(StageferryError):
    """The request is invalid as sent; retrying it cannot help."""

    code = "rejected"


class JobValidationError(RejectedError):
    code = "invalid_job"

    def __init__(self, message: str, field_errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message, field_errors=field_errors or [])
        self.field_errors = field_errors or []


class EnvelopeError(RejectedError):
    code = "invalid_envelope"


class ManifestError(RejectedError):
    code = "invalid_manifest"


class ControlPlaneError(StageferryError):
    code = "control_plane"


class QueueFullError(ControlPlaneError):
    code = "queue_full"


class AccessDeniedError(ControlPlaneError):
    """Wrong or missing password, or an ACL that forbids a command or key: retrying cannot help."""

    code = "access_denied"


class DataPlaneError(StageferryError):
    code = "data_plane"


class NixlUnavailableError(DataPlaneError):
    code = "nixl_unavailable"


class HandshakeError(DataPlaneError):
    code = "handshake_failed"


class ClaimError(DataPlaneError):
    code = "claim_failed"


class PayloadUnavailableError(DataPlaneError):
    """The producer no longer holds the payload; the request is recomputed upstream."""

    code = "payload_unavailable"


class TransferError(DataPlaneError):
    code = "transfer_failed"


class PeerDisconnectedError(TransferError):
    code = "peer_disconnected"


class PoolExhaustedError(DataPlaneError):
    code = "pool_exhausted"


class PayloadTooLargeError(DataPlaneError):
    code = "payload_too_large"


class StageFailedError(StageferryError):
    code = "stage_failed"


class GroupBrokenError(StageferryError):
    """A collective failed because a rank died; the request itself is fine and must not fail."""

    code = "group_broken"


class DeadlineExceededError(StageferryError):
    code = "deadline_exceeded"


class CancelledRequestError(StageferryError):
    code = "cancelled"


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> StageferryError:
    """Rebuild a typed error from its code (a follower raising the leader's error, for instance)."""
    classes: list[type[StageferryError]] = [StageferryError]
    i = 0
    while i < len(classes):
        classes += classes[i].__subclasses__()
        i += 1
    cls = next((c for c in classes if c.code == code), StageferryError)
    error = cls.__new__(cls)
    StageferryError.__init__(error, message, **(details or {}))
    return error
