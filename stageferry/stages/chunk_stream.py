"""What a consumer model iterates when its producer streams: the chunks of one payload, in order.

A :class:`ChunkStream` is handed to a model that sets ``takes_chunks = True`` (see
:mod:`stageferry.stages.model`).  It is a one-pass iterator: ``for chunk in stream`` in the model's
thread (every rank), or ``async for chunk in stream`` on the leader's event loop.  Each chunk's payload is
valid until the next one is asked for (it may be a view of the consumer's pool slot, freed then); keep
a copy to hold one longer.  A chunk that cannot be had raises the typed error that ends the request
(:class:`~stageferry.errors.ChunkTimeoutError`, a data-plane error) out of the iteration, on every rank.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio

from stageferry.broker.data.connector_contract import Incoming
from stageferry.schemas import Transport


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk as the consumer got it: its index, payload, whether it is the last, how it came."""

    index: int
    payload: Any
    final: bool
    incoming: Incoming | None = None


@dataclass(slots=True)
class ChunkStats:
    """What a stream's chunks cost the consumer (its hop line in the status)."""

    chunks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    transports: dict[str, int] = field(default_factory=dict)
    first_at: float | None = None  #: ``time.time()`` when chunk 0 was at hand

    def add(self, chunk: Chunk, at: float) -> None:
        self.chunks += 1
        if self.first_at is None:
            self.first_at = at
        if chunk.incoming is not None:
            self.nbytes += chunk.incoming.nbytes
            self.seconds += chunk.incoming.seconds
            kind = chunk.incoming.transport.value
            self.transports[kind] = self.transports.get(kind, 0) + 1

    def incoming(self) -> Incoming:
        """The hop as one :class:`Incoming`: the chunks' bytes and transfer seconds, the commonest transport."""
        transport = max(self.transports, key=self.transports.__getitem__) if self.transports else Transport.NONE.value
        route = ", ".join(f"{n}×{kind}" for kind, n in sorted(self.transports.items()))
        return Incoming(
            payload=None,
            transport=Transport(transport),
            nbytes=self.nbytes,
            seconds=self.seconds,
            route=f"{self.chunks} chunks: {route}" if route else None,
        )


class ChunkStream:
    """The chunks of one streamed payload (see the module docstring).

    ``next_chunk`` gives the next chunk or None at the end; it blocks (it is called from the model's
    thread).  ``anext_chunk``, where given, is its coroutine twin for ``async for`` on the event loop."""

    def __init__(
        self,
        next_chunk: Callable[[], Chunk | None],
        anext_chunk: Callable[[], Awaitable[Chunk | None]] | None = None,
    ) -> None:
        self._next = next_chunk
        self._anext = anext_chunk
        self.indices: list[int] = []  #: the indices handed to the model, in order
        self.stats = ChunkStats()
        self._ended = False
        self.current: Chunk | None = None

    @property
    def ended(self) -> bool:
        """The last chunk was handed out (or the stream said it had no more)."""
        return self._ended

    def wrap(self, around: Callable[[Callable[[], Chunk | None]], Callable[[], Chunk | None]]) -> None:
        """Route every next chunk through ``around(next_chunk)`` (the leader's fan-out to its ranks); the
        stream is then iterated from the model's thread only (``async for`` runs it in a thread)."""
        self._next = around(self._next)
        self._anext = None

    def _took(self, chunk: Chunk | None) -> Chunk | None:
        if chunk is None:
            self._ended = True
            return None
        if chunk.index != (self.indices[-1] + 1 if self.indices else 0):
            raise AssertionError(f"chunk {chunk.index} out of order after {self.indices[-1:]}")  # a bug, never data
        self.indices.append(chunk.index)
        self.stats.add(chunk, time.time())
        self.current = chunk
        if chunk.final:
            self._ended = True
        return chunk

    def chunks(self) -> Iterator[Chunk]:
        """The chunks with their index and ``final`` flag (``iter(stream)`` gives only the payloads)."""
        while not self._ended:
            chunk = self._took(self._next())
            if chunk is None:
                return
            yield chunk

    def __iter__(self) -> Iterator[Any]:
        for chunk in self.chunks():
            yield chunk.payload

    async def __aiter__(self) -> AsyncIterator[Any]:
        while not self._ended:
            if self._anext is not None:
                chunk = self._took(await self._anext())
            else:
                chunk = self._took(await anyio.to_thread.run_sync(self._next))
            if chunk is None:
                return
            yield chunk.payload
