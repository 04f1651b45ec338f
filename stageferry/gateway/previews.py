"""A finished video's ``thumbnail`` and ``spritesheet`` (``GET /v1/videos/{id}/content?variant=...``).

OpenAI's videos API serves three variants of a finished job: the video, a thumbnail (one frame, WebP)
and a spritesheet (a grid of frames, JPEG).  The pipeline produces the MP4 only, so the gateway makes
the two images from it the first time either is asked for — one decoding pass for both — and keeps them
next to the result in Redis (:meth:`Keys.video_preview`, with the request's TTL): each is made once,
whichever gateway is asked and however often.  Decoding runs in a worker thread, one video at a time
per gateway; the images are small (the thumbnail at most :data:`THUMB_MAX_PX` on its longer side, the
sheet's tiles at most :data:`TILE_MAX_PX`), whatever the video's size.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from PIL import Image

#: The variants, and the media type each is served as.
MEDIA_TYPES = {"thumbnail": "image/webp", "spritesheet": "image/jpeg"}
#: Longest side of the thumbnail, and of each spritesheet tile, in pixels.
THUMB_MAX_PX = 512
TILE_MAX_PX = 256
#: Frames in a spritesheet at most (evenly spaced over the video).
SHEET_FRAMES = 16


class PreviewError(Exception):
    """The MP4 could not be decoded into frames."""


@dataclass(frozen=True, slots=True)
class Previews:
    thumbnail: bytes
    spritesheet: bytes

    def variant(self, name: str) -> bytes:
        return self.thumbnail if name == "thumbnail" else self.spritesheet


def _picks(total: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``total`` frames (each at the middle of its share)."""
    count = max(1, min(count, total))
    return sorted({min(total - 1, int((i + 0.5) * total / count)) for i in range(count)})


def render(source: bytes | BinaryIO) -> Previews:
    """Both images of an MP4, from its bytes or a seekable file (blocking: call it in a thread)."""
    import av  # imported here, so that the routes load without the decoder

    file = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with av.open(file, mode="r") as container:
            stream = container.streams.video[0]
            total = stream.frames or sum(1 for _frame in container.decode(video=0))
        if total <= 0:
            raise PreviewError("the video has no frames")
        wanted = set(_picks(total, SHEET_FRAMES))
        middle = total // 2
        frames: dict[int, Image.Image] = {}
        file.seek(0)
        with av.open(file, mode="r") as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted or index == middle:
                    frames[index] = frame.to_image()
                if index >= max(*wanted, middle):
                    break
    except (av.FFmpegError, IndexError, ValueError) as exc:
        raise PreviewError(f"cannot decode the video: {exc}") from exc
    if not frames:
        raise PreviewError("the video has no frames")
    thumb = frames.get(middle) or next(iter(frames.values()))
    return Previews(thumbnail=_thumbnail(thumb), spritesheet=_sheet([frames[i] for i in sorted(wanted) if i in frames]))


def _fit(image: Image.Image, longest: int) -> Image.Image:
    scale = min(1.0, longest / max(image.size))
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.convert("RGB").resize(size) if size != image.size else image.convert("RGB")


def _thumbnail(frame: Image.Image) -> bytes:
    out = io.BytesIO()
    _fit(frame, THUMB_MAX_PX).save(out, format="WEBP", quality=80)
    return out.getvalue()


def _sheet(frames: list[Image.Image]) -> bytes:
    """The frames in a grid, row by row (as square as the count allows)."""
    from PIL import Image

    tiles = [_fit(f, TILE_MAX_PX) for f in frames]
    cols = math.ceil(math.sqrt(len(tiles)))
    rows = math.ceil(len(tiles) / cols)
    width, height = tiles[0].size
    sheet = Image.new("RGB", (cols * width, rows * height))
    for i, tile in enumerate(tiles):
        sheet.paste(tile, ((i % cols) * width, (i // cols) * height))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=85)
    return out.getvalue()


def grid_of(total_frames: int) -> tuple[int, int]:
    """(columns, rows) of the spritesheet of a video of ``total_frames`` frames."""
    count = len(_picks(total_frames, SHEET_FRAMES))
    cols = math.ceil(math.sqrt(count))
    return cols, math.ceil(count / cols)


__all__ = ["MEDIA_TYPES", "PreviewError", "Previews", "grid_of", "render"]
