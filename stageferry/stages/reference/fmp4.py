"""Write a fragmented MP4 (H.264 + AAC) as frames come: playable from its first fragment on.

:class:`FragmentedMp4` opens ``<path>.part`` (a name a reader can find while it grows) with
``movflags=frag_keyframe+empty_moov+default_base_moof``: the header (``ftyp``, an empty ``moov``) goes out
first, then a ``moof``/``mdat`` fragment at each keyframe — one every ``gop`` frames (the encoder's GOP is
set to it, without lookahead or B-frames, so a frame's packet comes out when the frame goes in).  Audio is
muxed alongside, up to the time of the video written so far.  :meth:`close` flushes the last fragment and
renames the file to ``path`` (a reader that opened the ``.part`` file keeps reading the same file).
"""

from __future__ import annotations

import os
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import Any, cast

import av
import numpy as np
import torch
from av.audio.stream import AudioStream
from av.video.stream import VideoStream

from stageferry.stages.reference.mp4 import AUDIO_CODEC, h264_encoder

MOVFLAGS = "frag_keyframe+empty_moov+default_base_moof"
_AAC_FRAME = 1024


def part_path(path: Path) -> Path:
    """Where the MP4 bound for ``path`` grows until it is whole."""
    return path.with_name(f"{path.name}.part")


class FragmentedMp4:
    """A fragmented MP4 being written: :meth:`write` frames [n, H, W, 3] uint8 in order, then :meth:`close`."""

    def __init__(
        self,
        path: Path,
        *,
        width: int,
        height: int,
        fps: int,
        gop: int,
        audio: torch.Tensor | None = None,
        sample_rate: int = 32_000,
        qp: int = 23,
        preset: str = "veryfast",
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.part = part_path(self.path)
        self.fps = fps
        self.frames = 0
        # flush_packets: each fragment reaches the file when it is cut, not when the I/O buffer fills
        options = {"movflags": MOVFLAGS, "flush_packets": "1"}
        self._container: Any = av.open(str(self.part), mode="w", format="mp4", options=options)
        encoder = h264_encoder()
        self._video = cast(VideoStream, self._container.add_stream(encoder, rate=fps))
        self._video.width, self._video.height, self._video.pix_fmt = width, height, "yuv420p"
        self._video.time_base = Fraction(1, fps)
        gop = max(1, gop)
        self._video.gop_size = gop
        if encoder == "libx264":
            keys = f"keyint={gop}:min-keyint={gop}:scenecut=0"
            self._video.options = {"qp": str(qp), "preset": preset, "tune": "zerolatency", "x264-params": keys}
        self._sound: AudioStream | None = None
        self._samples: np.ndarray | None = None
        self._audio_at = 0
        self.sample_rate = sample_rate
        if audio is not None:
            self._sound = cast(AudioStream, self._container.add_stream(AUDIO_CODEC, rate=sample_rate, layout="stereo"))
            self._sound.time_base = Fraction(1, sample_rate)
            self._samples = np.ascontiguousarray(audio.to(torch.float32).clamp(-1.0, 1.0).numpy())

    def write(self, frames: torch.Tensor) -> None:
        """Encode and mux the next frames, and the audio up to their end."""
        pixels = frames.contiguous().numpy()
        for i in range(pixels.shape[0]):
            frame = av.VideoFrame.from_ndarray(pixels[i], format="rgb24")
            frame.pts = self.frames
            self.frames += 1
            self._container.mux(self._video.encode(frame))
        self._write_audio(until=self.frames * self.sample_rate // self.fps)

    def _write_audio(self, until: int) -> None:
        if self._sound is None or self._samples is None:
            return
        end = min(until, self._samples.shape[1])
        while self._audio_at + _AAC_FRAME <= end or (self._audio_at < end == self._samples.shape[1]):
            start = self._audio_at
            chunk = np.ascontiguousarray(self._samples[:, start : start + _AAC_FRAME])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
            frame.sample_rate = self.sample_rate
            frame.pts = start
            self._container.mux(self._sound.encode(frame))
            self._audio_at = start + chunk.shape[1]

    def close(self) -> Path:
        """Flush the encoders and the last fragment; the file is ``path`` from now on."""
        self._container.mux(self._video.encode(None))
        if self._sound is not None and self._samples is not None:
            self._write_audio(until=self._samples.shape[1])
            self._container.mux(self._sound.encode(None))
        self._container.close()
        os.replace(self.part, self.path)
        return self.path

    def abort(self) -> None:
        """Drop a half-written file (the request failed)."""
        try:
            self._container.close()
        except (av.FFmpegError, ValueError):
            pass
        self.part.unlink(missing_ok=True)

    def __enter__(self) -> FragmentedMp4:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            self.abort()
