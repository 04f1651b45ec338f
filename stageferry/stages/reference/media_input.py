"""Job media bytes (``ctx.media``) → tensors the reference encoders take.

Images are decoded with Pillow, video with PyAV (resampled in time to the job's fps), both centre-cropped
to the job's aspect ratio and resized to its size; audio is decoded with PyAV and resampled to 32 kHz
mono by ``av.AudioResampler``.  Every read is bounded (frames, seconds).  The leader has already probed
the bytes (``stages/media.py``); anything that still fails to decode is a rejection naming the field
(``JobValidationError``), raised alike on every rank since every rank holds the same bytes.
"""

from __future__ import annotations

import io
import math

import av
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from stageferry.errors import JobValidationError, field_error
from stageferry.stages.entry.media import DECODE_ERRORS, decodable, describe, open_media
from stageferry.stages.reference.audio import SAMPLE_RATE

#: Source frames decoded per output frame at most (a 240 fps source at 30 fps): a file whose timestamps
#: barely move cannot make the encoder decode all of its frames within the horizon.
MAX_SOURCE_PER_FRAME = 8


def load_image(data: bytes, width: int, height: int, *, field: str) -> torch.Tensor:
    """An image → [1, 3, H, W] fp32 in [-1, 1]."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _fit(img, width, height)[None]
    except UnidentifiedImageError:
        raise bad_media(field, "not a decodable image (unknown format)") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise bad_media(field, f"not a decodable image: {describe(exc)}") from exc


def load_video(data: bytes, width: int, height: int, fps: int, max_frames: int, *, field: str) -> torch.Tensor:
    """A video → up to ``max_frames`` frames [F, 3, H, W] fp32 in [-1, 1], resampled to ``fps``.

    Output frame i shows the last decoded frame whose time is at or before i / fps (from the first).
    Decoding streams: at most one decoded frame is held besides the output, however long the source
    runs; it stops after ``MAX_SOURCE_PER_FRAME * max_frames`` source frames (the output then ends at the
    last of them).
    """
    out: list[torch.Tensor] = []
    horizon = max_frames / fps
    start: float | None = None
    held: Image.Image | None = None  # the latest decoded frame: what the next output frames show
    last = 0.0
    decoded = 0
    try:
        with open_media(data) as container:
            decodable(container, "video", field)
            for frame in container.decode(video=0):
                t = float(frame.time) if frame.time is not None else decoded / fps
                start = t if start is None else start
                rel = t - start
                while held is not None and len(out) < max_frames and len(out) / fps + 1e-6 < rel:
                    out.append(_fit(held, width, height))
                held, last, decoded = frame.to_image(), rel, decoded + 1
                if rel >= horizon or len(out) >= max_frames or decoded >= MAX_SOURCE_PER_FRAME * max_frames:
                    break
    except DECODE_ERRORS as exc:
        raise bad_media(field, f"not a decodable video: {describe(exc)}") from exc
    if held is None:
        raise bad_media(field, "video has no decodable frames")
    count = min(max_frames, max(1, math.floor(last * fps + 1e-6) + 1))
    while len(out) < count:
        out.append(_fit(held, width, height))
    return torch.stack(out[:count])


def load_audio(data: bytes, *, max_seconds: float, field: str) -> torch.Tensor:
    """Audio → mono 32 kHz fp32 samples [S], at most ``max_seconds`` of them."""
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    try:
        with open_media(data) as container:
            decodable(container, "audio", field)
            for frame in container.decode(audio=0):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += out.samples
                if total >= limit:
                    break
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
    except DECODE_ERRORS as exc:
        raise bad_media(field, f"not decodable audio: {describe(exc)}") from exc
    if not chunks:
        raise bad_media(field, "audio has no decodable samples")
    return torch.from_numpy(np.concatenate(chunks)[:limit].astype(np.float32))


def bad_media(field: str, message: str) -> JobValidationError:
    """The rejection for media that does not decode: the same shape ``stages/media.py`` gives."""
    return JobValidationError(f"invalid job: {field}: {message}", [field_error(field, message, "bad_media")])


def _fit(img: Image.Image, width: int, height: int) -> torch.Tensor:
    """Centre-crop to the target aspect ratio, resize → [3, H, W] fp32 in [-1, 1]."""
    img = img.convert("RGB")
    src_w, src_h = img.size
    scale = min(src_w / width, src_h / height)
    crop_w, crop_h = round(width * scale), round(height * scale)
    left, top = (src_w - crop_w) // 2, (src_h - crop_h) // 2
    img = img.resize((width, height), Image.Resampling.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
    arr = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())
    return arr.permute(2, 0, 1).float() / 127.5 - 1.0
