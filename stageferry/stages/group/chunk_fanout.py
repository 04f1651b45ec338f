"""A streamed payload in a stage group: the leader fans each chunk out to its ranks as it takes it.

The job's header says ``chunked``; every rank's model then iterates a
:class:`~stageferry.stages.chunk_stream.ChunkStream`.  On the leader each next chunk is fetched
(:mod:`stageferry.stages.entry.chunk_input`) and broadcast as a ``chunk`` message — its regions straight from
the slot the READ landed in, or packed once — before the leader's model sees it; a follower's stream
receives those messages.  The end of the stream is a ``chunk`` message with ``end``; a chunk the leader
could not get (a timeout, a payload gone) is one with the typed ``error``, which every follower raises
out of its iteration, so no rank waits for a chunk that will not come and all meet at the failure flag.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from stageferry.errors import StageFailedError, StageferryError, error_from_code
from stageferry.stages.chunk_stream import Chunk, ChunkStream
from stageferry.stages.group.group_channel import GroupChannel, MessageKind

log = structlog.get_logger(__name__)

NextChunk = Callable[[], Chunk | None]


def fan_out(stream: ChunkStream, channel: GroupChannel, *, pack: Callable[..., tuple]) -> None:  # type: ignore[type-arg]
    """Make the leader's ``stream`` broadcast every chunk it takes to the group (``pack``: the group's
    payload packer, for chunks that did not come as packed regions)."""

    def around(next_chunk: NextChunk) -> NextChunk:
        def fanned() -> Chunk | None:
            try:
                chunk = next_chunk()
            except StageferryError as exc:
                channel.send(MessageKind.CHUNK, {"error": exc.to_dict(), "sent_at": time.time()})
                raise
            if chunk is None:
                channel.send(MessageKind.CHUNK, {"end": True})
                return None
            incoming = chunk.incoming
            if incoming is not None and incoming.manifest is not None and incoming.regions is not None:
                manifest, regions = incoming.manifest, dict(incoming.regions)
            else:
                manifest, regions = pack(chunk.payload)
            started = time.perf_counter()
            channel.send(
                MessageKind.CHUNK, {"index": chunk.index, "final": chunk.final}, manifest=manifest, buffers=regions
            )
            log.debug("chunk.fanout", index=chunk.index, seconds=round(time.perf_counter() - started, 6))
            return chunk

        return fanned

    stream.wrap(around)


def close_fanned(channel: GroupChannel, error: BaseException) -> None:
    """The leader's model raised mid-stream: tell the followers still waiting for a chunk."""
    code = error.code if isinstance(error, StageferryError) else StageFailedError.code
    message = error.message if isinstance(error, StageferryError) else f"the leader's model failed: {error}"
    channel.send(MessageKind.CHUNK, {"error": {"code": code, "message": message, "details": {}}})


def follower_stream(channel: GroupChannel) -> ChunkStream:
    """A follower's stream: the chunks its leader broadcasts, until ``end`` (or the leader's error)."""

    def next_chunk() -> Chunk | None:
        message = channel.receive()
        header = message.header
        if message.kind is not MessageKind.CHUNK:
            raise StageFailedError(f"a {message.kind.value!r} message in the middle of a stream")
        if header.get("end"):
            return None
        if "error" in header:
            err = header["error"] or {}
            raise error_from_code(str(err.get("code", "")), str(err.get("message", "")), err.get("details"))
        return Chunk(index=int(header["index"]), payload=message.payload, final=bool(header.get("final")))

    return ChunkStream(next_chunk)
