"""Write an MP4 (H.264 yuv420p video + AAC stereo audio) with PyAV, and probe one back.

The H.264 encoder is ``libx264`` when this FFmpeg build has it, else the first other H.264 encoder that
opens (hardware ones included); the file is written next to its destination and renamed into place, so
a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
from fractions import Fraction
from pathlib import Path
from typing import Any, cast

import av
import numpy as np
import torch
from av.audio.stream import AudioStream
from av.video.stream import VideoStream

from stageferry.errors import StageFailedError

H264_ENCODERS = ("libx264", "h264", "h264_nvenc", "h264_qsv", "h264_amf", "h264_v4l2m2m", "libopenh264")
AUDIO_CODEC = "aac"
_AAC_FRAME = 1024


def h264_encoder() -> str:
    """The name of an H.264 encoder this PyAV/FFmpeg build can open."""
    for name in H264_ENCODERS:
        if name not in av.codecs_available:
            continue
        with contextlib.suppress(av.FFmpegError, ValueError):
            if av.codec.Codec(name, "w").type == "video":
                return name
    raise StageFailedError("no H.264 encoder is available in this FFmpeg build", available=sorted(av.codecs_available))


def write_mp4(
    path: Path,
    frames: torch.Tensor,
    fps: int,
    audio: torch.Tensor | None = None,
    sample_rate: int = 32_000,
    *,
    qp: int = 23,
    preset: str = "veryfast",
) -> Path:
    """Frames [F, H, W, 3] uint8 and stereo audio [2, S] float in [-1, 1] → ``path`` (mp4).

    libx264 runs at a constant quantiser (``qp``), not CRF: CRF's rate control (float maths, mb-tree)
    gave different bitstreams for the same frames from one process to another, so the same job could
    not produce the same MP4 twice; with a constant quantiser the decoded frames are reproducible."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    n, height, width, _ = frames.shape
    encoder = h264_encoder()
    try:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            video = cast(VideoStream, container.add_stream(encoder, rate=fps))
            video.width, video.height, video.pix_fmt = width, height, "yuv420p"
            video.time_base = Fraction(1, fps)
            if encoder == "libx264":
                video.options = {"qp": str(qp), "preset": preset}
            sound = None
            if audio is not None:
                sound = cast(AudioStream, container.add_stream(AUDIO_CODEC, rate=sample_rate, layout="stereo"))
                sound.time_base = Fraction(1, sample_rate)
            pixels = frames.contiguous().numpy()
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(pixels[i], format="rgb24")
                frame.pts = i
                container.mux(video.encode(frame))
            container.mux(video.encode(None))
            if sound is not None and audio is not None:
                _write_audio(container, sound, audio, sample_rate)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_audio(container: Any, stream: AudioStream, audio: torch.Tensor, sample_rate: int) -> None:
    samples = np.ascontiguousarray(audio.to(torch.float32).clamp(-1.0, 1.0).numpy())
    for start in range(0, samples.shape[1], _AAC_FRAME):
        chunk = np.ascontiguousarray(samples[:, start : start + _AAC_FRAME])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="stereo")
        frame.sample_rate = sample_rate
        frame.pts = start
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def probe_mp4(path: Path | str, *, count_frames: bool = False) -> dict[str, Any]:
    """Media facts of an MP4: codecs, size, pixel format, fps, frame count, audio layout, durations.

    The frame count comes from the container's index (exact for MP4); ``count_frames`` decodes every
    frame instead.
    """
    with av.open(str(path), mode="r") as container:
        facts: dict[str, Any] = {"container": "mp4", "bytes": Path(path).stat().st_size}
        if container.streams.video:
            v = container.streams.video[0]
            frames = int(v.frames)
            if count_frames or frames <= 0:
                frames = sum(1 for _ in container.decode(video=0))
            fps = float(v.average_rate) if v.average_rate else 0.0
            facts |= {
                "video_codec": v.codec_context.name,
                "pix_fmt": v.codec_context.pix_fmt,
                "width": v.codec_context.width,
                "height": v.codec_context.height,
                "fps": fps,
                "frames": frames,
                "duration_s": frames / fps if fps else 0.0,
            }
        if container.streams.audio:
            a = container.streams.audio[0]
            audio_s = float(a.duration * a.time_base) if a.duration and a.time_base else 0.0
            facts |= {
                "audio_codec": a.codec_context.name,
                "audio_channels": a.codec_context.channels,
                "sample_rate": a.codec_context.sample_rate,
                "audio_duration_s": audio_s,
            }
        return facts
