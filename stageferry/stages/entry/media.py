"""Media inputs: fetch the bytes a job points at (bounded), and check them with PyAV / Pillow.

The first stage's leader loads and probes every media input before any compute, so that bad media
ends ``rejected`` with the field named — never an internal error — and an oversized upload or file
is refused before it is read whole (STRLEN / fstat first, then a bounded read).

Clients send media as uploads (``<p>:upload:*``).  A local ``path`` is the deployment's choice, not the
client's: refused unless ``[limits] media_roots`` lists directories, and then only a regular file under
one of them (:func:`read_local_file`).  Refusals never say whether or what a path is.
"""

from __future__ import annotations

import io
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import anyio
import av
import redis.asyncio as aioredis
from av.container import InputContainer
from PIL import Image, UnidentifiedImageError

from stageferry.broker.control.client_keys import read_upload
from stageferry.errors import JobValidationError, field_error
from stageferry.schemas import JobRequest, MediaRef
from stageferry.schemas.validation import path_may_be_allowed, path_refusal

#: Decoding stops after this much audio: enough to check, bounded work for hostile files.
_MAX_PROBE_SECONDS = 600.0
#: What decoding untrusted bytes may raise besides our own refusals: FFmpeg's errors, and PyAV's own
#: ``ValueError`` where FFmpeg lets through what PyAV cannot represent (``UnicodeDecodeError`` is one).
DECODE_ERRORS: tuple[type[Exception], ...] = (av.FFmpegError, ValueError)


@dataclass(frozen=True, slots=True)
class LoadedMedia:
    """The raw bytes of each media input a job names, by field name."""

    items: dict[str, bytes]


def has_media(job: JobRequest) -> bool:
    """Whether ``job`` names any media input (:func:`load_media` has something to read and check)."""
    return any(getattr(job.media, name) is not None for name in type(job.media).model_fields)


async def load_media(
    job: JobRequest,
    *,
    redis: aioredis.Redis,
    upload_prefix: str,
    max_bytes: int,
    min_audio_s: float,
    media_roots: tuple[str, ...] = (),
    max_pixels: int = 4096 * 4096,
    max_frames: int = 81,
) -> LoadedMedia:
    """Read and validate every media input of ``job``; :class:`JobValidationError` names the field.  A
    reference video is decoded as far as ``max_frames`` frames (``limits.max_reference_frames``: what the
    encoder takes), however many it has."""
    items: dict[str, bytes] = {}
    refused: list[dict[str, Any]] = []  # every refused path, as the lexical check reports them
    for name in type(job.media).model_fields:
        ref: MediaRef | None = getattr(job.media, name)
        if ref is None:
            continue
        field = f"media.{name}"
        if ref.upload_key is not None:
            items[name] = await _read_upload(ref.upload_key, field, redis=redis, upload_prefix=upload_prefix,
                                             max_bytes=max_bytes)  # fmt: skip
            continue
        assert ref.path is not None
        try:
            items[name] = await anyio.to_thread.run_sync(
                read_local_file, ref.path, f"{field}.path", media_roots, max_bytes
            )
        except JobValidationError as exc:
            refused += exc.field_errors
    if refused:
        raise JobValidationError(f"invalid job: {refused[0]['field']}: {refused[0]['message']}", refused)
    for name, data in items.items():
        await anyio.to_thread.run_sync(_probe, name, f"media.{name}", data, min_audio_s, max_pixels, max_frames)
    return LoadedMedia(items)


async def _read_upload(key: str, field: str, *, redis: aioredis.Redis, upload_prefix: str, max_bytes: int) -> bytes:
    if not key.startswith(upload_prefix):
        raise _invalid(field, f"upload key must start with {upload_prefix!r}", "bad_upload_key")
    upload = await read_upload(redis, key, max_bytes)
    if upload.size == 0:
        raise _invalid(field, "upload not found (expired or never uploaded)", "upload_missing")
    if upload.data is None:
        raise _invalid(field, f"upload is {upload.size} bytes; the limit is {max_bytes}", "too_large")
    return upload.data


def read_local_file(path: str, field: str, roots: tuple[str, ...], max_bytes: int) -> bytes:
    """The bytes of a client-named local file, if the deployment allows it; at most ``max_bytes``.

    Allowed means: ``roots`` is not empty, the resolved path (``realpath``) stays under a resolved root,
    the file opens with ``O_NOFOLLOW | O_NONBLOCK`` (a symlink swapped in after resolving is refused; a
    FIFO does not block the stage) and the *opened* descriptor is a regular file (no FIFO, device or
    directory, whatever the path said a moment before).  The read is bounded whatever ``st_size`` says.
    Every refusal — a file above ``max_bytes`` too — has the same message, which tells nothing about the
    file (existence, kind, size, content)."""
    refused = _invalid(field, path_refusal(roots, max_bytes), "path_not_allowed")
    if not path_may_be_allowed(path, roots):
        raise refused
    real = os.path.realpath(path)
    if not any(_under(real, os.path.realpath(root)) for root in roots):
        raise refused
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(real, flags)
    except OSError:
        raise refused from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refused
        if info.st_size > max_bytes:
            raise refused
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError:
        raise refused from None
    finally:
        os.close(fd)
    if total > max_bytes:  # it grew after fstat
        raise refused
    return b"".join(chunks)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _probe(name: str, field: str, data: bytes, min_audio_s: float, max_pixels: int, max_frames: int) -> None:
    """Decode enough of the media to know it is what the field says, and that it fits the budget."""
    if name in ("first_frame", "last_frame"):
        width, height = probe_image(data, field)
        _check_pixels(field, width, height, max_pixels)
    elif name == "reference_video":
        if probe_video_frames(data, field, limit=max_frames, max_pixels=max_pixels) < 1:
            raise _invalid(field, "video has no decodable frames", "bad_media")
    elif name == "reference_audio":
        seconds = probe_audio_seconds(data, field)
        if seconds < min_audio_s:
            raise _invalid(field, f"reference audio is {seconds:.2f} s; at least {min_audio_s} s needed", "too_short")


def _check_pixels(field: str, width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        message = f"{width}×{height} pixels is above this deployment's limit max_media_pixels = {max_pixels}"
        raise _invalid(field, message, "over_budget")


def probe_image(data: bytes, field: str) -> tuple[int, int]:
    """(width, height) of an image Pillow can decode."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
            return img.size
    except UnidentifiedImageError:
        raise _invalid(field, "not a decodable image (unknown format)", "bad_media") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise _invalid(field, f"not a decodable image: {describe(exc)}", "bad_media") from exc


def probe_video_frames(data: bytes, field: str, *, limit: int, max_pixels: int = 1 << 28) -> int:
    """How many of the first ``limit`` video frames decode; frames above ``max_pixels`` are refused before
    decoding."""
    try:
        with open_media(data) as container:
            ctx = decodable(container, "video", field).codec_context
            _check_pixels(field, int(ctx.width or 0), int(ctx.height or 0), max_pixels)
            count = 0
            for frame in container.decode(video=0):
                _check_pixels(field, frame.width, frame.height, max_pixels)
                count += 1
                if count >= limit:
                    break
            return count
    except DECODE_ERRORS as exc:
        raise _invalid(field, f"not a decodable video: {describe(exc)}", "bad_media") from exc


def probe_audio_seconds(data: bytes, field: str) -> float:
    """Seconds of decodable audio (decoding stops after ``_MAX_PROBE_SECONDS``)."""
    try:
        with open_media(data) as container:
            decodable(container, "audio", field)
            samples = 0.0
            for frame in container.decode(audio=0):
                samples += frame.samples / float(frame.sample_rate or 1)
                if samples >= _MAX_PROBE_SECONDS:
                    break
            return samples
    except DECODE_ERRORS as exc:
        raise _invalid(field, f"not decodable audio: {describe(exc)}", "bad_media") from exc


#: Whether ``av.open`` needs telling about metadata in untrusted bytes.  PyAV before 19 decodes container
#: metadata as UTF-8 with ``metadata_errors="strict"`` by default, which raises ``UnicodeDecodeError`` from
#: ``av.open`` itself on metadata that is not: it is dropped instead.  PyAV 19 took the argument away
#: (``av.open`` refuses it: every reference medium failed) and decodes with ``surrogateescape``, which
#: never raises.
STRICT_METADATA = int(av.__version__.split(".")[0]) < 19


def open_media(data: bytes) -> InputContainer:
    """PyAV's reader over untrusted bytes; metadata that is not UTF-8 never fails it (:data:`STRICT_METADATA`)."""
    if STRICT_METADATA:
        return av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    return av.open(io.BytesIO(data), mode="r")


def decodable(container: InputContainer, kind: str, field: str) -> Any:
    """The container's first ``kind`` (``"video"``, ``"audio"``) stream, if it has one this FFmpeg can
    decode: a stream of a codec without a decoder here has no codec context, and PyAV fails on it with an
    ``AttributeError`` when it is read."""
    streams = container.streams.video if kind == "video" else container.streams.audio
    if not streams:
        raise _invalid(field, f"no {kind} stream", "bad_media")
    if streams[0].codec_context is None:
        raise _invalid(field, f"the {kind} stream's codec has no decoder here", "bad_media")
    return streams[0]


_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>|'<none>'|: ?'?<[^>]*>'?$|^\[Errno -?\d+\] ")


def describe(exc: BaseException) -> str:
    """A decoder's error as a client may read it: object reprs (``<_io.BytesIO object at 0x…>``), stand-in
    file names and FFmpeg's error number (``[Errno 1094995529]``) removed, bounded."""
    text = _REPR.sub("", str(exc)).strip(" :")
    return (text or type(exc).__name__)[:200]


def _invalid(field: str, message: str, kind: str) -> JobValidationError:
    return JobValidationError(f"invalid job: {field}: {message}", [field_error(field, message, kind)])
