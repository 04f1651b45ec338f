"""What the CLI shows while a request runs: the live line names the stage that is working."""

from __future__ import annotations

import io

from rich.console import Console

from stageferry.console import RequestProgress
from stageferry.schemas import Progress, RequestState, RequestStatus
from stageferry.trace import TraceEvent


def status_event(t: float, state: RequestState, stage: str, progress: tuple[int, int] | None = None) -> TraceEvent:
    status = RequestStatus(
        request_id="r",
        state=state,
        stage=stage,
        progress=None if progress is None else Progress(stage=stage, step=progress[0], total=progress[1]),
    )
    return TraceEvent(timestamp=t, event=f"status.{state.value}", kind="status",
                      raw={"state": state.value, "status": status.model_dump(mode="json")})  # fmt: skip


def test_the_line_names_the_stage_and_a_new_stage_starts_empty() -> None:
    view = RequestProgress(Console(file=io.StringIO(), force_terminal=False), "r")
    with view:
        task = view._progress.tasks[0]
        view.on_event(status_event(1, RequestState.RUNNING, "encoder", (1, 3)))
        assert "encoder" in task.description and task.fields["step"] == "encoder step 1/3"
        view.on_event(status_event(2, RequestState.QUEUED, "diffusion"))
        assert "diffusion" in task.description and task.fields["step"] == "" and task.completed == 0
        view.on_event(status_event(3, RequestState.RUNNING, "diffusion", (2, 8)))
        assert task.fields["step"] == "diffusion step 2/8" and task.completed == 2 and task.total == 8
