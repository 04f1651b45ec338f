"""The consumer leader's side of a streamed payload: take the chunks in order, once each, within a deadline.

:class:`ChunkReader` follows the request's chunk stream (:mod:`stageferry.broker.control.chunks`) and
hands the model one chunk at a time (:class:`~stageferry.stages.chunk_stream.ChunkStream`):

* it waits for chunk ``n`` at most ``streaming.chunk_timeout_s`` from the moment it starts waiting, then
  raises :class:`~stageferry.errors.ChunkTimeoutError` (never a wait forever);
* announcements of an index below ``n`` are repeats (a producer that died and computes the stream again
  announces from where the consumer was) and are skipped; an index above ``n`` is kept for later, up to
  the window past ``n`` (``streaming.max_chunks_in_flight``, which no producer passes: back-pressure holds
  it) and the newest :data:`MAX_REPEATS` announcements of one index — what a writer puts beyond either is
  dropped (``chunk.dropped``), so what the reader holds stays bounded (announcements carry inline bytes);
* it fetches a chunk through the input connector (NIXL, or inline) — a chunk whose copy is gone
  (:class:`~stageferry.errors.PayloadUnavailableError`: its producer died) is dropped, and the reader waits
  on for the same index from the producer that computes it again;
* before fetching its first chunk it raises ``taken`` (a consumer began this stream), and once the model
  asks for the next chunk it releases ``n`` (the pool slot; the lease's READ is done and freed the
  producer's slot) and raises ``applied`` to ``n`` — the producer's back-pressure reads that — in the same
  round trip as its next read of the stream when it has to read (or alone, when the next chunk is at hand).

A redelivered entry whose stream a dead consumer had begun (``taken`` ≥ 0) cannot resume: those chunks
were read and freed.  :meth:`ChunkReader.check_start` then marks the stream abandoned (its producer stops)
and raises :class:`~stageferry.errors.PayloadUnavailableError`, which sends the request back upstream to
be computed again under the next attempt (the outcome table's ``recompute`` row).  No chunk is applied
twice: within an attempt indices only grow, and a new attempt is a new stream from chunk 0.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable

import anyio
import structlog

from stageferry.broker.control.chunks import ChunkChannel, ChunkRecord, StreamId
from stageferry.broker.data.connector_contract import Connector
from stageferry.errors import (
    CancelledRequestError,
    ChunkTimeoutError,
    ClaimError,
    ControlPlaneError,
    PayloadUnavailableError,
    StreamAbandonedError,
    UpstreamEndedError,
)
from stageferry.stages.chunk_stream import Chunk

log = structlog.get_logger(__name__)
#: One blocking read of the chunk stream; the deadline is checked between reads.
READ_BLOCK_MS = 250
#: Announcements of one index kept for later (repeats from producers that computed the stream again):
#: the newest are used, older ones beyond this many are dropped.
MAX_REPEATS = 4


class ChunkReader:
    """One streamed payload as its consumer leader takes it (see the module docstring)."""

    def __init__(
        self,
        channel: ChunkChannel,
        connector: Connector,
        sid: StreamId,
        *,
        timeout_s: float,
        window: int,
        is_cancelled: Callable[[], Awaitable[bool]] | None = None,
        ended_upstream: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.channel = channel
        self.connector = connector
        self.sid = sid
        self.timeout_s = timeout_s
        #: How far past the awaited index an announcement may be (the producer's back-pressure window).
        self.window = window
        self.is_cancelled = is_cancelled
        #: Whether the request has ended elsewhere (its producer failed): asked with the cancel flag.
        self.ended_upstream = ended_upstream
        self.expected = 0
        self.after = "0"
        self.ended = False
        self.skipped = 0  #: repeated announcements passed over
        self.dropped = 0  #: announcements beyond the window or the repeats kept
        self._pending: dict[int, list[ChunkRecord]] = {}
        self._held: contextlib.AsyncExitStack | None = None
        self._held_index = -1
        self._unreported = -1  #: an applied index not yet written (it rides the next read)
        self._began = False

    async def check_start(self) -> None:
        """Refuse to start a stream a dead consumer had begun (see the module docstring)."""
        state = await self.channel.state(self.sid)
        if state.abandoned:
            raise StreamAbandonedError("this stream was restarted under a later attempt", attempt=self.sid.attempt)
        if state.taken >= 0:
            await self.channel.abandon(self.sid)
            log.warning("chunk.restart", taken=state.taken, applied=state.applied, attempt=self.sid.attempt)
            raise PayloadUnavailableError(
                "a consumer that died had taken chunks of this stream: it is computed again",
                taken=state.taken,
                applied=state.applied,
            )

    async def next(self) -> Chunk | None:
        """The next chunk (the previous one is released and counted applied first), None after the last."""
        await self.release(report=False)
        if self.ended or self.expected in self._pending:  # no read to carry the applied index: alone
            await self._report()
        if self.ended:
            return None
        deadline = time.monotonic() + self.timeout_s
        waited_from = time.monotonic()
        read_once = False  # the cancel and upstream checks wait for a read that missed: none per chunk that flows
        while True:
            records = self._pending.pop(self.expected, [])
            while records:
                record = records.pop()  # the newest announcement of the index first
                chunk = await self._fetch(record)
                if chunk is not None or self.ended:  # a chunk, or the end marker
                    for repeat in records:  # older announcements of the same index: never needed
                        await self._skip(repeat)
                    if chunk is None:
                        return None
                    return self._took(chunk, waited_from, record.announcement.announced_at)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.error("chunk.timeout", index=self.expected, timeout_s=self.timeout_s)
                await self.channel.abandon(self.sid, why="stopped")  # the request fails: its producer stops
                raise ChunkTimeoutError(
                    f"chunk {self.expected} did not come within {self.timeout_s:g} s",
                    index=self.expected,
                    timeout_s=self.timeout_s,
                )
            if read_once and self.is_cancelled is not None and await self.is_cancelled():
                raise CancelledRequestError("cancelled by the client")
            if read_once and self.ended_upstream is not None and await self.ended_upstream():
                log.info("chunk.upstream_ended", index=self.expected)  # its producer failed: nothing to wait for
                raise UpstreamEndedError(
                    f"the request ended upstream while chunk {self.expected} was awaited", index=self.expected
                )
            applied, self._unreported = (self._unreported if self._unreported >= 0 else None), -1
            records = await self.channel.read(
                self.sid, self.after, block_ms=int(min(remaining, READ_BLOCK_MS / 1000) * 1000), applied=applied
            )
            read_once = True
            for record in records:
                self.after = record.entry_id
                index = record.announcement.index
                if index < self.expected:
                    await self._skip(record)
                elif index > self.expected + self.window:  # no producer gets there: not kept
                    self._drop(record, why="beyond_window")
                else:
                    kept = self._pending.setdefault(index, [])
                    kept.append(record)
                    if len(kept) > MAX_REPEATS:
                        self._drop(kept.pop(0), why="repeats")

    def _drop(self, record: ChunkRecord, *, why: str) -> None:
        """An announcement not kept (see the module docstring); its bytes, if inline, go with it."""
        self.dropped += 1
        index = record.announcement.index
        log.warning("chunk.dropped", index=index, expected=self.expected, window=self.window, why=why)

    async def _skip(self, record: ChunkRecord) -> None:
        """A repeat of an index taken already (or about to be): its producer may free it now."""
        self.skipped += 1
        log.info("chunk.repeat_skipped", index=record.announcement.index, expected=self.expected)
        await self.connector.discard(record.announcement.payload)

    def _took(self, chunk: Chunk, waited_from: float, announced_at: float) -> Chunk:
        log.info(
            "chunk.received",
            index=chunk.index,
            final=chunk.final,
            transport=chunk.incoming.transport.value if chunk.incoming is not None else "none",
            bytes=chunk.incoming.nbytes if chunk.incoming is not None else 0,
            seconds=round(chunk.incoming.seconds, 6) if chunk.incoming is not None else 0.0,
            waited_s=round(time.monotonic() - waited_from, 6),
            hop_s=round(time.time() - announced_at, 6),  # announced → in hand (one host's clock)
        )
        self.expected = chunk.index + 1
        if chunk.final:
            self.ended = True
        return chunk

    async def _fetch(self, record: ChunkRecord) -> Chunk | None:
        """The chunk ``record`` announces, held until :meth:`release`; None if its copy is gone (or, for an
        end marker, the end)."""
        ann = record.announcement
        if ann.is_end_marker:
            self.ended = True
            return None
        if not self._began:
            await self.channel.raise_to(self.sid, "taken", ann.index)
            self._began = True
        stack = contextlib.AsyncExitStack()
        try:
            incoming = await stack.enter_async_context(self.connector.get(ann.payload, record.blob, key=ann.key))
        except (PayloadUnavailableError, ClaimError) as exc:
            await stack.aclose()
            log.warning("chunk.unavailable", index=ann.index, error=exc.message, code=exc.code)
            return None
        self._held, self._held_index = stack, ann.index
        return Chunk(index=ann.index, payload=incoming.payload, final=ann.final, incoming=incoming)

    async def release(self, *, report: bool = True) -> None:
        """Free the chunk in hand (its slot) and count it applied (``report``: now; else with the next read)."""
        held, index = self._held, self._held_index
        if held is not None:
            self._held, self._held_index = None, -1
            with anyio.CancelScope(shield=True):
                await held.aclose()
            self._unreported = index
        if report:
            await self._report()

    async def _report(self) -> None:
        if self._unreported >= 0:
            index, self._unreported = self._unreported, -1
            with anyio.CancelScope(shield=True):
                await self.channel.raise_to(self.sid, "applied", index)

    async def aclose(self) -> None:
        """The stream is done with (the model returned or failed): release what is held, drop the rest,
        and the announcements themselves (:meth:`ChunkChannel.drop`; their TTL is the backstop)."""
        with anyio.CancelScope(shield=True):
            await self.release()
            for records in self._pending.values():
                for record in records:
                    with contextlib.suppress(Exception):
                        await self.connector.discard(record.announcement.payload)
            self._pending.clear()
            with contextlib.suppress(ControlPlaneError):
                await self.channel.drop(self.sid)
