"""The stage leader's loop: take an entry, fetch its payload, compute, hand the result on.

One :class:`StageWorker` per stage group, running on the leader (rank 0).  For every entry it:

1. refuses what cannot be processed — an entry delivered too often goes to the dead-letter stream; a
   malformed job, envelope or manifest ends ``rejected`` with field errors (never an internal error);
2. skips what must not run again — a terminal request, a cancelled one, a duplicate submission (the
   record's run-owner field binds one stream entry to each request, stage and attempt);
3. fetches the input payload through the input connector (consumer side), checks it against the model's
   declared input contract (once, here on the leader, before the fan-out: a violation is ``rejected``
   naming the entry), runs the model through the group's :class:`Compute` while renewing its claim on
   the entry, and
4. puts the output through the output connector (producer side) and hands the envelope on in one
   ownership-checked Lua script — or, on the last stage, stores the result and writes ``done`` once.

A payload that can no longer be fetched sends the request back to the previous stage to be computed
again, up to ``limits.max_recomputes``.

Steps 1-2 are :mod:`stageferry.stages.entry.admission`, step 4 :mod:`stageferry.stages.entry.handoff`.  Whatever
goes wrong is raised as a typed error and meets one boundary, :meth:`StageWorker.process`, which ends
the request through the outcome table (:mod:`stageferry.stages.entry.outcomes`, ``errors.OUTCOMES``): a
cancel — seen between entries, at a stage boundary, or by the model between two of its steps — ends
``cancelled``, whichever of them saw it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
import redis.asyncio as aioredis
import structlog

from stageferry.broker.control.client_keys import ClientKeySweeper, client_key_bounds
from stageferry.broker.control.entry_records import Look, StatusWrite
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import is_connection_error, is_transient_error, with_reconnects
from stageferry.broker.control.streams import Entry
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Connector, Incoming, holding
from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import (
    CancelledRequestError,
    ControlPlaneError,
    DataPlaneError,
    GroupBrokenError,
    ManifestError,
    PayloadContractError,
    RejectedError,
    RequestIdTakenError,
    StageFailedError,
    StageferryError,
    expected_error,
)
from stageferry.logs import bound_request
from stageferry.schemas import DeviceKind, Envelope, JobRequest, Manifest, Progress, StageTiming, Transport, request_key
from stageferry.schemas.payload_contract import InputContract
from stageferry.stages.entry.admission import Admission
from stageferry.stages.entry.entry_guard import CrashMark, EntryGuard
from stageferry.stages.entry.handoff import HandOn
from stageferry.stages.entry.leader import build_leader
from stageferry.stages.entry.outcomes import Outcomes
from stageferry.stages.entry.streaming import ChunkStream, Streaming, is_chunked

log = structlog.get_logger(__name__)
T = TypeVar("T")
#: How often the leader looks at the cancel flag (and publishes progress) while the model runs.
WATCH_EVERY_S = 0.1
#: How often, at most, a running request's progress is written to its record.
PUBLISH_EVERY_S = 0.25


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
    #: The leader model's ``StageContext.output_tensors`` (from the model's thread), or None for the default.
    output_tensors: Callable[[Any], Any] | None = None
    #: The leader model's ``StageContext.emit_chunk`` (:mod:`stageferry.stages.entry.streaming`), or None.
    emit_chunk: Callable[..., None] | None = None


class Compute(Protocol):
    """How the leader gets its group to run the model (one rank: a thread; TP: fan-out first)."""

    async def __call__(self, item: WorkItem, progress: ProgressSink) -> Any:
        """Run the model on every rank; the leader's output, or a typed error.  Calls may overlap (a leader
        holding several entries): the group runs them one at a time, in call order."""

    async def abort(self, request_id: str, key: str, error: StageferryError) -> None:
        """The leader could not get the payload: tell the other ranks (they raise the same error)."""

    async def idle(self) -> None:
        """Called between entries when nothing came: keep the group's collectives alive."""

    async def close(self) -> None:
        """The leader stops: release the other ranks."""


class ProgressSink:
    """Between the model thread and the worker: the model reports steps and reads ``cancelled``; the
    worker publishes the latest step and sets ``cancelled`` as soon as it sees the client's flag, so a
    model that checks it per step (``StageContext.is_cancelled``) stops within one step."""

    def __init__(self) -> None:
        self.latest: tuple[int, int, str | None] | None = None
        self.cancelled = False

    def report(self, step: int, total: int, phase: str | None = None) -> None:
        self.latest = (step, total, phase)


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
        input_contract: InputContract | None = None,
    ) -> None:
        leader = build_leader(
            redis=redis,
            keys=keys,
            pipeline=pipeline,
            stage=stage,
            replica=replica,
            input_connector=input_connector,
            output_connector=output_connector,
        )
        self.leader = leader
        self.redis, self.keys, self.pipeline, self.stage = redis, keys, pipeline, stage
        self.replica = replica
        self.compute = compute
        self.input_connector = input_connector
        self.output_connector = output_connector
        self.input_contract = input_contract
        self.previous_stage, self.next_stage = leader.previous_stage, leader.next_stage
        self.heartbeat, self.stream, self.store = leader.heartbeat, leader.stream, leader.store
        self.outcomes = Outcomes(
            stage=stage.name,
            stream=leader.stream,
            store=leader.store,
            refusals=leader.refusals,
            stages=leader.stage_names,
        )
        self.guard = EntryGuard(
            redis=redis,
            keys=keys,
            store=leader.store,
            stage=stage.name,
            limits=pipeline.limits,
            ttl_s=pipeline.retention.request_ttl_s,
            holder=leader.stream.held,
            records=leader.records,
        )
        self.admission = Admission(leader)
        self.hand = HandOn(leader, self.outcomes)
        self.streaming = Streaming(leader)
        bounds = client_key_bounds(
            keys, request_ttl_s=pipeline.retention.request_ttl_s, max_upload_bytes=pipeline.limits.max_upload_bytes
        )
        # the first stage holds the client-written keys to their bounds
        self.sweeper = (
            ClientKeySweeper(redis, bounds, turn=keys.client_sweep(), holder=replica) if leader.first else None
        )
        self._stopping = False
        self.processed = 0

    # ---------------------------------------------------------------- service loop

    def stop(self) -> None:
        """Finish the entry in hand, then return from :meth:`run` (drain on SIGTERM)."""
        self._stopping = True

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Process entries until :meth:`stop`; raises :class:`ControlPlaneError` if Redis stays away
        longer than ``timeouts.redis_unreachable`` (so a supervisor restarts the process).  Asked to stop
        while Redis is away, it gives up after a few seconds and returns: un-acked entries stay pending
        in Redis for another replica, so that is still a clean drain."""
        try:
            await self._serve(task_status)
        except Exception as exc:
            error = expected_error(exc)
            if not (self._stopping and isinstance(error, ControlPlaneError) and is_connection_error(error)):
                raise
            log.warning("worker.stopped_without_redis", stage=self.stage.name, error=error.message)
            return
        finally:
            await self.stream.aclose()
        await self.heartbeat.withdraw()
        log.info("worker.stopped", stage=self.stage.name, processed=self.processed)

    async def _serve(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        await self._with_redis_retry(self.stream.ensure_group)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeat.run)
            await tg.start(self.streaming.run)  # the portal a streaming model's chunks go out through
            if self.sweeper is not None:  # the first stage holds the client-written keys to their bounds
                tg.start_soon(self.sweeper.run)
            task_status.started()
            log.info("worker.started", stage=self.stage.name, consumer=self.stream.consumer)
            await self._serve_entries(self.stage.entries_in_flight)
            tg.cancel_scope.cancel()

    async def _serve_entries(self, most: int) -> None:
        """Hold up to ``most`` entries at once (``StageConfig.entries_in_flight``; 1: read one, process it,
        read the next): each is processed in a task of its own, from admission to hand-off, and only the
        model runs one entry at a time (the :class:`Compute` queues overlapping calls), so the next
        entries' round trips and fetches overlap it.

        While entries are in hand the read skips this consumer's own pending ones (they are those entries:
        ``StageStream.read(in_hand=True)``) and skips any id it holds.  A task's error ends like the one
        entry's of the plain loop: a transient Redis error is ridden out by :meth:`_with_redis_retry`, a
        broken group takes the worker down (with every entry it holds left pending for another replica).
        Asked to stop, it reads no more and returns once the entries in hand are settled."""
        room = anyio.Semaphore(most)
        held: set[str] = set()

        async def one(entry: Entry) -> None:
            try:
                await self._with_redis_retry(functools.partial(self.process, entry))
            finally:
                held.discard(entry.id)
                room.release()

        async with anyio.create_task_group() as entries_tg:
            while not self._stopping:
                await room.acquire()
                taken = 1
                while taken < most and room.value > 0:  # read as many as there is room for
                    room.acquire_nowait()
                    taken += 1
                read = functools.partial(self.stream.read, taken, block_ms=500, in_hand=bool(held))
                entries = [e for e in await self._with_redis_retry(read) or [] if e.id not in held]
                for _ in range(taken - len(entries)):
                    room.release()
                for entry in entries:
                    held.add(entry.id)
                    entries_tg.start_soon(one, entry)
                if not entries and not held:
                    await self.compute.idle()

    async def _with_redis_retry(self, op: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``op``, riding out Redis outages up to ``timeouts.redis_unreachable`` (5 s once draining),
        both counted from its first attempt, which runs without building the retry policy (two or three
        calls an entry: :func:`~stageferry.broker.control.redis_conn.with_reconnects`)."""
        started = time.monotonic()
        try:
            return await with_reconnects(
                op,
                within=self.pipeline.timeouts.redis_unreachable,
                event="worker.redis_retry",
                initial=0.1,
                cap=5.0,
                abandon=lambda: self._stopping,
            )
        except ControlPlaneError as exc:
            if is_connection_error(exc):
                log.error("worker.redis_gone", seconds=round(time.monotonic() - started, 1), error=exc.message)
            raise

    # ---------------------------------------------------------------- one entry

    async def process(self, entry: Entry) -> None:
        """Handle one entry to a definite outcome; transient Redis errors (connection, BUSY) propagate (the
        entry stays pending).

        The one boundary where an error becomes a request state: everything below raises typed errors,
        and :meth:`Outcomes.settle` ends the request as the outcome table says.  An entry refused at
        admission (its id breaks the rule, or is another tenant's) is settled without a request id."""
        entry, refusal = self.admission.open(entry)
        if refusal is not None:  # nothing may be written under its id: it may be someone else's
            await self.outcomes.settle(entry, None, refusal)
            return
        rid = entry.text("request_id") or ""
        # The key the entry carries (``<id>_<from stage>_0``), bound before parsing: a rejection or a dead
        # letter of an entry that does not parse still names it in the logs.
        with bound_request(
            rid, key=request_key(rid, self.pipeline.index_of(self.stage.name) - 1), stage=self.stage.name, rank=0
        ):
            envelope: Envelope | None = None
            try:
                envelope, marked, looked = await self._admitted(entry, rid)
                try:
                    self.admission.check_deliveries(entry)
                    await self.guard.check_crashes(entry, rid)
                    self.admission.check_limits(envelope)
                except Exception:
                    if marked:  # the first delivery's crash mark came with its admission: take it back
                        await self.guard.unmark(entry, rid)
                    raise
                with structlog.contextvars.bound_contextvars(key=envelope.key, attempt=envelope.attempt):
                    async with self.guard.crash_mark(entry, rid, marked=marked) as mark:
                        try:
                            await self._run(entry, envelope, mark, looked)
                        finally:  # put or not: free output buffers the model was handed and no put took
                            self.hand.unstage(envelope)
                            self.streaming.forget(envelope)
            except GroupBrokenError:
                raise  # leave the entry pending: the replica stops and another one reclaims it
            except RequestIdTakenError as exc:  # another job's id: nothing of this entry reaches its trace
                with structlog.contextvars.bound_contextvars(request_id=None):
                    log.warning(
                        "request.id_taken", request_key=self.keys.request(rid), entry=entry.id, reason=exc.message
                    )
                    await self.outcomes.settle(entry, rid, exc)
            except StageferryError as exc:
                if isinstance(exc, ControlPlaneError):
                    if is_transient_error(exc):  # connection trouble, BUSY, LOADING: the entry stays pending
                        raise
                    log.exception("worker.control_plane_error", entry=entry.id)
                await self.outcomes.settle(entry, rid, exc, envelope=envelope, recompute=self.hand.recompute)
            except Exception as exc:  # a bug must not take the worker down nor lose the request
                log.exception("worker.internal_error", entry=entry.id)
                error = StageFailedError(f"internal error: {type(exc).__name__}: {exc}")
                await self.outcomes.settle(entry, rid, error, envelope=envelope)
        self.processed += 1

    async def _admitted(self, entry: Entry, rid: str) -> tuple[Envelope, bool, Look | None]:
        """The entry as an envelope whose request id is its job's (:class:`.EntryGuard`), whether its
        crash mark is set already, and what :meth:`.Admission.settled` reads (a first delivery's mark and
        look come with the admission, in one script, which also writes its start statuses when it runs)."""
        try:
            envelope = self.admission.parse(entry, rid)
        except RejectedError as exc:
            raise await self.guard.unparsed(rid, exc) from exc
        starts: tuple[StatusWrite, ...] = ()
        if self.admission.may_start(envelope):
            starts = self.outcomes.start_writes(entry, envelope, media_free=self.admission.media_free(envelope))
        marked, looked = await self.guard.admit_and_look(envelope, entry, starts)
        return envelope, marked, looked

    async def _run(self, entry: Entry, envelope: Envelope, mark: CrashMark, looked: Look | None = None) -> None:
        """Everything after parsing: skip what is settled, fetch, compute, hand on (the script that hands on
        or stores the result also looks at the cancel flag, and clears the crash ``mark``)."""
        if await self.admission.settled(entry, envelope, looked):
            return
        begun = looked is not None and looked.started  # the admission's script wrote the start statuses
        client = envelope.from_stage == "client"
        if client and not begun:
            await self.outcomes.submitted(entry, envelope)
        progress = ProgressSink()
        media: dict[str, bytes] = {}
        if not self.admission.media_free(envelope):  # decoding may outlast a visibility timeout: claim held
            media = await self._holding_claim(entry, envelope, progress, lambda: self.admission.load_media(envelope))
            if progress.cancelled:
                raise CancelledRequestError("cancelled by the client")
        # a first stage's running came with its queued only for a job without media (Admission.media_free)
        if not begun or (client and not self.admission.media_free(envelope)):
            await self.outcomes.running(entry, envelope, None)
        started = time.perf_counter()
        try:
            async with self._fetch(envelope, entry) as incoming:
                await self._check_input(envelope.job, incoming.payload)
                output = await self._compute_holding_claim(entry, envelope, incoming, progress, media)
                if isinstance(incoming.payload, ChunkStream):  # the hop is its chunks'
                    incoming = incoming.payload.stats.incoming()
        except (DataPlaneError, ManifestError, PayloadContractError) as exc:
            # the leader's miss, or its refusal before the fan-out: the other ranks must hear it too
            await self.compute.abort(envelope.request_id, envelope.key, exc)
            raise
        if progress.cancelled:
            raise CancelledRequestError("cancelled by the client")
        timing = StageTiming(
            stage=self.stage.name,
            seconds=time.perf_counter() - started,
            transport=incoming.transport,
            payload_bytes=incoming.nbytes,
            transfer_seconds=incoming.seconds,
            route=incoming.route[:512] if incoming.route else None,
        )
        metrics.STAGE_SECONDS.labels(self.stage.name).observe(timing.seconds)
        if self.streaming.streamed(envelope):
            await self.streaming.finish(entry, envelope, output, mark=mark)
        elif self.next_stage is None:
            await self.hand.store_result(entry, envelope, output, timing, mark=mark)
        else:
            await self.hand.hand_on(entry, envelope, output, timing, mark=mark)

    async def _check_input(self, job: JobRequest, payload: Any) -> None:
        """Check the payload against the model's declared input contract — once, on the leader, before
        the fan-out — so that a producer's mistake ends ``rejected`` naming the entry instead of
        ``failed`` deep inside a model on every rank.  The scan runs off the event loop."""
        if self.input_contract is None or self.previous_stage is None or isinstance(payload, ChunkStream):
            return
        started = time.perf_counter()
        await anyio.to_thread.run_sync(functools.partial(self.input_contract.check, job, payload))
        log.debug("payload.checked", contract=self.input_contract.id, seconds=round(time.perf_counter() - started, 6))

    def _fetch(self, envelope: Envelope, entry: Entry) -> Any:
        if envelope.payload.kind == "none" or self.input_connector is None:
            return holding(Incoming(payload=None, transport=Transport.NONE, nbytes=0, seconds=0.0))
        if is_chunked(envelope):
            return self.streaming.open_input(envelope)
        lease = self.input_connector.lease_of(envelope.payload)
        claimed = entry.claimed(lease) if lease is not None else None
        return self.input_connector.get(envelope.payload, entry.fields.get("blob"), key=envelope.key, claimed=claimed)

    async def _compute_holding_claim(
        self, entry: Entry, envelope: Envelope, incoming: Incoming, progress: ProgressSink, media: dict[str, bytes]
    ) -> Any:
        """Run the model while renewing the entry's claim and publishing progress (also while the entry
        waits for the model behind another one in hand)."""
        item = WorkItem(
            job=envelope.job,
            payload=incoming.payload,
            request_id=envelope.request_id,
            key=envelope.key,
            media=media,
            manifest=incoming.manifest,
            regions=incoming.regions,
            output_tensors=self.hand.output_tensors(envelope),
            emit_chunk=self.streaming.emitter(envelope),
        )
        return await self._holding_claim(entry, envelope, progress, lambda: self.compute(item, progress))

    async def _holding_claim(
        self, entry: Entry, envelope: Envelope, progress: ProgressSink, work: Callable[[], Awaitable[T]]
    ) -> T:
        """``work`` (the model; a first stage's media checks) while :meth:`_keep_claim` renews the entry's
        claim, watches the cancel flag and publishes progress; ``work``'s error is raised as itself."""
        result: list[T] = []
        failure: list[Exception] = []

        async def run() -> None:
            try:
                result.append(await work())  # the model: one at a time, however many entries are in hand
            except Exception as exc:  # re-raised below as itself, not wrapped in an ExceptionGroup
                failure.append(exc)
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            tg.start_soon(self._keep_claim, entry, envelope, progress)
        if failure:
            raise failure[0]
        return result[0]

    async def _keep_claim(self, entry: Entry, envelope: Envelope, progress: ProgressSink) -> None:
        """While the model runs: watch the cancel flag (every :data:`WATCH_EVERY_S`, so a model that
        checks ``is_cancelled`` per step stops within one step), publish progress (at most every
        :data:`PUBLISH_EVERY_S`) and renew the entry's claim.  Redis trouble here is logged and retried on
        the next round: it must not fail a job that is computing fine."""
        every = self.pipeline.timeouts.claim_renew_every
        published: tuple[int, int, str | None] | None = None
        next_renew = time.monotonic() + every
        next_publish = time.monotonic() + PUBLISH_EVERY_S
        while True:
            await anyio.sleep(WATCH_EVERY_S)
            try:
                if not progress.cancelled and await self.store.is_cancelled(envelope.request_id):
                    progress.cancelled = True
                    log.info("worker.cancel_seen", entry=entry.id, step=progress.latest)
                now = time.monotonic()
                if now >= next_publish and progress.latest is not None and progress.latest != published:
                    step, total, phase = progress.latest
                    await self.outcomes.running(
                        entry, envelope, Progress(stage=self.stage.name, step=step, total=total, phase=phase)
                    )
                    published = progress.latest
                    next_publish = now + PUBLISH_EVERY_S
                if now >= next_renew:
                    if not await self.stream.renew(entry.id):
                        log.warning("worker.claim_lost", entry=entry.id)
                    next_renew = now + every
            except ControlPlaneError as exc:
                log.warning("worker.renew_failed", entry=entry.id, error=exc.message)
