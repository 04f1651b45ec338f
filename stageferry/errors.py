"""Every error stageferry raises, under one root.

Errors of the libraries underneath (redis-py, nixl, pydantic) are translated into the most specific
class here at exactly one boundary each (``broker/control/redis_conn.py``, ``broker/data/nixl/agent.py``,
``schemas``), keeping the original as ``__cause__``.  Each class carries a stable ``code``, which is what
a request's failed/rejected status shows, so that clients branch on codes, never on message text::

    StageferryError
    ├── ConfigError                  bad settings or pipeline file (start-up only)
    ├── RejectedError                the request itself is invalid: never retried
    │   ├── JobValidationError       job fields out of range, unknown task/LoRA, bad media
    │   ├── EnvelopeError            a stage-to-stage entry that does not parse
    │   ├── ManifestError            manifest/descriptors that fail validation before any native call
    │   ├── PayloadContractError     a payload that breaks its consumer's input contract (names the entry)
    │   ├── RequestIdTakenError      the request id belongs to a different job: a conflict
    │   └── SubmissionRefusedError   a client entry refused before it names a request (bad id, wrong
    │       │                        tenant): told only through the entry's refusal record
    │       ├── InvalidRequestIdError  the id breaks the request-id rule
    │       └── TenantMismatchError  the id is not the submitting tenant's
    ├── ControlPlaneError            Redis unreachable, timed out, protocol trouble
    │   ├── QueueFullError           the first stage's stream is at its bound (back-pressure)
    │   ├── NotReplicatedError       a write reached fewer replicas than asked in time (may be lost
    │   │                            in a failover): retry it, it is idempotent
    │   └── AccessDeniedError        Redis refused our credentials or an ACL forbids a command/key
    ├── DataPlaneError               moving payload bytes failed (may fall back or recompute)
    │   ├── NixlUnavailableError     NIXL could not be loaded or no agent could be made
    │   ├── HandshakeError           the producer's agent metadata is missing, stale or untrusted
    │   │   └── ProtocolMismatchError  the peer speaks another NIXL side-channel protocol version
    │   ├── ClaimError               the payload could not be claimed (lease expired, already taken)
    │   ├── PayloadUnavailableError  the producer's copy is gone: recompute upstream
    │   ├── TransferError            a READ failed or timed out
    │   │   └── PeerDisconnectedError  the peer went away mid-transfer
    │   ├── PoolExhaustedError       no slot freed within the back-pressure timeout
    │   └── PayloadTooLargeError     above every cap that applies (pool, inline, total)
    ├── StageFailedError             a stage's model raised; the request fails with the cause
    ├── GroupBrokenError             a rank of the stage group is gone: the replica stops, the entry is
    │                                reclaimed elsewhere (never a request failure)
    ├── DeadLetteredError            an entry delivered too often: the stage keeps dying on it
    │   └── StageCrashedError        the stage process died holding it, max_crashes times in a row
    ├── StatusCorruptError           a request's stored status does not parse, or names another request
    ├── DeadlineExceededError        the request's deadline passed
    ├── ChunkTimeoutError            a streamed payload's next chunk did not come (or was not taken) in time
    ├── StreamAbandonedError         a streamed payload's consumer restarted the request under a later
    │   │                            attempt: this producer's run stops, writing nothing
    │   └── UpstreamEndedError       the request ended upstream (its producer failed) while this consumer
    │                                waited for a chunk: it stops, writing nothing
    ├── RequestLostError             the request's record vanished (a Redis without persistence restarted)
    ├── RequestNotFoundError         no such request, and the caller would not wait for it to appear
    └── CancelledRequestError        the client cancelled the request (or gave up waiting, and cancelled it)

What an error does to a request is decided in one place, :data:`OUTCOMES`: error class → the request
state it ends in and what happens to its stream entry.  The stage worker maps every error it meets
through :func:`outcome_of` (its only boundary), and the gateway's HTTP statuses key off the same classes
(``gateway/errors.py``), so a new error needs one class here and, where its default is wrong, one row.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from stageferry.schemas.status import RequestState


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


class PayloadContractError(RejectedError):
    """A payload that does not follow the consumer stage's input contract (``schemas/payload_contract``).

    Raised by the consumer leader before the payload is fanned out (and by a model that reads its input
    through the contract), so that a producer's mistake ends ``rejected`` naming the entry — never
    ``failed`` deep inside a model.  ``details["field_errors"]`` holds ``{"field", "message", "type"}``
    per violation, like :class:`JobValidationError`'s."""

    code = "payload_contract"

    @classmethod
    def of(cls, errors: list[tuple[str, str, str]], **details: Any) -> PayloadContractError:
        """One error from ``(entry, message, type)`` triples; the message is the first one's line."""
        field_errors = [field_error(f, m, t) for f, m, t in errors]
        first = field_errors[0] if field_errors else {"field": "payload", "message": "breaks the contract"}
        more = f" (+{len(field_errors) - 1} more)" if len(field_errors) > 1 else ""
        return cls(f"{first['field']}: {first['message']}{more}", field_errors=field_errors, **details)

    @property
    def field_errors(self) -> list[dict[str, Any]]:
        return list(self.details.get("field_errors", []))


class SubmissionRefusedError(RejectedError):
    """A client's entry that the first stage refused *before* trusting its request id: nothing is written
    under that id (it may be someone else's); the refusal is recorded under the entry's stream id."""

    code = "submission_refused"


class InvalidRequestIdError(SubmissionRefusedError):
    code = "invalid_request_id"


class TenantMismatchError(SubmissionRefusedError):
    code = "tenant_mismatch"


class RequestIdTakenError(RejectedError):
    """The id is already the record of a different job.  Its owner's state, result and events stay as
    they are; the second submitter learns of the conflict (never someone else's result)."""

    code = "request_id_taken"


class ControlPlaneError(StageferryError):
    code = "control_plane"


class QueueFullError(ControlPlaneError):
    code = "queue_full"


class NotReplicatedError(ControlPlaneError):
    """A submission is on the master but on fewer replicas than ``wait_replicas`` asks within
    ``wait_timeout_ms``: a failover now could lose it, so it is not acknowledged.  Submitting it again
    (same id) is safe, and is what the client does while it rides through a failover."""

    code = "not_replicated"


class AccessDeniedError(ControlPlaneError):
    """Wrong or missing password, or an ACL that forbids a command or key: retrying cannot help."""

    code = "access_denied"


class DataPlaneError(StageferryError):
    code = "data_plane"


class NixlUnavailableError(DataPlaneError):
    code = "nixl_unavailable"


class HandshakeError(DataPlaneError):
    code = "handshake_failed"


class ProtocolMismatchError(HandshakeError):
    """The peer's agent record or request is of another side-channel protocol version
    (:data:`stageferry.schemas.nixl.NIXL_PROTOCOL_VERSION`): refused before any native call."""

    code = "protocol_mismatch"


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


class DeadLetteredError(StageferryError):
    """The entry was delivered more than ``limits.max_deliveries`` times: whatever runs it keeps dying."""

    code = "dead_lettered"


class StageCrashedError(DeadLetteredError):
    """The stage's process died while holding this request, ``limits.max_crashes`` times in a row (an
    out-of-memory kill, a native crash): the entry is dead-lettered so that it cannot take down every
    replica in turn."""

    code = "stage_crashed"


class StatusCorruptError(StageferryError):
    """A request's record holds a status that does not parse, or that names another request (a record
    is data in Redis, written by anyone with a stage's credentials): nothing is read from it, and a stage
    that meets it dead-letters its entry."""

    code = "status_corrupt"


class DeadlineExceededError(StageferryError):
    code = "deadline_exceeded"


class ChunkTimeoutError(StageferryError):
    """A streamed payload stalled: its next chunk was not announced within ``streaming.chunk_timeout_s``
    (consumer side), or the consumer applied none for ``streaming.producer_wait_s`` (producer side).  Ends
    the request ``failed``: a chunk is never waited for forever."""

    code = "chunk_timeout"


class StreamAbandonedError(StageferryError):
    """The consumer of a streamed payload started the request again under a later attempt (it lost chunks
    it had taken): the producer's run of the old attempt stops, and its entry is acknowledged without a
    status (the new attempt owns the request)."""

    code = "stream_abandoned"


class UpstreamEndedError(StreamAbandonedError):
    """A streamed payload's consumer waited for its next chunk while the request ended upstream (its
    producer failed, and that ended it): it stops at once, rather than at ``chunk_timeout_s`` with its
    stage held, and its entry is acknowledged without a status (the request has its own already)."""

    code = "upstream_ended"


class RequestLostError(StageferryError):
    """A waited-on request's record (and its submission marker) disappeared: Redis lost it.  At a stage:
    the entry in hand is no longer held (:mod:`stageferry.broker.control.held`), and its request is ended
    ``failed`` with this code only when nothing else holds it (``broker/control/record_loss``)."""

    code = "request_lost"


class RequestNotFoundError(StageferryError):
    """A wait that must not outlast an unknown id (``exists_within``, ``stageferry wait``): no such
    request — unknown, or expired."""

    code = "not_found"


class CancelledRequestError(StageferryError):
    """The client cancelled the request; a model raises it to stop between steps (see the sampler)."""

    code = "cancelled"


def leaf_errors(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, task-group nesting (``ExceptionGroup``) flattened away."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in leaf_errors(sub)]
    return [exc]


def expected_error(exc: BaseException) -> StageferryError | None:
    """The :class:`StageferryError` that ``exc`` is or that a task group wrapped it in (the first, when
    several tasks failed at once), else None: what a boundary reports as one line instead of a traceback."""
    return next((leaf for leaf in leaf_errors(exc) if isinstance(leaf, StageferryError)), None)


def error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> StageferryError:
    """Rebuild a typed error from its code (a follower raising the leader's error, for instance)."""
    cls = error_class(code)
    error = cls.__new__(cls)
    StageferryError.__init__(error, message, **(details or {}))
    return error


def field_error(field: str, message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """One entry of a rejection's ``field_errors``: ``{"field": "a.b", "message": ..., "type": ...}``.

    The one builder of that shape (schemas, client, CLI, stages and the gateway all use it), so that every
    client sees the same three keys whichever boundary refused its input; ``extra`` adds facts a client
    can act on (an over-budget error's ``limit``: the deployment's value)."""
    return {"field": field, "message": message, "type": kind, **extra}


class EntryAction(enum.StrEnum):
    """What the stage worker does with the stream entry once an error decided the request's outcome."""

    ACK = "ack"  #: acknowledge and delete it: the request has its outcome
    DEAD_LETTER = "dead_letter"  #: move it to the stage's dead-letter stream, with the error code
    RECOMPUTE = "recompute"  #: hand the request back upstream (its payload is gone); failed past the limit
    KEEP = "keep"  #: leave it pending, write nothing: the replica stops and another one reclaims it
    #: not this replica's any more (reclaimed elsewhere, or lost with Redis): touch nothing, and end the
    #: request ``request_lost`` only if nothing else can (no record, no entry: ``broker/control/record_loss``)
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A request's end as decided by an error class."""

    state: RequestState | None  #: the terminal state written (``None``: nothing is written, see KEEP and refusals)
    entry: EntryAction
    label: str  #: the ``outcome`` label of ``stageferry_entries_total``


#: Error class → outcome; a class not listed takes its nearest listed base's (the root: ``failed``).
OUTCOMES: Mapping[type[StageferryError], Outcome] = MappingProxyType(
    {
        StageferryError: Outcome(RequestState.FAILED, EntryAction.ACK, "failed"),
        RejectedError: Outcome(RequestState.REJECTED, EntryAction.ACK, "rejected"),
        EnvelopeError: Outcome(RequestState.REJECTED, EntryAction.DEAD_LETTER, "rejected"),
        ManifestError: Outcome(RequestState.REJECTED, EntryAction.DEAD_LETTER, "rejected"),
        PayloadContractError: Outcome(RequestState.REJECTED, EntryAction.DEAD_LETTER, "rejected"),
        SubmissionRefusedError: Outcome(None, EntryAction.DEAD_LETTER, "refused"),
        RequestIdTakenError: Outcome(None, EntryAction.DEAD_LETTER, "id_taken"),
        DataPlaneError: Outcome(RequestState.FAILED, EntryAction.RECOMPUTE, "recomputed"),
        GroupBrokenError: Outcome(None, EntryAction.KEEP, "group_broken"),
        DeadLetteredError: Outcome(RequestState.FAILED, EntryAction.DEAD_LETTER, "dead_lettered"),
        StatusCorruptError: Outcome(RequestState.FAILED, EntryAction.DEAD_LETTER, "dead_lettered"),
        DeadlineExceededError: Outcome(RequestState.FAILED, EntryAction.ACK, "deadline_exceeded"),
        StreamAbandonedError: Outcome(None, EntryAction.ACK, "stream_abandoned"),
        CancelledRequestError: Outcome(RequestState.CANCELLED, EntryAction.ACK, "cancelled"),
        RequestLostError: Outcome(RequestState.FAILED, EntryAction.DROP, "lost"),
    }
)


def outcome_of(error: StageferryError | type[StageferryError]) -> Outcome:
    """The outcome of ``error`` (an instance or a class): its own row, else its nearest base's."""
    cls = error if isinstance(error, type) else type(error)
    return next(OUTCOMES[c] for c in cls.__mro__ if c in OUTCOMES)


def error_classes() -> list[type[StageferryError]]:
    """Every error class, the root first (subclasses defined elsewhere included)."""
    classes: list[type[StageferryError]] = [StageferryError]
    i = 0
    while i < len(classes):
        classes += [c for c in classes[i].__subclasses__() if c not in classes]
        i += 1
    return classes


def error_class(code: str) -> type[StageferryError]:
    """The class whose ``code`` this is (the root for an unknown code): statuses carry codes, not classes."""
    return next((c for c in error_classes() if c.code == code), StageferryError)
