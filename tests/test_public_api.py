"""The public surface is exactly this list: a change to it is a deliberate change to this test."""

from __future__ import annotations

import stageferry

PUBLIC = [
    "Client",
    "JobRequest",
    "JobValidationError",  # what Client.submit raises for a bad job (README), and a plug-in raises to refuse one
    "PipelineConfig",
    "RequestState",
    "RequestStatus",
    "Settings",
    "StageferryError",
    "SyncClient",
    "Task",
    "__version__",
]


def test_all_is_pinned_and_sorted() -> None:
    assert stageferry.__all__ == PUBLIC
    assert sorted(stageferry.__all__) == stageferry.__all__


def test_every_public_name_resolves() -> None:
    for name in stageferry.__all__:
        assert getattr(stageferry, name) is not None, name
    assert stageferry.__version__ == "0.1.0"


def test_the_validation_error_is_the_one_submit_raises() -> None:
    from stageferry.errors import JobValidationError

    assert stageferry.JobValidationError is JobValidationError
    error = stageferry.JobValidationError("invalid job: task: no", [{"field": "task", "message": "no", "type": "x"}])
    assert error.code == "invalid_job" and error.field_errors[0]["field"] == "task"
    assert isinstance(error, stageferry.StageferryError)
