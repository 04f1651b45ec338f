"""The stage leader's loop: take an entry, fetch its payload, compute, hand the result on.

One :class:`StageWorker` per stage group, running on the leader (rank 0).  For every entry it:

1. refuses what cannot be processed — an entry delivered too often goes to the dead-letter stream; a
   malformed job, envelope or manifest ends ``rejected`` with field errors (never an internal error);
2. skips what must not run again — a terminal request, a cancelled one, a duplicate submission (the
   run-owner key binds one stream entry to each request, stage and attempt);
3. fetches the input payload through the input connector (consumer side), runs the model through the
   group's :class:`Compute` while renewing its claim on the entry, and
4. puts the output through the output connector (producer side) and hands the envelope on in one
   ownership-checked Lua script — or, on the last stage, stores the result and writes ``done`` once.

A payload that can no longer be fetched sends the request back to the previous stage to be computed
again, up to ``limits.max_recomputes``.
"""

from __future__ import annotations

import functools
import hashlib
import random
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import is_connection_error, translated
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import Entry, StageStream
from stageferry.broker.data import metrics
from stageferry.broker.data.connector import Connector, Incoming, holding
from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import (
    ControlPlaneError,
    DataPlaneError,
    EnvelopeError,
    GroupBrokenError,
    ManifestError,
    PayloadUnavailableError,
    RejectedError,
    StageFailedError,
    StageferryError,
)
from stageferry.failpoints import PRODUCER_PUBLISHED, failpoint
from stageferry.logs import bound_request
from stageferry.schemas import (
    DeviceKind,
    Envelope,
    ErrorInfo,
    JobRequest,
    Manifest,
    NoPayload,
    OutputInfo,
    Progress,
    RequestState,
    RequestStatus,
    StageTiming,
    Transport,
    request_key,
)
from stageferry.schemas.job import REQUEST_ID_PATTERN
from stageferry.schemas.validation import check_job_limits, parse_envelope, parse_job
from stageferry.stages.media import load_media
from stageferry.stages.model import FinalOutput

log = structlog.get_logger(__name__)
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class WorkItem:
    """What the group computes for one request (broadcast to followers by a TP group)."""

    job: JobRequest
    payload: Any
    request_id: str
    key: str
    media: dict[str, bytes] = field(default_factory=dict)
    manifest: Manifest | None = None
    regions: Mapping[DeviceKind, Any] | None = None


class Compute(Protocol):
    """How the leader gets its group to run the model (one rank: a thread; TP: fan-out first)."""

    async def __call__(self, item: WorkItem, progress: ProgressSink) -> Any:
        """Run the model on every rank; the leader's output, or a typed error."""

    async def abort(self, request_id: str, key: str, error: StageferryError) -> None:
        """The leader could not get the payload: tell the other ranks (they raise the same error)."""

    async def idle(self) -> None:
        """Called between entries when nothing came: keep the group's collectives alive."""

    async def close(self) -> None:
        """The leader stops: release the other ranks."""


class ProgressSink:
    """Collects step progress from the model thread; the worker publishes the latest every so often."""

    def __init__(self) -> None:
        self.latest: tuple[int, int] | None = None
        self.cancelled = False

    def report(self, step: int, total: int) -> None:
        self.latest = (step, total)


class StageWorker:
    """Leader-side processing of one stage's stream entries."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        pipeline: PipelineConfig,
        stage: StageConfig,
        replica: str,
        compute: Compute,
        input_connector: Connector | None,
        output_connector: Connector | None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.pipeline = pipeline
        self.stage = stage
        self.replica = replica
        self.compute = compute
        self.input_connector = input_connector
        self.output_connector = output_connector
        self.index = pipeline.index_of(stage.name)
        self.next_stage = pipeline.next_stage(stage.name)
        self.previous_stage = pipeline.previous_stage(stage.name)
        timeouts = pipeline.timeouts
        self.stream = StageStream(
            redis,
            keys,
            stage.name,
            f"{stage.name}-{replica}",
            visibility_ms=int(timeouts.visibility * 1000),
            dlq_maxlen=pipeline.retention.dlq_maxlen,
            max_entry_bytes=pipeline.limits.max_entry_bytes,
        )
        self.store = RequestStore(
            redis, keys, ttl_s=pipeline.retention.request_ttl_s, events_maxlen=pipeline.retention.events_maxlen
        )
        self._stopping = False
        self.processed = 0

    # ---------------------------------------------------------------- service loop

    def stop(self) -> None:
        """Finish the entry in hand, then return from :meth:`run` (drain on SIGTERM)."""
        self._stopping = True

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Process entries until :meth:`stop`; raises :class:`ControlPlaneError` if Redis stays away
        longer than ``timeouts.redis_unreachable`` (so a supervisor restarts the process)."""
        await self._with_redis_retry(self.stream.ensure_group)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            task_status.started()
            log.info("worker.started", stage=self.stage.name, consumer=self.stream.consumer)
            while not self._stopping:
                entries = await self._with_redis_retry(functools.partial(self.stream.read, 1, block_ms=500))
                for entry in entries or []:
                    await self._with_redis_retry(functools.partial(self.process, entry))
                if not entries:
                    await self.compute.idle()
            tg.cancel_scope.cancel()
        await self._deregister()
        log.info("worker.stopped", stage=self.stage.name, processed=self.processed)

    async def _with_redis_retry(self, op: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``op``, retrying connection failures with jittered backoff up to the unreachable bound."""
        first_failure: float | None = None
        delay = 0.1
        while True:
            try:
                return await op()
            except ControlPlaneError as exc:
                if not is_connection_error(exc):
                    raise
                now = time.monotonic()
                first_failure = first_failure or now
                if now - first_failure > self.pipeline.timeouts.redis_unreachable:
                    log.error("worker.redis_gone", seconds=round(now - first_failure, 1), error=exc.message)
                    raise
                log.warning("worker.redis_retry", error=exc.message, retry_in=round(delay, 2))
                await anyio.sleep(delay)
                delay = min(5.0, delay * 2) * (0.5 + random.random())
                if self._stopping and first_failure and now - first_failure > 5:
                    raise

    async def _heartbeat(self) -> None:
        """Advertise this replica as live (health checks and ``stageferry up`` read it)."""
        key = self.keys.workers(self.stage.name)
        while True:
            try:
                with translated():
                    await self.redis.hset(key, self.stream.consumer, str(time.time()))
                    await self.redis.expire(key, 3600)
            except ControlPlaneError as exc:
                log.warning("worker.heartbeat_failed", error=exc.message)
            await anyio.sleep(2.0)

    async def _deregister(self) -> None:
        with anyio.move_on_after(2, shield=True):
            try:
                with translated():
                    await self.redis.hdel(self.keys.workers(self.stage.name), self.stream.consumer)
            except ControlPlaneError:
                pass

    # ---------------------------------------------------------------- one entry

    async def process(self, entry: Entry) -> None:
        """Handle one entry to a definite outcome; Redis connection errors propagate (entry stays pending)."""
        try:
            rid = entry.text("request_id") or ""
        except UnicodeDecodeError:
            rid = ""
        if not _REQUEST_ID.match(rid):
            metrics.ENTRIES.labels(self.stage.name, "dead_lettered").inc()
            await self.stream.dead_letter(entry, reason="missing or invalid request_id", error_code="invalid_envelope")
            return
        with bound_request(rid, stage=self.stage.name, rank=0):
            try:
                await self._process(entry, rid)
            except GroupBrokenError:
                raise  # leave the entry pending: the replica stops and another one reclaims it
            except ControlPlaneError as exc:
                if is_connection_error(exc):
                    raise
                log.exception("worker.control_plane_error", entry=entry.id)
                await self._fail(entry, rid, exc)
            except Exception as exc:  # a bug must not take the worker down nor lose the request
                log.exception("worker.internal_error", entry=entry.id)
                await self._fail(entry, rid, StageFailedError(f"internal error: {type(exc).__name__}: {exc}"))
        self.processed += 1

    async def _process(self, entry: Entry, rid: str) -> None:
        limits = self.pipeline.limits
        if entry.deliveries > limits.max_deliveries:
            reason = f"delivered {entry.deliveries} times (limit {limits.max_deliveries}); the stage keeps dying on it"
            await self._finish(rid, RequestState.FAILED, error=ErrorInfo(code="dead_lettered", message=reason))
            metrics.ENTRIES.labels(self.stage.name, "dead_lettered").inc()
            await self.stream.dead_letter(entry, reason=reason, error_code="dead_lettered")
            return
        try:
            envelope = self._parse(entry, rid)
        except RejectedError as exc:
            await self._reject(entry, rid, exc)
            return
        with structlog.contextvars.bound_contextvars(key=envelope.key, attempt=envelope.attempt):
            await self._run(entry, rid, envelope)

    async def _run(self, entry: Entry, rid: str, envelope: Envelope) -> None:
        """Everything after parsing: skip what is settled, fetch, compute, hand on."""
        if await self._already_settled(entry, envelope):
            return
        try:
            media = await self._load_media(envelope)
        except RejectedError as exc:
            await self._reject(entry, rid, exc)
            return
        await self._set_running(envelope, None)
        started = time.perf_counter()
        try:
            async with self._fetch(envelope, entry) as incoming:
                progress = ProgressSink()
                output = await self._compute_holding_claim(entry, envelope, incoming, progress, media)
        except ManifestError as exc:
            await self.compute.abort(rid, envelope.key, exc)
            await self._reject(entry, rid, exc)
            return
        except DataPlaneError as exc:  # the payload is gone or cannot be fetched: compute it again upstream
            await self.compute.abort(rid, envelope.key, exc)
            await self._recompute(entry, envelope, exc)
            return
        except GroupBrokenError:
            raise
        except StageferryError as exc:
            await self._fail(entry, rid, exc)
            return
        if progress.cancelled or await self.store.is_cancelled(rid):
            await self._cancelled(entry, rid)
            return
        timing = StageTiming(
            stage=self.stage.name,
            seconds=time.perf_counter() - started,
            transport=incoming.transport,
            payload_bytes=incoming.nbytes,
            transfer_seconds=incoming.seconds,
        )
        metrics.STAGE_SECONDS.labels(self.stage.name).observe(timing.seconds)
        if self.next_stage is None:
            await self._store_result(entry, envelope, output, timing)
        else:
            await self._hand_on(entry, envelope, output, timing)

    def _parse(self, entry: Entry, rid: str) -> Envelope:
        """The entry as an envelope: clients send a bare ``job`` to the first stage, stages send envelopes."""
        limit = self.pipeline.limits.max_entry_bytes
        if entry.too_large is not None:  # measured inside Redis; its bytes were never read
            raise EnvelopeError("entry too large", bytes=entry.too_large, limit=limit)
        if sum(len(v) for v in entry.fields.values()) > limit:
            raise EnvelopeError("entry too large", limit=limit)
        if "envelope" in entry.fields:
            envelope = parse_envelope(entry.fields["envelope"])
            if envelope.request_id != rid or envelope.to_stage != self.stage.name:
                raise EnvelopeError("envelope does not match its entry", request_id=rid, to_stage=envelope.to_stage)
            if envelope.payload.kind != "none" and envelope.from_stage != getattr(self.previous_stage, "name", None):
                raise EnvelopeError("a payload may only come from the previous stage", from_stage=envelope.from_stage)
        elif "job" in entry.fields and self.index == 0:
            job = parse_job(entry.fields["job"])
            envelope = Envelope(
                request_id=rid,
                key=request_key(rid, -1),
                from_stage="client",
                to_stage=self.stage.name,
                job=job,
                deadline=time.time() + self.pipeline.timeouts.request,
            )
        else:
            raise EnvelopeError("entry has neither a job nor an envelope field", fields=sorted(entry.fields)[:10])
        check_job_limits(
            envelope.job,
            max_steps=self.pipeline.limits.max_steps,
            max_prompt_chars=self.pipeline.limits.max_prompt_chars,
            lora_adapters=self.pipeline.limits.lora_adapters,
            upload_prefix=self.keys.upload_prefix(),
        )
        return envelope

    async def _already_settled(self, entry: Entry, envelope: Envelope) -> bool:
        """Ack and skip entries whose request is finished, cancelled, expired or a duplicate run."""
        rid = envelope.request_id
        status = await self.store.get(rid)
        if status is not None and status.state.terminal:
            log.info("worker.skip_terminal", entry=entry.id, state=status.state.value)
            await self._release_input(envelope)
            await self.stream.ack(entry.id)
            return True
        if await self.store.is_cancelled(rid):
            await self._release_input(envelope)
            await self._cancelled(entry, rid)
            return True
        if envelope.deadline is not None and time.time() > envelope.deadline:
            await self._release_input(envelope)
            error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed")
            await self._finish(rid, RequestState.FAILED, error=error)
            await self.stream.ack(entry.id)
            return True
        owner_key = self.keys.run_owner(rid, self.stage.name, envelope.attempt)
        with translated():
            claimed = await self.redis.set(owner_key, entry.id, nx=True, ex=self.pipeline.retention.request_ttl_s)
            owner = None if claimed else await self.redis.get(owner_key)
        if not claimed and owner is not None and owner.decode() != entry.id:
            log.info("worker.skip_duplicate", entry=entry.id, owner=owner.decode())
            metrics.ENTRIES.labels(self.stage.name, "duplicate").inc()
            await self.stream.ack(entry.id)
            return True
        return False

    async def _release_input(self, envelope: Envelope) -> None:
        """A skipped envelope's payload is not needed: let the producer free it now."""
        if self.input_connector is not None:
            await self.input_connector.discard(envelope.payload)

    def _fetch(self, envelope: Envelope, entry: Entry) -> Any:
        if envelope.payload.kind == "none" or self.input_connector is None:
            return holding(Incoming(payload=None, transport=Transport.NONE, nbytes=0, seconds=0.0))
        return self.input_connector.get(envelope.payload, entry.fields.get("blob"), key=envelope.key)

    async def _load_media(self, envelope: Envelope) -> dict[str, bytes]:
        """The first stage reads and checks the job's media (bad media is a rejection, not a failure)."""
        if self.index != 0:
            return {}
        limits = self.pipeline.limits
        loaded = await load_media(
            envelope.job,
            redis=self.redis,
            upload_prefix=self.keys.upload_prefix(),
            max_bytes=limits.max_upload_bytes,
            min_audio_s=limits.min_reference_audio_s,
        )
        return loaded.items

    async def _compute_holding_claim(
        self, entry: Entry, envelope: Envelope, incoming: Incoming, progress: ProgressSink, media: dict[str, bytes]
    ) -> Any:
        """Run the model while renewing the entry's claim and publishing progress."""
        item = WorkItem(
            job=envelope.job,
            payload=incoming.payload,
            request_id=envelope.request_id,
            key=envelope.key,
            media=media,
            manifest=incoming.manifest,
            regions=incoming.regions,
        )
        result: list[Any] = []
        failure: list[Exception] = []

        async def run_model() -> None:
            try:
                result.append(await self.compute(item, progress))
            except Exception as exc:  # re-raised below as itself, not wrapped in an ExceptionGroup
                failure.append(exc)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_model)
            tg.start_soon(self._keep_claim, entry, envelope, progress)
        if failure:
            raise failure[0]
        return result[0]

    async def _keep_claim(self, entry: Entry, envelope: Envelope, progress: ProgressSink) -> None:
        """Renew the entry's claim and publish progress while the model runs.  Redis trouble here is
        logged and retried on the next round: it must not fail a job that is computing fine."""
        every = self.pipeline.timeouts.claim_renew_every
        published: tuple[int, int] | None = None
        next_renew = time.monotonic() + every
        while True:
            await anyio.sleep(0.25)
            try:
                if progress.latest != published and progress.latest is not None:
                    step, total = progress.latest
                    await self._set_running(envelope, Progress(stage=self.stage.name, step=step, total=total))
                    published = (step, total)
                if time.monotonic() >= next_renew:
                    if not await self.stream.renew(entry.id):
                        log.warning("worker.claim_lost", entry=entry.id)
                    progress.cancelled = await self.store.is_cancelled(envelope.request_id)
                    next_renew = time.monotonic() + every
            except ControlPlaneError as exc:
                log.warning("worker.renew_failed", entry=entry.id, error=exc.message)

    # ---------------------------------------------------------------- outcomes

    async def _hand_on(self, entry: Entry, envelope: Envelope, output: Any, timing: StageTiming) -> None:
        assert self.next_stage is not None and self.output_connector is not None
        key = request_key(envelope.request_id, self.index)
        try:
            outgoing = await self.output_connector.put(key, output, force_inline=envelope.trace.force_inline)
        except DataPlaneError as exc:  # could not publish it here: compute again, maybe on another replica
            await self._recompute(entry, envelope, exc, target=self.stage)
            return
        log.info(
            "payload.put",
            key=key,
            transport=outgoing.transport.value,
            bytes=outgoing.nbytes,
            seconds=round(outgoing.seconds, 6),
            fallback=outgoing.fallback_reason,
            to_stage=self.next_stage.name,
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
        if not await self.stream.hand_off(entry.id, self.next_stage.name, fields):
            log.warning("worker.handoff_lost", entry=entry.id)
            self.output_connector.abandon(outgoing)
            return
        if outgoing.transport is Transport.NIXL:
            failpoint(PRODUCER_PUBLISHED)  # fault injection: the payload is out, only our pool holds it
        await self._set_status(
            envelope.request_id,
            RequestState.QUEUED,
            stage=self.next_stage.name,
            attempt=envelope.attempt,
            timings=trace.timings,
        )
        metrics.ENTRIES.labels(self.stage.name, "handed_on").inc()

    async def _store_result(self, entry: Entry, envelope: Envelope, output: Any, timing: StageTiming) -> None:
        rid = envelope.request_id
        if not isinstance(output, FinalOutput):
            output = FinalOutput(info={"output_type": type(output).__name__})
        info = await self._persist_output(rid, output)
        written = await self._finish(
            rid, RequestState.DONE, result=info, timings=[*envelope.trace.timings, timing], attempt=envelope.attempt
        )
        await self.stream.ack(entry.id)
        log.info("request.done" if written else "request.done_duplicate", bytes=info.bytes, location=info.location)
        metrics.ENTRIES.labels(self.stage.name, "done").inc()

    async def _persist_output(self, rid: str, output: FinalOutput) -> OutputInfo:
        data = output.data
        if data is None and output.path is not None:
            data = await anyio.Path(output.path).read_bytes()
        data = data or b""
        digest = hashlib.sha256(data).hexdigest()
        redis_key = None
        if len(data) <= self.pipeline.retention.result_inline_max_bytes:
            redis_key = self.keys.result(rid)
            with translated():
                await self.redis.set(redis_key, data, ex=self.pipeline.retention.request_ttl_s, nx=True)
        location = str(await anyio.Path(output.path).resolve()) if output.path is not None else f"redis:{redis_key}"
        return OutputInfo(
            location=location, redis_key=redis_key, bytes=len(data), sha256=digest, media=output.media, data=output.info
        )

    async def _recompute(
        self, entry: Entry, envelope: Envelope, exc: DataPlaneError, *, target: StageConfig | None = None
    ) -> None:
        """Send the request back to be computed again — by default to the previous stage, whose payload
        is gone — up to ``limits.max_recomputes``; then it fails with the data-plane error."""
        rid = envelope.request_id
        recomputes = envelope.trace.recomputes + 1
        target = target or self.previous_stage
        if target is None or recomputes > self.pipeline.limits.max_recomputes:
            await self._fail(entry, rid, exc)
            return
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
        if await self.stream.hand_off(entry.id, target.name, fields):
            await self._set_status(rid, RequestState.QUEUED, stage=target.name, attempt=back.attempt)
            metrics.ENTRIES.labels(self.stage.name, "recomputed").inc()

    async def _reject(self, entry: Entry, rid: str, exc: RejectedError) -> None:
        log.warning("request.rejected", code=exc.code, error=exc.message)
        await self._finish(rid, RequestState.REJECTED, error=ErrorInfo(**exc.to_dict()))
        metrics.ENTRIES.labels(self.stage.name, "rejected").inc()
        if isinstance(exc, EnvelopeError | ManifestError):
            await self.stream.dead_letter(entry, reason=exc.message, error_code=exc.code)
        else:
            await self.stream.ack(entry.id)

    async def _fail(self, entry: Entry, rid: str, exc: StageferryError) -> None:
        log.error("request.failed", code=exc.code, error=exc.message)
        await self._finish(rid, RequestState.FAILED, error=ErrorInfo(**exc.to_dict()))
        metrics.ENTRIES.labels(self.stage.name, "failed").inc()
        await self.stream.ack(entry.id)

    async def _cancelled(self, entry: Entry, rid: str) -> None:
        log.info("request.cancelled")
        error = ErrorInfo(code="cancelled", message="cancelled by the client")
        await self._finish(rid, RequestState.CANCELLED, error=error)
        metrics.ENTRIES.labels(self.stage.name, "cancelled").inc()
        await self.stream.ack(entry.id)

    async def _set_running(self, envelope: Envelope, progress: Progress | None) -> None:
        await self._set_status(
            envelope.request_id,
            RequestState.RUNNING,
            stage=self.stage.name,
            progress=progress,
            attempt=envelope.attempt,
            timings=envelope.trace.timings,
        )

    async def _finish(self, rid: str, state: RequestState, **fields: Any) -> bool:
        """Write a terminal status (once: a second writer finds it terminal and changes nothing)."""
        return await self._set_status(rid, state, stage=self.stage.name, **fields)

    async def _set_status(self, rid: str, state: RequestState, **fields: Any) -> bool:
        status = RequestStatus(request_id=rid, state=state, **fields)
        return await self.store.set_status(status)
