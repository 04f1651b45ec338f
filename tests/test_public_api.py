"""The public surface is exactly this list: a change to it is a deliberate change to this test."""

from __future__ import annotations

import stageferry

PUBLIC = [
    "Client",
    "JobRequest",
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
