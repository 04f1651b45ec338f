"""Where a computed request goes next: on to the next stage, into the result store, or back upstream.

* :meth:`HandOn.hand_on` puts the output through the output connector (producer side) and hands the
  envelope on in one ownership-checked Lua script (:meth:`StageStream.hand_off`), which also marks the
  request ``queued`` on the next stage (in the record: the next stage's admission writes that status's
  event with its ``running``) and clears the entry's crash mark;
* :meth:`HandOn.store_result` (last stage) stores the result, writes ``done`` once and acks the entry, in
  one script (:meth:`StageStream.finish`: the cancel flag and the crash mark too);

A cancel that comes while the model runs is seen by the worker's watcher within a step; one that comes
after its last look is seen by the next stage's admission (before it fetches the payload: it lets the
producer free it) or, on the last stage, by the finish script, which writes nothing then.  Neither
costs a round trip of its own.
* :meth:`HandOn.recompute` sends a request whose payload is gone back to be computed again — by default
  to the previous stage — up to ``limits.max_recomputes``; past that it declines and the request fails
  (the outcome table's ``recompute`` row, :mod:`stageferry.stages.entry.outcomes`).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any

import anyio
import structlog

from stageferry.broker.control.streams import LEASE_FIELD, Entry
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Outgoing
from stageferry.config import StageConfig
from stageferry.errors import DataPlaneError, PayloadUnavailableError
from stageferry.failpoints import PRODUCER_PUBLISHED, failpoint
from stageferry.schemas import Envelope, NoPayload, OutputInfo, RequestState, StageTiming, Transport, request_key
from stageferry.stages.entry.entry_guard import CrashMark
from stageferry.stages.entry.leader import Leader
from stageferry.stages.entry.outcomes import Outcomes
from stageferry.stages.model import FinalOutput

log = structlog.get_logger(__name__)


class HandOn:
    """One stage's way out for a request (the leader's; see the module docstring)."""

    def __init__(self, leader: Leader, outcomes: Outcomes) -> None:
        self.leader = leader
        self.keys = leader.keys
        self.pipeline = leader.pipeline
        self.stage = leader.stage
        self.stream = leader.stream
        self.outcomes = outcomes
        self.output_connector = leader.output_connector
        self.index = leader.index
        self.next_stage = leader.next_stage
        self.previous_stage = leader.previous_stage

    def output_tensors(self, envelope: Envelope) -> Callable[[Any], Any] | None:
        """The model's ``StageContext.output_tensors`` for this request (called from the model's thread:
        the output connector's staging runs on the event loop), or None on the last stage."""
        connector = self.output_connector
        if self.next_stage is None or connector is None:
            return None
        stage = functools.partial(
            connector.stage,
            request_key(envelope.request_id, self.index),
            force_inline=envelope.trace.force_inline,
            deadline=envelope.deadline,
        )
        token = anyio.lowlevel.current_token()  # the model thread is not one of anyio's: name the loop
        return lambda template: anyio.from_thread.run(stage, template, token=token)

    def unstage(self, envelope: Envelope) -> None:
        """The request is done with on this stage: free output tensors the model was handed that no put took."""
        if self.next_stage is not None and self.output_connector is not None:
            self.output_connector.unstage(request_key(envelope.request_id, self.index))

    async def hand_on(
        self, entry: Entry, envelope: Envelope, output: Any, timing: StageTiming, *, mark: CrashMark
    ) -> None:
        """Publish ``output`` and hand the request to the next stage.  A put that fails here computes the
        request again on this stage (maybe on another replica), or fails it past the recompute limit.  The
        entry's crash ``mark`` is cleared by the hand-off's script."""
        assert self.next_stage is not None and self.output_connector is not None
        key = request_key(envelope.request_id, self.index)
        try:
            outgoing = await self.output_connector.put(key, output, force_inline=envelope.trace.force_inline)
        except DataPlaneError as exc:  # could not publish it here: compute again, maybe on another replica
            if not await self.recompute(entry, envelope, exc, target=self.stage):
                await self.outcomes.settle(entry, envelope.request_id, exc)
            return
        log.info(
            "payload.put",
            key=key,
            transport=outgoing.transport.value,
            bytes=outgoing.nbytes,
            seconds=round(outgoing.seconds, 6),
            fallback=outgoing.fallback_reason,
            staged_copies=outgoing.copied if outgoing.staged else None,  # written in place by the model
            to_stage=self.next_stage.name,
            memory=_memory_kinds(outgoing),  # where the payload's regions live (the console's trace shows it)
        )
        trace = envelope.trace.model_copy(
            update={"hop_started_at": time.time(), "timings": [*envelope.trace.timings, timing], "force_inline": False}
        )
        nxt = Envelope(
            request_id=envelope.request_id,
            key=key,
            from_stage=self.stage.name,
            to_stage=self.next_stage.name,
            job=envelope.job,
            payload=outgoing.ref,
            attempt=envelope.attempt,
            deadline=envelope.deadline,
            trace=trace,
        )
        fields: dict[str, bytes | str] = {"request_id": envelope.request_id, "envelope": nxt.model_dump_json()}
        if outgoing.blob is not None:
            fields["blob"] = outgoing.blob
        lease = self.output_connector.lease_of(outgoing.ref)
        if lease is not None:  # claimed by the next stage's stream read (StageStream, LeaseClaim)
            fields[LEASE_FIELD] = lease
        # The next stage's "queued" status is written by the hand-off's own script (one round trip).
        status = self.outcomes.status_write(
            envelope.request_id,
            RequestState.QUEUED,
            stage=self.next_stage.name,
            attempt=envelope.attempt,
            timings=trace.timings,
        )
        handed = await self.stream.hand_off(
            entry.id, self.next_stage.name, fields, status=status, crash_field=mark.field
        )
        mark.cleared = True
        if not handed:  # not held any more: another replica has it, or Redis lost it (then so is the request)
            log.warning("worker.handoff_lost", entry=entry.id)
            self.output_connector.abandon(outgoing)
            await self.outcomes.lost(entry, envelope.request_id)
            return
        if outgoing.transport is Transport.NIXL:
            failpoint(PRODUCER_PUBLISHED)  # fault injection: the payload is out, only our pool holds it
        metrics.ENTRIES.labels(self.stage.name, "handed_on").inc()

    async def store_result(
        self, entry: Entry, envelope: Envelope, output: Any, timing: StageTiming, *, mark: CrashMark
    ) -> None:
        """Store the result (small ones in Redis), write ``done`` once and ack the entry — one script, which
        also looks at the cancel flag (:class:`CancelledRequestError`, nothing written) and clears ``mark``."""
        rid = envelope.request_id
        if not isinstance(output, FinalOutput):
            output = FinalOutput(info={"output_type": type(output).__name__})
        info, data = await self._output_info(rid, output)
        status = self.outcomes.status_write(
            rid,
            RequestState.DONE,
            stage=self.stage.name,
            result=info,
            timings=[*envelope.trace.timings, timing],
            attempt=envelope.attempt,
        )
        acked, written = await self.stream.finish(
            entry.id,
            status=status,
            cancel=self.keys.cancel(rid),
            crash_field=mark.field,
            result_key=self.keys.result(rid),
            result=None if data is None else (data, self.pipeline.retention.request_ttl_s),
        )
        mark.cleared = True
        if not acked:  # not held any more: nothing was written (owned), and the request may be lost
            log.info("request.done_duplicate", bytes=info.bytes, location=info.location, held=False)
            await self.outcomes.lost(entry, rid)
            return
        log.info("request.done" if written else "request.done_duplicate", bytes=info.bytes, location=info.location)
        metrics.ENTRIES.labels(self.stage.name, "done").inc()

    async def _output_info(self, rid: str, output: FinalOutput) -> tuple[OutputInfo, bytes | None]:
        """What the record says of the result, and the bytes to store in Redis (None: it stays a file)."""
        data = output.data
        if data is None and output.path is not None:
            data = await anyio.Path(output.path).read_bytes()
        data = data or b""
        digest = hashlib.sha256(data).hexdigest()
        redis_key = None
        if len(data) <= self.pipeline.retention.result_inline_max_bytes:
            redis_key = self.keys.result(rid)
        location = str(await anyio.Path(output.path).resolve()) if output.path is not None else f"redis:{redis_key}"
        info = OutputInfo(
            location=location, redis_key=redis_key, bytes=len(data), sha256=digest, media=output.media, data=output.info
        )
        return info, data if redis_key is not None else None

    async def recompute(
        self, entry: Entry, envelope: Envelope, exc: DataPlaneError, *, target: StageConfig | None = None
    ) -> bool:
        """Send the request back to be computed again — by default to the previous stage, whose payload
        is gone.  False (nothing done) when there is no such stage or past ``limits.max_recomputes``."""
        rid = envelope.request_id
        recomputes = envelope.trace.recomputes + 1
        target = target or self.previous_stage
        if target is None or recomputes > self.pipeline.limits.max_recomputes:
            return False
        metrics.RECOMPUTES.labels(exc.code).inc()
        log.warning(
            "request.recompute", reason=exc.code, error=exc.message, recomputes=recomputes, to_stage=target.name
        )
        trace = envelope.trace.model_copy(
            update={"recomputes": recomputes, "force_inline": not isinstance(exc, PayloadUnavailableError)}
        )
        back = Envelope(
            request_id=rid,
            key=request_key(rid, self.index),
            from_stage=self.stage.name,
            to_stage=target.name,
            job=envelope.job,
            payload=NoPayload(),
            attempt=envelope.attempt + 1,
            deadline=envelope.deadline,
            trace=trace,
        )
        fields = {"request_id": rid, "envelope": back.model_dump_json()}
        if await self.stream.hand_off(entry.id, target.name, fields):  # then "update": an entry holds it
            await self.outcomes.set_status(
                rid, RequestState.QUEUED, mode="update", stage=target.name, attempt=back.attempt
            )
            metrics.ENTRIES.labels(self.stage.name, "recomputed").inc()
        else:  # not held any more: another replica settles it, or Redis lost it (then so is the request)
            await self.outcomes.lost(entry, rid)
        return True


def _memory_kinds(outgoing: Outgoing) -> list[str]:
    """The device kinds of a payload's regions (``cpu``, ``cuda``); none for a payload-less hand-over."""
    manifest = getattr(outgoing.ref, "manifest", None)
    return [] if manifest is None else [region.device.value for region in manifest.regions]
