"""Regenerates the bundled sample media used by ``stageferry up --task fl2va|ref2va`` (small, synthetic)."""

from __future__ import annotations

import io
import math
import wave
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parent.parent / "stageferry" / "samples"
W, H = 320, 192


def frame(t: float) -> Image.Image:
    img = Image.new("RGB", (W, H), (int(40 + 80 * t), 90, int(200 - 120 * t)))
    draw = ImageDraw.Draw(img)
    x = int(20 + t * (W - 100))
    draw.ellipse([x, 60, x + 70, 130], fill=(250, 200, 60))
    draw.rectangle([0, 150, W, H], fill=(30, 110, 60))
    return img


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    frame(0.0).save(OUT / "first_frame.png", optimize=True)
    frame(1.0).save(OUT / "last_frame.png", optimize=True)
    with av.open(str(OUT / "reference_video.mp4"), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = W, H, "yuv420p"
        stream.options = {"crf": "32", "preset": "veryfast"}
        for i in range(16):
            for packet in stream.encode(av.VideoFrame.from_image(frame(i / 15))):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    rate, seconds = 16_000, 2.0
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.3 * np.sin(2 * math.pi * 220 * t) * (0.5 + 0.5 * np.sin(2 * math.pi * 2 * t))).astype(np.float32)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((tone * 32767).astype("<i2").tobytes())
    (OUT / "reference_audio.wav").write_bytes(buf.getvalue())
    for f in sorted(OUT.iterdir()):
        print(f.name, f.stat().st_size)


if __name__ == "__main__":
    main()
