"""The error tree and the error → request-state table: every code has one class, every class an outcome."""

from __future__ import annotations

import pytest

from stageferry import errors
from stageferry.errors import (
    OUTCOMES,
    CancelledRequestError,
    DeadLetteredError,
    DeadlineExceededError,
    EntryAction,
    EnvelopeError,
    GroupBrokenError,
    JobValidationError,
    PayloadContractError,
    PeerDisconnectedError,
    QueueFullError,
    RequestLostError,
    StageFailedError,
    StageferryError,
    error_class,
    error_classes,
    error_from_code,
    field_error,
    outcome_of,
)
from stageferry.schemas import RequestState


def test_codes_are_unique_and_name_their_class() -> None:
    classes = error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), codes
    for cls in classes:
        assert error_class(cls.code) is cls
    assert error_class("no-such-code") is StageferryError


@pytest.mark.parametrize(
    ("error", "state", "entry"),
    [
        (CancelledRequestError("cancelled during denoising", step=3), RequestState.CANCELLED, EntryAction.ACK),
        (DeadLetteredError("delivered 3 times"), RequestState.FAILED, EntryAction.DEAD_LETTER),
        (DeadlineExceededError("the request's deadline passed"), RequestState.FAILED, EntryAction.ACK),
        (JobValidationError("invalid job"), RequestState.REJECTED, EntryAction.ACK),
        (EnvelopeError("invalid envelope"), RequestState.REJECTED, EntryAction.DEAD_LETTER),
        (PayloadContractError.of([("layout", "missing", "missing")]), RequestState.REJECTED, EntryAction.DEAD_LETTER),
        (PeerDisconnectedError("peer went away"), RequestState.FAILED, EntryAction.RECOMPUTE),
        (QueueFullError("full"), RequestState.FAILED, EntryAction.ACK),
        (StageFailedError("model raised"), RequestState.FAILED, EntryAction.ACK),
        (GroupBrokenError("a rank died"), None, EntryAction.KEEP),
        (RequestLostError("no longer held"), RequestState.FAILED, EntryAction.DROP),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, StageferryError) else str(v),
)
def test_outcome_of_each_kind(error: StageferryError, state: RequestState | None, entry: EntryAction) -> None:
    outcome = outcome_of(error)
    assert (outcome.state, outcome.entry) == (state, entry)
    assert outcome_of(type(error)) is outcome


def test_every_class_has_an_outcome_and_the_table_only_names_our_classes() -> None:
    for cls in error_classes():
        assert outcome_of(cls).entry in EntryAction
    assert all(issubclass(cls, StageferryError) for cls in OUTCOMES)
    assert all(getattr(errors, cls.__name__) is cls for cls in OUTCOMES)


def test_cancel_rebuilt_from_its_code_keeps_its_outcome() -> None:
    """A follower re-raises the leader's error from its code: the same class, so the same outcome."""
    rebuilt = error_from_code("cancelled", "cancelled by the client", {"step": 4})
    assert isinstance(rebuilt, CancelledRequestError) and rebuilt.details == {"step": 4}
    assert outcome_of(rebuilt).state is RequestState.CANCELLED


def test_field_error_shape() -> None:
    assert field_error("media.first_frame", "not an image", "bad_media") == {
        "field": "media.first_frame",
        "message": "not an image",
        "type": "bad_media",
    }
