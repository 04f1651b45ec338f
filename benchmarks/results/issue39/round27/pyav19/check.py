"""PyAV 19 (Python 3.12): the reference-media probe of stageferry.stages.entry.media on real encoded media.

python benchmarks/results/issue39/round27/pyav19/check.py   # a Python >= 3.12 with av 19, numpy, pillow,
                                                            # redis, hiredis, anyio, pydantic(-settings),
                                                            # structlog, tenacity; stageferry from this tree
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))
from stageferry.stages.entry import media  # noqa: E402


def video(meta: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        if meta:
            c.metadata.update(meta)
        s = c.add_stream("mpeg4", rate=8)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(12):
            f = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 20, np.uint8), format="rgb24")
            c.mux(s.encode(f))
        c.mux(s.encode(None))
    return buf.getvalue()


def audio() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=16000, layout="mono")
        f = av.AudioFrame.from_ndarray(np.zeros((1, 32000), np.int16), format="s16", layout="mono")
        f.sample_rate = 16000
        c.mux(s.encode(f))
        c.mux(s.encode(None))
    return buf.getvalue()


def main() -> None:
    print("av", av.__version__, "STRICT_METADATA", getattr(media, "STRICT_METADATA", "n/a (before the fix)"))
    try:
        av.open(io.BytesIO(video()), mode="r", metadata_errors="ignore")
        print("av.open(metadata_errors=...) accepted")
    except TypeError as e:
        print("av.open(metadata_errors=...) refused:", e)
    print("video frames:", media.probe_video_frames(video(), "reference_video", limit=100))
    print("audio seconds:", media.probe_audio_seconds(audio(), "reference_audio"))
    raw = video({"title": "caf\xe9"}).replace("café".encode(), b"caf\xe9")  # the title's bytes made not UTF-8
    frames = media.probe_video_frames(raw, "reference_video", limit=100)
    print("non-UTF-8 title patched in:", b"caf\xe9" in raw, "-> frames:", frames)
    try:
        media.probe_video_frames(b"not a video" * 100, "reference_video", limit=100)
    except Exception as e:  # noqa: BLE001 - the typed refusal is what is shown
        print("junk ->", type(e).__name__, getattr(e, "code", ""), str(e)[:100])


if __name__ == "__main__":
    main()
