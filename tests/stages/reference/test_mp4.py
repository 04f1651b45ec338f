"""The MP4 writer and prober: H.264 yuv420p + AAC stereo 32 kHz, decoded back with PyAV."""

from __future__ import annotations

import math
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from stageferry.stages.reference.mp4 import h264_encoder, probe_mp4, write_mp4


def clip(frames: int, height: int, width: int, fps: int) -> tuple[torch.Tensor, torch.Tensor]:
    y, x = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    video = torch.stack(
        [
            torch.stack([(x * 255 // width + 9 * i) % 256, y * 255 // height, torch.full_like(x, 128)], dim=-1)
            for i in range(frames)
        ]
    ).to(torch.uint8)
    samples = round(frames * 32_000 / fps)
    t = torch.arange(samples) / 32_000
    audio = torch.stack([0.3 * torch.sin(2 * math.pi * 440 * t), 0.3 * torch.sin(2 * math.pi * 550 * t)])
    return video, audio


def test_h264_encoder_is_found() -> None:
    name = h264_encoder()
    assert av.codec.Codec(name, "w").name in {"libx264", "h264_nvenc", "h264_qsv", "h264_amf", "h264_v4l2m2m"}


@pytest.mark.parametrize(("frames", "fps", "width", "height"), [(48, 24, 320, 192), (13, 10, 96, 64)])
def test_written_mp4_decodes_with_the_requested_facts(
    tmp_path: Path, frames: int, fps: int, width: int, height: int
) -> None:
    video, audio = clip(frames, height, width, fps)
    path = write_mp4(tmp_path / "sub" / "out.mp4", video, fps, audio, 32_000)
    assert path.exists() and not list((tmp_path / "sub").glob(".*part"))

    facts = probe_mp4(path)
    assert facts == probe_mp4(path, count_frames=True)
    assert facts["video_codec"] == "h264" and facts["pix_fmt"] == "yuv420p"
    assert (facts["width"], facts["height"], facts["fps"], facts["frames"]) == (width, height, fps, frames)
    assert (facts["audio_codec"], facts["audio_channels"], facts["sample_rate"]) == ("aac", 2, 32_000)
    assert facts["duration_s"] == pytest.approx(frames / fps)
    assert facts["audio_duration_s"] == pytest.approx(frames / fps, abs=0.05)

    with av.open(str(path)) as container:
        decoded = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        container.seek(0)
        pcm = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1)
    assert len(decoded) == frames and decoded[0].shape == (height, width, 3)
    # lossy, but the picture is the one written
    assert np.abs(decoded[-1].astype(np.float32) - video[-1].numpy()).mean() < 8.0
    assert pcm.shape[0] == 2 and abs(pcm.shape[1] - audio.shape[1]) <= 2048
    assert 0.1 < float(np.abs(pcm).max()) <= 1.0


def test_video_only(tmp_path: Path) -> None:
    video, _ = clip(5, 64, 64, 5)
    facts = probe_mp4(write_mp4(tmp_path / "v.mp4", video, 5))
    assert facts["frames"] == 5 and "audio_codec" not in facts
