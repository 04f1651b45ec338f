"""The reference pipeline end to end (CPU ranks): Redis + NIXL between stage groups, MP4 out.

* TP2 → TP4 over NIXL: all three tasks; the MP4 decodes back with PyAV to the requested facts.
* The same job over the inline connector: bit-identical frames and audio (same TP sizes).
* TP1 → TP1: the same job's frames within a small tolerance of the TP2 → TP4 run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest

from stageferry.cli import sample_media
from stageferry.schemas import RequestState, RequestStatus, Task
from tests.procs import Services, write_pipeline

pytestmark = pytest.mark.timeout(600)

JOB = {
    "prompt": "a paper boat in the rain",
    "width": 160,
    "height": 96,
    "fps": 8,
    "duration": 1.0,
    "num_inference_steps": 2,
    "seed": 7,
}


def deploy(tmp_path: Path, redis_url: str, prefix: str, *, connector: str, enc_tp: int, dif_tp: int) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "stageferry.stages.reference.encoder:factory", "tp": enc_tp},
            {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "tp": dif_tp},
        ],
        data_plane={"connector": connector, "inline_fallback_max_bytes": 64 << 20},
    )
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n' + path.read_text())  # top-level keys go first
    return Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={})


def run_jobs(svc: Services, jobs: dict[str, dict[str, Any]]) -> dict[str, RequestStatus]:
    svc.start("encoder", "a")
    svc.start("diffusion", "a")
    client = svc.client()
    rids = {}
    for name, job in jobs.items():
        uploads = sample_media(Task(job.get("task", "t2va")))
        rids[name] = client.submit(job, uploads=uploads)
    out = {}
    for name, rid in rids.items():
        status = client.wait(rid, timeout=300)
        assert status.state is RequestState.DONE, (name, status.error, svc.logs())
        out[name] = status
    return out


def decoded_frames(path: str) -> np.ndarray:
    with av.open(path) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)


def check_mp4(status: RequestStatus, job: dict[str, Any]) -> None:
    assert status.result is not None
    media = status.result.media
    frames = round(job["duration"] * job["fps"])
    assert media["video_codec"] == "h264" and media["pix_fmt"] == "yuv420p"
    assert (media["width"], media["height"], media["fps"], media["frames"]) == (
        job["width"],
        job["height"],
        job["fps"],
        frames,
    )
    assert media["audio_codec"] == "aac" and media["audio_channels"] == 2 and media["sample_rate"] == 32_000
    assert abs(media["duration_s"] - job["duration"]) < 0.2
    with av.open(status.result.location) as container:  # decoded independently of the writer's probe
        video = container.streams.video[0]
        assert video.codec_context.name == "h264" and video.codec_context.pix_fmt == "yuv420p"
        assert sum(1 for _ in container.decode(video=0)) == frames
    with av.open(status.result.location) as container:
        audio = container.streams.audio[0]
        assert audio.codec_context.name == "aac" and audio.codec_context.sample_rate == 32_000
        assert audio.codec_context.channels == 2


@pytest.mark.slow
def test_reference_pipeline_end_to_end(tmp_path_factory: pytest.TempPathFactory, redis_url: str, prefix: str) -> None:
    jobs = {
        "t2va": JOB,
        "fl2va": {**JOB, "task": "fl2va"},
        "ref2va": {**JOB, "task": "ref2va"},
    }
    with deploy(tmp_path_factory.mktemp("nixl"), redis_url, prefix + "-a", connector="nixl", enc_tp=2, dif_tp=4) as svc:
        nixl = run_jobs(svc, jobs)
        # the encoder wrote every payload into the pool slot its put leased: the VAE's latents in place,
        # the small rest copied by the model (none by the put)
        logs = "".join(p.read_text(errors="replace") for p in sorted(svc.tmp_path.glob("*.log")))
        assert logs.count('"staged_copies": 0') == len(jobs), svc.logs()
    for name, status in nixl.items():
        check_mp4(status, jobs[name])
        hop = [t for t in status.timings if t.stage == "diffusion"][-1]
        assert hop.transport.value == "nixl" and hop.payload_bytes > 65_536, name

    with deploy(
        tmp_path_factory.mktemp("inline"), redis_url, prefix + "-b", connector="inline", enc_tp=2, dif_tp=4
    ) as svc:
        inline = run_jobs(svc, {"t2va": JOB})["t2va"]
    assert [t for t in inline.timings if t.stage == "diffusion"][-1].transport.value == "inline"
    assert inline.result is not None and nixl["t2va"].result is not None
    for key in ("frames_sha256", "audio_sha256"):  # NIXL or inline: the same bits in, the same output
        assert inline.result.data[key] == nixl["t2va"].result.data[key]

    with deploy(tmp_path_factory.mktemp("tp1"), redis_url, prefix + "-c", connector="nixl", enc_tp=1, dif_tp=1) as svc:
        tp1 = run_jobs(svc, {"t2va": JOB})["t2va"]
    assert tp1.result is not None
    a, b = decoded_frames(tp1.result.location), decoded_frames(nixl["t2va"].result.location)
    assert a.shape == b.shape
    assert np.abs(a - b).mean() <= 2.0, "TP1 and TP2/TP4 agree within tolerance (float reduction order)"
