"""What the CLI shows while a request runs (the live line names the stage that is working) and at its end
(``render_status``: one line per stage, with the hop's route)."""

from __future__ import annotations

import io

from rich.console import Console

from stageferry.cli.display import RequestProgress, render_hops, render_status
from stageferry.schemas import Progress, RequestState, RequestStatus, StageTiming, Transport
from stageferry.trace.events import TraceEvent


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


def test_a_phase_after_the_steps_is_named() -> None:
    """The decode and mux after the last step (a third of a large request on a CPU) are not "step 8/8"."""
    view = RequestProgress(Console(file=io.StringIO(), force_terminal=False), "r")
    with view:
        task = view._progress.tasks[0]
        for t, phase in ((1, None), (2, "decode"), (3, "mux")):
            status = RequestStatus(request_id="r", state=RequestState.RUNNING, stage="diffusion",
                                   progress=Progress(stage="diffusion", step=8, total=8, phase=phase))  # fmt: skip
            view.on_event(TraceEvent(timestamp=t, event="status.running", kind="status",
                                     raw={"state": "running", "status": status.model_dump(mode="json")}))  # fmt: skip
            assert (
                task.fields["step"]
                == {
                    None: "diffusion step 8/8",
                    "decode": "diffusion decoding (after step 8/8)",
                    "mux": "diffusion writing the MP4 (after step 8/8)",
                }[phase]
            )


def test_each_hop_shows_its_route() -> None:
    route = "VRAM:0→VRAM:1 cuda_ipc, DRAM→DRAM cma"
    hop = StageTiming(
        stage="diffusion",
        seconds=4.5,
        transport=Transport.NIXL,
        payload_bytes=789_504,
        transfer_seconds=0.0014,
        route=route,
    )
    status = RequestStatus(
        request_id="video_sync-1", state=RequestState.DONE, timings=[StageTiming(stage="encoder", seconds=0.5), hop]
    )
    lines = render_status(status).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert lines[0] == "request video_sync-1: done" and lines[header].endswith("route")
    enc, dif = lines[header + 1], lines[header + 2]
    assert enc.split()[:3] == ["encoder", "0.500", "client"] and not enc.endswith("cma")
    assert dif.split()[:6] == ["diffusion", "4.500", "encoder", "nixl", "789,504", "0.0014"]
    assert dif.endswith("  " + route)


def test_each_hop_shows_its_first_transfer_beside_the_warm_ones() -> None:
    """`up --warm-runs N`: the first request's hop against the median of the same job run again."""

    def status(rid: str, transfer: float) -> RequestStatus:
        hop = StageTiming(stage="diffusion", seconds=4.5, transport=Transport.NIXL, payload_bytes=789_504,
                          transfer_seconds=transfer)  # fmt: skip
        return RequestStatus(request_id=rid, state=RequestState.DONE,
                             timings=[StageTiming(stage="encoder", seconds=0.5), hop])  # fmt: skip

    lines = render_hops(status("a", 0.0030), [status("b", 0.0010), status("c", 0.0020), status("d", 0.0040)])
    head, row = lines.splitlines()
    assert head.split() == ["hop", "payload", "first", "ms", "warm", "ms", "first/warm"]
    assert row.split() == ["encoder", "→", "diffusion", "789,504", "3.000", "2.000", "1.50×"]
    assert render_hops(status("a", 0.003), []) == ""  # no warm run ended done: no table


def test_reprompted_runs_get_columns_of_their_own() -> None:
    """`up --warm-runs 4`: the later runs carry longer prompts (payloads of another structure): their
    median and the first hop's ratio to it beside the same-job columns."""

    def status(rid: str, transfer: float | None) -> RequestStatus:
        timings = [StageTiming(stage="encoder", seconds=0.5)]
        if transfer is not None:
            timings.append(StageTiming(stage="diffusion", seconds=4.5, transport=Transport.NIXL,
                                       payload_bytes=789_504, transfer_seconds=transfer))  # fmt: skip
        return RequestStatus(request_id=rid, state=RequestState.DONE, timings=timings)

    table = render_hops(status("a", 0.0030), [status("b", 0.0010)], [status("c", 0.0020), status("d", 0.0025)])
    head, row = table.splitlines()
    assert head.split()[-5:] == ["first/warm", "new", "prompt", "ms", "first/new"], head
    assert row.split()[3:] == ["789,504", "3.000", "1.000", "3.00×", "2.250", "1.33×"], row
    # a reprompted run that never reached the hop leaves its cells empty, not the row out
    row = render_hops(status("a", 0.0030), [status("b", 0.0010)], [status("c", None)]).splitlines()[1]
    assert row.split()[-2:] == ["-", "-"], row
