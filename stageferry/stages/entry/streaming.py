"""Chunked streaming between stages, as the stage worker sees it (docs/streaming.md).

The worker asks :class:`Streaming` four things, and nothing else of a stream is its business:

* :meth:`Streaming.emitter` — the model's ``ctx.emit_chunk`` for a request (producer side,
  :mod:`stageferry.stages.entry.chunk_output`);
* :meth:`Streaming.streamed` / :meth:`Streaming.finish` — after the model returned: whether it streamed,
  and then ending the stream and acknowledging the entry (instead of the whole-payload hand-on);
* :meth:`Streaming.open_input` — for an envelope whose payload is a
  :class:`~stageferry.schemas.payload.ChunkedPayload`: the model's input, a
  :class:`~stageferry.stages.chunk_stream.ChunkStream` over a
  :class:`~stageferry.stages.entry.chunk_input.ChunkReader` (consumer side).

The stream's control plane (announcements, progress) is :mod:`stageferry.broker.control.chunks`; the
fan-out of each chunk to a consumer group's ranks is :mod:`stageferry.stages.group.chunk_fanout`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import structlog
from anyio.from_thread import BlockingPortal

from stageferry.broker.control.chunks import ChunkChannel, StreamId
from stageferry.broker.control.streams import Entry
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Incoming
from stageferry.errors import ConfigError, ControlPlaneError, EnvelopeError, GroupBrokenError
from stageferry.logs import bound_request
from stageferry.schemas import Envelope, Transport, request_key
from stageferry.schemas.envelope import ENVELOPE_VERSION
from stageferry.schemas.payload import ChunkedPayload
from stageferry.stages.chunk_stream import Chunk, ChunkStream
from stageferry.stages.entry.chunk_input import ChunkReader
from stageferry.stages.entry.chunk_output import ChunkProducer
from stageferry.stages.entry.entry_guard import CrashMark
from stageferry.stages.entry.leader import Leader
from stageferry.stages.model import FinalOutput

__all__ = ["Chunk", "ChunkStream", "Streaming"]

log = structlog.get_logger(__name__)


class Streaming:
    """One stage leader's streams, in and out (see the module docstring)."""

    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.redis, self.keys, self.records = leader.redis, leader.keys, leader.records
        self.pipeline, self.stage = leader.pipeline, leader.stage
        self.stream, self.store = leader.stream, leader.store
        self.input_connector, self.output_connector = leader.input_connector, leader.output_connector
        pipeline, stage = leader.pipeline, leader.stage
        self.config = pipeline.streaming
        self.index = pipeline.index_of(stage.name)
        self.next_stage = pipeline.next_stage(stage.name)
        self.channel = ChunkChannel(leader.redis, leader.keys, ttl_s=pipeline.retention.request_ttl_s)
        self._producers: dict[str, ChunkProducer] = {}
        self._emitters: dict[str, Emitter] = {}
        self._portal: BlockingPortal | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """While the worker serves: the portal through which a model's chunks are published while it
        computes the next (without it, ``emit_chunk`` publishes before it returns)."""
        async with BlockingPortal() as portal:
            self._portal = portal
            task_status.started()
            try:
                await anyio.sleep_forever()
            finally:
                self._portal = None

    # ---------------------------------------------------------------- producer side

    def emitter(self, envelope: Envelope) -> Callable[..., None]:
        """``ctx.emit_chunk`` for ``envelope``'s request (called from the model's thread)."""
        rid = envelope.request_id
        if self.next_stage is None or self.output_connector is None:

            def refuse(payload: Any, final: bool = False) -> None:
                raise ConfigError(f"stage {self.stage.name!r} is the last stage: it has no next stage to stream to")

            return refuse
        next_stage = self.next_stage.name
        sid = StreamId(rid, self.index, envelope.attempt)

        async def hand_on() -> None:
            await self._hand_on(envelope, sid, next_stage)

        producer = ChunkProducer(
            channel=self.channel,
            connector=self.output_connector,
            sid=sid,
            stage=self.stage.name,
            config=self.config,
            hand_on=hand_on,
            is_cancelled=lambda: self.store.is_cancelled(rid),
            force_inline=envelope.trace.force_inline,
        )
        self._producers[rid] = producer

        async def emit(payload: Any, final: bool) -> None:
            key = request_key(rid, self.index, producer.next_index)
            with bound_request(rid, key=key, stage=self.stage.name, rank=0):
                await producer.emit(payload, final)

        emitter = Emitter(emit, self._portal)
        self._emitters[rid] = emitter
        return emitter

    def streamed(self, envelope: Envelope) -> bool:
        """Whether the model streamed this request's output (then :meth:`finish` ends it)."""
        emitter = self._emitters.get(envelope.request_id)
        return emitter is not None and emitter.emitted > 0

    async def finish(self, entry: Entry, envelope: Envelope, output: Any, *, mark: CrashMark) -> None:
        """End the stream (the returned ``output`` as its final chunk, unless None) and acknowledge the
        producer's entry, clearing its crash ``mark``: the stream is whole, the entry's work is done."""
        producer = self._producers[envelope.request_id]
        await anyio.to_thread.run_sync(self._emitters[envelope.request_id].wait)  # the last chunk's publish
        if isinstance(output, FinalOutput):
            raise ConfigError(f"stage {self.stage.name!r} streamed chunks and then returned a FinalOutput")
        await producer.close(output)
        await self.records.clear_mark(mark.record, mark.field)
        mark.cleared = True
        if not await self.stream.ack(entry.id):
            log.warning("worker.stream_ack_lost", entry=entry.id)
        log.info(
            "stream.done",
            chunks=producer.next_index,
            published=producer.published,
            skipped=producer.skipped,
            backpressure_s=round(producer.held_s, 6),
        )
        metrics.ENTRIES.labels(self.stage.name, "handed_on").inc()

    def forget(self, envelope: Envelope) -> None:
        """The entry is settled: drop its producer."""
        self._producers.pop(envelope.request_id, None)
        self._emitters.pop(envelope.request_id, None)

    async def _hand_on(self, envelope: Envelope, sid: StreamId, next_stage: str) -> None:
        """Add the stream's envelope (version 2) to the next stage and wake it, unless this attempt's stream
        was handed on already (a recomputing producer's run)."""
        rid = envelope.request_id
        nxt = Envelope(
            schema_version=ENVELOPE_VERSION,
            request_id=rid,
            key=request_key(rid, self.index),
            from_stage=self.stage.name,
            to_stage=next_stage,
            job=envelope.job,
            payload=ChunkedPayload(max_in_flight=self.config.max_chunks_in_flight),
            attempt=envelope.attempt,
            deadline=envelope.deadline,
            trace=envelope.trace.model_copy(update={"hop_started_at": time.time(), "force_inline": False}),
        )
        fields = {"request_id": rid, "envelope": nxt.model_dump_json()}
        if await self.channel.hand_on_once(sid, next_stage, fields):
            log.info("stream.handed_on", to_stage=next_stage, attempt=envelope.attempt)

    # ---------------------------------------------------------------- consumer side

    @contextlib.asynccontextmanager
    async def open_input(self, envelope: Envelope) -> AsyncIterator[Incoming]:
        """The chunks of ``envelope``'s streamed payload as the model's input (see the module docstring)."""
        if self.input_connector is None:
            raise EnvelopeError("a chunked payload at a stage with no input connector", stage=self.stage.name)
        rid = envelope.request_id
        reader = ChunkReader(
            self.channel,
            self.input_connector,
            StreamId(rid, self.index - 1, envelope.attempt),
            timeout_s=self.config.chunk_timeout_s,
            window=self.config.max_chunks_in_flight,
            is_cancelled=lambda: self.store.is_cancelled(rid),
            ended_upstream=lambda: self.store.ended(rid),
        )
        await reader.check_start()

        async def anext_chunk() -> Chunk | None:
            return await reader.next()

        token = anyio.lowlevel.current_token()  # the model thread is not one of anyio's: name the loop

        def next_chunk() -> Chunk | None:
            return anyio.from_thread.run(anext_chunk, token=token)

        stream = ChunkStream(next_chunk, anext_chunk)
        try:
            yield Incoming(payload=stream, transport=Transport.NONE, nbytes=0, seconds=0.0)
        except GroupBrokenError:
            raise  # the entry stays pending: the consumer that takes it over decides
        except BaseException:  # the request ends here (failed, cancelled): the producer need not go on
            await self._stop_producer(reader)
            raise
        else:  # the model returned before the last chunk: its producer would wait on it (back-pressure)
            await self._stop_producer(reader)
        finally:
            await reader.aclose()

    async def _stop_producer(self, reader: ChunkReader) -> None:
        """Mark the stream ``stopped`` unless its last chunk was read: its producer stops."""
        if not reader.ended:
            with anyio.CancelScope(shield=True), contextlib.suppress(ControlPlaneError):
                await self.channel.abandon(reader.sid, why="stopped")


Publish = Callable[[Any, bool], Coroutine[Any, Any, None]]


class Emitter:
    """A model's ``emit_chunk``: called in its thread, it starts the chunk's publishing on the event loop
    and returns, so the model computes the next chunk meanwhile; it first waits for the previous chunk's
    publishing (one in flight, announcements in order) and raises what that raised.  The chunk's tensors
    are the stage's from then on: the model makes new ones for the next chunk.  Without a portal (a
    worker not serving, in tests) the publishing is done before it returns."""

    def __init__(self, publish: Publish, portal: BlockingPortal | None) -> None:
        self._publish = publish
        self._portal = portal
        self._token = anyio.lowlevel.current_token()  # made on the event loop, called in the model thread
        self._last: concurrent.futures.Future[None] | None = None
        self.emitted = 0

    def __call__(self, payload: Any, final: bool = False) -> None:
        self.wait()
        self.emitted += 1
        if self._portal is None:
            anyio.from_thread.run(self._publish, payload, final, token=self._token)
        else:
            self._last = self._portal.start_task_soon(self._publish, payload, final)

    def wait(self) -> None:
        """Block until the chunk in flight is published; raise what its publishing raised."""
        last, self._last = self._last, None
        if last is not None:
            last.result()


def is_chunked(envelope: Envelope) -> bool:
    return isinstance(envelope.payload, ChunkedPayload)
