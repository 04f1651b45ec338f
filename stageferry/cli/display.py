"""What the CLI shows people: a request's live progress, its final status, and one-line errors.

Kept apart from ``cli.py`` so that ``stageferry submit --wait`` and ``stageferry up`` render the same
way.  Progress goes to stderr, so that stdout carries only the result (ids, JSON) for scripts.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from types import TracebackType

import anyio
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from stageferry.broker.control.liveness import unheld_note
from stageferry.client import Client
from stageferry.errors import ControlPlaneError, JobValidationError, StageferryError
from stageferry.schemas import RequestState, RequestStatus, StageTiming, Transport
from stageferry.trace.events import TraceEvent

#: How the console names a stage's phases after its steps (others are shown as reported).
PHASES = {"decode": "decoding", "mux": "writing the MP4"}
#: How often :func:`follow` checks that a live worker can hold the request (one HGETALL).
LIVENESS_EVERY_S = 5.0


class RequestProgress:
    """A live line per request: state, stage and denoising step, fed with :class:`TraceEvent`s."""

    def __init__(self, console: Console, request_id: str) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[step]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self._request_id = request_id
        self._task: TaskID | None = None
        self._state = "queued"
        self._stage = "-"
        self._note: str | None = None

    def __enter__(self) -> RequestProgress:
        self._progress.__enter__()
        self._task = self._progress.add_task(self._description(), total=None, step="")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.__exit__(exc_type, exc, tb)

    def _description(self) -> str:
        note = f"  ({self._note})" if self._note else ""
        return f"{self._request_id}  {self._state:<9} {self._stage:<10}{note}"

    def on_note(self, note: str | None) -> None:
        """Show (or, with ``None``, clear) a note after the state, e.g. that no live worker holds it."""
        if self._task is not None:
            self._note = note
            self._progress.update(self._task, description=self._description())

    def on_event(self, event: TraceEvent) -> None:
        """Update from one event: status rows set state/stage/step, log rows with ``step`` set the step."""
        if self._task is None:
            return
        step: int | None = None
        total: int | None = None
        phase: str | None = None
        stage = self._stage
        status = event.status
        if status is not None:
            self._state = status.state.value
            stage = status.stage or stage
            if status.progress is not None:
                stage = status.progress.stage or stage
                step, total, phase = status.progress.step, status.progress.total, status.progress.phase
        elif "step" in event.raw and "total" in event.raw:
            stage = event.stage or stage
            step, total = int(event.raw["step"]), int(event.raw["total"])
        if stage != self._stage:  # a new stage starts from an empty bar: no step of the previous one lingers
            self._stage = stage
            self._progress.update(self._task, completed=0, total=None, step="")
        if step is not None and total:
            label = f"{stage} step {step}/{total}"
            if phase:
                label = f"{stage} {PHASES.get(phase, phase)} (after step {step}/{total})"
            self._progress.update(self._task, completed=step, total=total, step=label)
        if status is not None and status.state is RequestState.DONE:  # no phase of a finished stage lingers
            self._progress.update(self._task, completed=1, total=1, step=f"{stage} done")
        self._progress.update(self._task, description=self._description())


async def follow(client: Client, request_id: str, *, timeout: float | None, console: Console) -> RequestStatus:
    """Wait for ``request_id`` while showing its progress; the final status."""
    with RequestProgress(console, request_id) as view:
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_liveness, client, request_id, view)
            try:
                status = await client.wait_with_events(request_id, view.on_event, timeout=timeout)
            except Exception as exc:  # raised as it is, not wrapped in the task group's ExceptionGroup
                failure = exc
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure
        view.on_note(None)
        return status


async def _watch_liveness(client: Client, request_id: str, view: RequestProgress) -> None:
    """Every :data:`LIVENESS_EVERY_S`: note on the line when the request waits on a stage with no live
    worker (its status alone still says running); Redis trouble skips a round."""
    while True:
        await anyio.sleep(LIVENESS_EVERY_S)
        try:
            status = await client.status(request_id)
            view.on_note(await unheld_note(client.redis, client.keys, status) if status is not None else None)
        except ControlPlaneError:
            continue


def render_status(status: RequestStatus) -> str:
    """The final status for people: outcome, output, and a per-stage table with each hop's transport."""
    lines = [f"request {status.request_id}: {status.state.value}"]
    if status.result is not None:
        r = status.result
        lines.append(f"output: {r.location}  ({r.bytes:,} bytes, sha256 {r.sha256[:16] or '-'})")
    if status.error is not None:
        lines.append(f"error [{status.error.code}]: {status.error.message}")
        for fe in status.error.details.get("field_errors", []) or []:
            lines.append(f"  {fe.get('field')}: {fe.get('message')}")
    if status.timings:
        lines.append(
            f"{'stage':<12} {'seconds':>9}  {'input from':<12} {'via':<10} {'payload':>12} {'transfer s':>10}  route"
        )
        previous = "client"
        for t in status.timings:
            lines.append(
                f"{t.stage:<12} {t.seconds:>9.3f}  {previous:<12} {t.transport.value:<10} "
                f"{t.payload_bytes:>12,} {t.transfer_seconds:>10.4f}" + (f"  {t.route}" if t.route else "")
            )
            previous = t.stage
    return "\n".join(lines)


def render_hops(first: RequestStatus, warm: Sequence[RequestStatus], reprompted: Sequence[RequestStatus] = ()) -> str:
    """Each hop's payload transfer in the first request against the same job run again (warm): the first
    one used to pay the peers' handshake (issue 39).  ``warm ms``: the median over the warm runs; in ms
    with µs shown, since a warm hop on one GPU takes a tenth of a millisecond.

    With ``reprompted`` runs (the job again, each with a prompt of another length), two more columns: their
    median and the first hop's ratio to it.  A payload's structure follows its prompt (the text states'
    length), and a warm run of the very same job finds its payload's views made ahead and its structure
    checked already (``nixl/ready.py``), which a new structure cannot: what a stage serving varied prompts
    sees on most hops, and the fair mark for a first hop once the peers' cold costs are gone."""
    head = f"{'hop':<26} {'payload':>12} {'first ms':>9} {'warm ms':>9} {'first/warm':>10}"
    lines = [head + (f" {'new prompt ms':>13} {'first/new':>9}" if reprompted else "")]
    previous = "client"
    for t in first.timings:
        hop = f"{previous} → {t.stage}"
        previous = t.stage
        if t.transport is Transport.NONE:
            continue
        typical = _median_transfer(warm, t.stage)
        if typical is None:
            continue
        first_ms = t.transfer_seconds * 1e3
        row = f"{hop:<26} {t.payload_bytes:>12,} {first_ms:>9.3f} {typical * 1e3:>9.3f} {_ratio(t, typical):>10}"
        if reprompted:
            other = _median_transfer(reprompted, t.stage)
            row += f" {other * 1e3:>13.3f} {_ratio(t, other):>9}" if other is not None else f" {'-':>13} {'-':>9}"
        lines.append(row)
    return "\n".join(lines) if len(lines) > 1 else ""


def _median_transfer(runs: Sequence[RequestStatus], stage: str) -> float | None:
    """The median payload transfer into ``stage`` over ``runs`` (None: none of them reached it)."""
    again = [w.transfer_seconds for s in runs for w in s.timings if w.stage == stage]
    return statistics.median(again) if again else None


def _ratio(first: StageTiming, typical: float | None) -> str:
    return f"{first.transfer_seconds / typical:.2f}×" if typical else "-"


def error_line(exc: StageferryError) -> str:
    """One line for an expected error: ``error [code]: message`` (field errors inline)."""
    if isinstance(exc, JobValidationError) and exc.field_errors:
        fields = "; ".join(f"{e.get('field')}: {e.get('message')}" for e in exc.field_errors)
        return f"error [{exc.code}]: {fields}"
    return f"error [{exc.code}]: {exc.message}"


__all__ = ["RequestProgress", "error_line", "follow", "render_hops", "render_status"]
