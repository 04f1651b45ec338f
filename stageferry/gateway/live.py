"""A video's bytes while it is being written: ``GET /v1/videos/{id}/content`` on a running request.

A last stage that writes a fragmented MP4 as it goes (the streamed reference pipeline's decode stage,
:mod:`stageferry.stages.reference.decode`) keeps it at ``<output_dir>/<request_id>.mp4.part`` until it is
whole, then renames it to ``<request_id>.mp4``.  While the request runs and that file exists, the gateway
answers the download with the file's bytes as they are written (chunked transfer, no ``Content-Length``):
it opens the ``.part`` file once, under the same rules as a finished result (:mod:`.results`: inside the
output directory, no symlinks, a regular file) — the open descriptor follows the file through its rename
— and sends what is there, then what is appended, until the request is terminal and the file's end is
sent.  The player can start on the first fragment (an fMP4's header comes first).

If the request ends other than ``done``, the body stops where the file stopped (the client sees a short
body: the status says why).  A running request without a ``.part`` file (its last stage does not stream, or
has not started writing) still gets 409 ``not_ready``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import structlog
from fastapi.responses import StreamingResponse

from stageferry.errors import StageferryError
from stageferry.gateway.errors import ApiError
from stageferry.gateway.results import CHUNK_BYTES, ResultFile, ResultFiles, ResultRefused
from stageferry.schemas import RequestState

if TYPE_CHECKING:
    from stageferry.gateway.service import VideoService

log = structlog.get_logger(__name__)

#: How often the file is looked at again when it has no new bytes.
POLL_S = 0.05
#: How long a live download may last at most (it ends when its request does, or then).
MAX_S = 3600.0
#: The suffix of a result file still being written (:func:`stageferry.stages.reference.fmp4.part_path`).
PART_SUFFIX = ".mp4.part"


def open_live(results: ResultFiles, request_id: str) -> ResultFile | None:
    """The growing result file of ``request_id``, opened (blocking: call it in a thread); None if there is
    none (or it may not be served: the reason is logged)."""
    location = str(results.root / f"{request_id}{PART_SUFFIX}")
    if not Path(location).exists():
        return None
    try:
        return results.open(location)
    except ResultRefused as exc:
        if exc.reason != "cannot open: No such file or directory":  # renamed meanwhile: not live any more
            log.warning("gateway.live_refused", request_id=request_id, reason=exc.reason)
        return None


async def follow(
    file: ResultFile, state: Callable[[], Awaitable[RequestState]], *, poll_s: float = POLL_S, max_s: float = MAX_S
) -> AsyncIterator[bytes]:
    """The file's bytes as they are appended, until ``state()`` is terminal and the end is read (or
    ``max_s`` passes); the file is closed at the end, or when the client goes away."""
    deadline = time.monotonic() + max_s
    try:
        while True:
            data = await anyio.to_thread.run_sync(file.file.read, CHUNK_BYTES)
            if data:
                yield data
                continue
            current = await state()
            if current.terminal:  # everything the stage wrote is in the file: read to its end
                while data := await anyio.to_thread.run_sync(file.file.read, CHUNK_BYTES):
                    yield data
                return
            if time.monotonic() > deadline:
                log.warning("gateway.live_gave_up", after_s=max_s)
                return
            await anyio.sleep(poll_s)
    finally:
        file.close()


async def live_response(service: VideoService, video_id: str) -> StreamingResponse | None:
    """The running video's bytes as they are written (header ``X-Live: 1``), or None when it has no
    growing file."""
    file = await anyio.to_thread.run_sync(open_live, service.results, video_id)
    if file is None:
        return None

    async def state() -> RequestState:
        try:
            status, _meta = await service.video(video_id)
        except (ApiError, StageferryError):  # deleted or expired meanwhile, Redis away: end the body here
            return RequestState.FAILED
        return status.state

    log.info("gateway.live_download", request_id=video_id)
    headers = {"Content-Disposition": f'attachment; filename="{video_id}.mp4"', "X-Live": "1"}
    return StreamingResponse(follow(file, state), media_type="video/mp4", headers=headers)


__all__ = ["MAX_S", "PART_SUFFIX", "POLL_S", "follow", "live_response", "open_live"]
