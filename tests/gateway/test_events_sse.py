"""Event frames and SSE messages from events-stream rows, as XREAD returns them (fields as strings).

The stream itself (XREAD BLOCK, the bound, disconnects) runs against a real deployment in
``test_console.py``; here: what one row becomes, including rows a hostile writer could leave.
"""

from __future__ import annotations

import json

from stageferry.gateway.events_sse import event_frame, sse_message
from stageferry.schemas import Progress, RequestState, RequestStatus
from stageferry.trace.events import parse_row


def status_row(state: RequestState, **fields: object) -> dict[str, str]:
    status = RequestStatus(request_id="r1", state=state, **fields)  # type: ignore[arg-type]
    return {"kind": "status", "state": state.value, "status": status.model_dump_json()}


def test_a_running_status_carries_stage_and_step() -> None:
    row = status_row(RequestState.RUNNING, stage="diffusion", progress=Progress(stage="diffusion", step=3, total=8))
    event = parse_row("1700000000000-1", row)
    assert event is not None
    frame = event_frame(event)
    assert (frame.kind, frame.state, frame.stage, frame.step, frame.total) == ("status", "running", "diffusion", 3, 8)
    assert frame.terminal is False and frame.id == "1700000000000-1"


def test_a_terminal_status_ends_the_stream() -> None:
    event = parse_row("5-0", status_row(RequestState.DONE, stage="diffusion"))
    assert event is not None
    assert event_frame(event).terminal is True


def test_a_log_row_with_a_step() -> None:
    logged = {"event": "denoise.step", "step": "4", "total": 10, "stage": "diffusion", "rank": 1,
              "transport": "nixl", "bytes": 123, "seconds": 0.5, "timestamp": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    event = parse_row("6-0", {"kind": "log", "event": json.dumps(logged)})
    assert event is not None
    frame = event_frame(event)
    assert (frame.kind, frame.step, frame.total, frame.rank, frame.transport, frame.bytes) == (
        "log",
        4,
        10,
        1,
        "nixl",
        123,
    )
    assert frame.state is None and frame.terminal is False


def test_hostile_rows_become_harmless_frames() -> None:
    logged = {"event": "x" * 10, "step": "not a number", "seconds": "nan", "detail": "y" * 10_000,
              "reason": "z" * 10_000}  # fmt: skip
    event = parse_row("7-0", {"kind": "log", "event": json.dumps(logged)})
    assert event is not None
    frame = event_frame(event)
    assert frame.step is None and frame.seconds is None and len(frame.detail) <= 500
    broken = parse_row("8-0", {"kind": "status", "state": "running", "status": "{not json"})
    assert broken is not None
    assert event_frame(broken).state is None  # an unreadable status is shown as an event, not a state


def test_sse_message_is_one_data_line() -> None:
    event = parse_row("9-0", status_row(RequestState.QUEUED, stage="encoder"))
    assert event is not None
    message = sse_message(event_frame(event)).decode()
    lines = message.split("\n")
    assert lines[0] == "id: 9-0" and lines[1] == "event: status" and lines[2].startswith("data: {")
    assert message.endswith("\n\n") and message.count("\n") == 4
    assert json.loads(lines[2][6:])["state"] == "queued"
