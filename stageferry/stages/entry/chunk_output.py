"""The producer leader's side of a streamed payload: put, announce and bound each chunk.

A model calls ``ctx.emit_chunk(chunk)`` from its thread; :meth:`ChunkProducer.emit` then, on the event
loop:

1. waits while the consumer is ``streaming.max_chunks_in_flight`` chunks behind (``applied`` in the
   stream's state): **back-pressure**, logged once per wait (``chunk.backpressure``, in the request's
   trace) with how long it held the producer; past ``streaming.producer_wait_s``
   :class:`~stageferry.errors.ChunkTimeoutError`.  The state is read once at the start and then only when
   the window may be full, so a consumer that restarted or gave up (``abandoned``, ``stopped``:
   :class:`~stageferry.errors.StreamAbandonedError`) is noticed at the latest one window later.  The
   stage-wide bound is the output connector's pool:
   a put waits for a free slot (``timeouts.pool_wait``);
2. skips a chunk the consumer applied already (a producer that computes the stream again after its
   process died starts where the consumer is: chunk indices are idempotent);
3. puts the chunk through the output connector under ``<request>_<stage>_<index>`` (NIXL with a lease of
   its own, freed after the consumer's READ, or inline when small), and inline if the put fails
   (per-chunk fallback, counted in the chunk's ``fallback_reason``);
4. announces it on the chunk stream, and after the first announcement hands the stream's envelope
   (version 2, :class:`~stageferry.schemas.payload.ChunkedPayload`) to the next stage — once per attempt,
   whichever producer gets there first.

:meth:`ChunkProducer.close` ends the stream (the model's returned payload as the final chunk, or an end
marker); the worker then acknowledges the producer's entry.  Until then the entry stays pending, so a
producer that dies mid-stream is redelivered and computes the stream again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from stageferry.broker.control.chunks import ChunkChannel, ChunkState, StreamId
from stageferry.broker.data.connector_contract import Connector, Outgoing
from stageferry.config import Streaming
from stageferry.errors import (
    CancelledRequestError,
    ChunkTimeoutError,
    DataPlaneError,
    StageFailedError,
    StreamAbandonedError,
)
from stageferry.schemas import NoPayload, request_key
from stageferry.schemas.chunks import MAX_CHUNKS, ChunkAnnouncement

log = structlog.get_logger(__name__)
#: The longest pause between two looks at the consumer's progress while back-pressure holds the producer.
POLL_MAX_S = 0.05


class ChunkProducer:
    """One request's chunked output on the producer leader (see the module docstring)."""

    def __init__(
        self,
        *,
        channel: ChunkChannel,
        connector: Connector,
        sid: StreamId,
        stage: str,
        config: Streaming,
        hand_on: Callable[[], Awaitable[None]],
        is_cancelled: Callable[[], Awaitable[bool]],
        force_inline: bool = False,
    ) -> None:
        self.channel = channel
        self.connector = connector
        self.sid = sid
        self.stage = stage
        self.config = config
        self._hand_on = hand_on
        self._is_cancelled = is_cancelled
        self.force_inline = force_inline
        self.next_index = 0
        self.closed = False
        self.handed = False
        self.published = 0  #: chunks this producer put and announced
        self.skipped = 0  #: chunks the consumer had applied already
        self.held_s = 0.0  #: seconds back-pressure held this producer
        #: The consumer's ``applied`` as last read: the state is read again only when the window may be full
        #: (and once at the start, for the chunks a recomputed stream skips): one round trip a chunk fewer.
        self._applied: int | None = None

    async def emit(self, payload: Any, final: bool = False) -> None:
        """Publish the next chunk (see the module docstring)."""
        if self.closed:
            raise StageFailedError("emit_chunk after the final chunk", stage=self.stage, index=self.next_index)
        index = self.next_index
        if index >= MAX_CHUNKS:
            raise StageFailedError(f"a stream has at most {MAX_CHUNKS} chunks", stage=self.stage)
        self.next_index += 1
        self.closed = final
        state = await self._wait_window(index)
        if index <= state.applied:
            self.skipped += 1
            log.info("chunk.skipped_applied", index=index, applied=state.applied)
            return
        key = request_key(self.sid.request_id, self.sid.stage_index, index)
        outgoing = await self._put(key, payload)
        announcement = ChunkAnnouncement(
            request_id=self.sid.request_id,
            from_stage=self.stage,
            attempt=self.sid.attempt,
            index=index,
            final=final,
            key=key,
            payload=outgoing.ref,
        )
        await self._announce(announcement, outgoing)
        log.info(
            "chunk.put",
            index=index,
            final=final,
            transport=outgoing.transport.value,
            bytes=outgoing.nbytes,
            seconds=round(outgoing.seconds, 6),
            fallback=outgoing.fallback_reason,
        )

    async def close(self, output: Any) -> None:
        """End the stream: ``output`` (not None) as the final chunk, else an end marker if none was final."""
        if self.closed:
            if output is not None:
                raise StageFailedError("the model returned a payload after its final chunk", stage=self.stage)
            return
        if output is not None:
            await self.emit(output, final=True)
            return
        self.closed = True
        index = self.next_index
        marker = ChunkAnnouncement(
            request_id=self.sid.request_id,
            from_stage=self.stage,
            attempt=self.sid.attempt,
            index=index,
            final=True,
            key=request_key(self.sid.request_id, self.sid.stage_index, index),
            payload=NoPayload(),
        )
        await self.channel.announce(self.sid, marker, None)
        await self._opened()
        log.info("chunk.end", chunks=index)

    async def _wait_window(self, index: int) -> ChunkState:
        """The stream's state once ``index`` fits the window (back-pressure; see the module docstring)."""
        window = self.config.max_chunks_in_flight
        if self._applied is not None and index - self._applied <= window:
            return ChunkState(applied=self._applied, taken=-1, opened=self.handed, abandoned=False)
        state = await self.channel.state(self.sid)
        _check_open(state)
        self._applied = state.applied
        if index - state.applied <= window:
            return state
        started = time.monotonic()
        log.info("chunk.backpressure", index=index, applied=state.applied, window=window)
        pause = 0.002
        while index - state.applied > window:
            if time.monotonic() - started > self.config.producer_wait_s:
                raise ChunkTimeoutError(
                    f"the consumer applied no chunk for {self.config.producer_wait_s:g} s (chunk {index} waits)",
                    index=index,
                    applied=state.applied,
                )
            if await self._is_cancelled():
                raise CancelledRequestError("cancelled by the client")
            await anyio.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            state = await self.channel.state(self.sid)
            _check_open(state)
        self._applied = state.applied
        held = time.monotonic() - started
        self.held_s += held
        log.info("chunk.backpressure_released", index=index, applied=state.applied, held_s=round(held, 6))
        return state

    async def _put(self, key: str, payload: Any) -> Outgoing:
        """The chunk put as the connector likes, or inline if that fails (per-chunk fallback)."""
        try:
            return await self.connector.put(key, payload, force_inline=self.force_inline)
        except DataPlaneError as exc:
            if self.force_inline:
                raise StageFailedError(f"chunk {key} could not be published: {exc.message}", code=exc.code) from exc
            log.warning("chunk.inline_fallback", key=key, reason=exc.code, error=exc.message)
            try:
                return await self.connector.put(key, payload, force_inline=True)
            except DataPlaneError as again:
                raise StageFailedError(
                    f"chunk {key} could not be published: {again.message}", code=again.code
                ) from again

    async def _announce(self, announcement: ChunkAnnouncement, outgoing: Outgoing) -> None:
        try:
            await self.channel.announce(self.sid, announcement, outgoing.blob)
        except BaseException:
            self.connector.abandon(outgoing)
            raise
        self.published += 1
        await self._opened()

    async def _opened(self) -> None:
        """Hand the stream on after its first announcement (once per attempt, by whoever comes first: the
        hand-on's script marks it and adds the envelope in one step, :meth:`ChunkChannel.hand_on_once`)."""
        if self.handed:
            return
        self.handed = True
        await self._hand_on()


def _check_open(state: ChunkState) -> None:
    """:class:`StreamAbandonedError` once the consumer takes no more chunks (restarted, or gave up)."""
    if state.ended_by_consumer:
        raise StreamAbandonedError("the consumer restarted this request, or gave up on it", stopped=state.stopped)
