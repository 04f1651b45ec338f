"""Media inputs: fetch the bytes a job points at (bounded), and check them with PyAV / Pillow.

The first stage's leader loads and probes every media input before any compute, so that bad media
ends ``rejected`` with the field named — never an internal error — and an oversized upload or file
is refused before it is read whole (STRLEN / stat first).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import anyio
import av
import redis.asyncio as aioredis
from PIL import Image, UnidentifiedImageError

from stageferry.broker.control.redis_conn import translated
from stageferry.errors import JobValidationError, field_error
from stageferry.schemas import JobRequest, MediaRef

#: Decoding stops after this much audio/video: enough to check, bounded work for hostile files.
_MAX_PROBE_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class LoadedMedia:
    """The raw bytes of each media input a job names, by field name."""

    items: dict[str, bytes]


async def load_media(
    job: JobRequest, *, redis: aioredis.Redis, upload_prefix: str, max_bytes: int, min_audio_s: float
) -> LoadedMedia:
    """Read and validate every media input of ``job``; :class:`JobValidationError` names the field."""
    items: dict[str, bytes] = {}
    for name in type(job.media).model_fields:
        ref: MediaRef | None = getattr(job.media, name)
        if ref is None:
            continue
        field = f"media.{name}"
        data = await _read(ref, field, redis=redis, upload_prefix=upload_prefix, max_bytes=max_bytes)
        await anyio.to_thread.run_sync(_probe, name, field, data, min_audio_s)
        items[name] = data
    return LoadedMedia(items)


async def _read(ref: MediaRef, field: str, *, redis: aioredis.Redis, upload_prefix: str, max_bytes: int) -> bytes:
    if ref.upload_key is not None:
        if not ref.upload_key.startswith(upload_prefix):
            raise _invalid(field, f"upload key must start with {upload_prefix!r}", "bad_upload_key")
        with translated():
            size = await redis.strlen(ref.upload_key)
        if size == 0:
            raise _invalid(field, "upload not found (expired or never uploaded)", "upload_missing")
        if size > max_bytes:
            raise _invalid(field, f"upload is {size} bytes; the limit is {max_bytes}", "too_large")
        with translated():
            data = await redis.get(ref.upload_key)
        return data or b""
    assert ref.path is not None
    path = anyio.Path(ref.path)
    try:
        size = (await path.stat()).st_size
        if size > max_bytes:
            raise _invalid(field, f"file is {size} bytes; the limit is {max_bytes}", "too_large")
        return await path.read_bytes()
    except OSError as exc:
        raise _invalid(field, f"cannot read {Path(ref.path).name!r}: {exc.strerror}", "unreadable") from exc


def _probe(name: str, field: str, data: bytes, min_audio_s: float) -> None:
    """Decode enough of the media to know it is what the field says."""
    if name in ("first_frame", "last_frame"):
        probe_image(data, field)
    elif name == "reference_video":
        if probe_video_frames(data, field) < 1:
            raise _invalid(field, "video has no decodable frames", "bad_media")
    elif name == "reference_audio":
        seconds = probe_audio_seconds(data, field)
        if seconds < min_audio_s:
            raise _invalid(field, f"reference audio is {seconds:.2f} s; at least {min_audio_s} s needed", "too_short")


def probe_image(data: bytes, field: str) -> tuple[int, int]:
    """(width, height) of an image Pillow can decode."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
            return img.size
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise _invalid(field, f"not a decodable image: {exc}", "bad_media") from exc


def probe_video_frames(data: bytes, field: str, *, limit: int = 10_000) -> int:
    """How many video frames decode (bounded)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise _invalid(field, "no video stream", "bad_media")
            count = 0
            for _frame in container.decode(video=0):
                count += 1
                if count >= limit:
                    break
            return count
    except av.FFmpegError as exc:
        raise _invalid(field, f"not a decodable video: {exc}", "bad_media") from exc


def probe_audio_seconds(data: bytes, field: str) -> float:
    """Seconds of decodable audio (decoding stops after ``_MAX_PROBE_SECONDS``)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise _invalid(field, "no audio stream", "bad_media")
            samples = 0.0
            for frame in container.decode(audio=0):
                samples += frame.samples / float(frame.sample_rate or 1)
                if samples >= _MAX_PROBE_SECONDS:
                    break
            return samples
    except av.FFmpegError as exc:
        raise _invalid(field, f"not decodable audio: {exc}", "bad_media") from exc


def _invalid(field: str, message: str, kind: str) -> JobValidationError:
    return JobValidationError(f"invalid job: {field}: {message}", [field_error(field, message, kind)])
