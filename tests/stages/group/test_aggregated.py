"""Aggregated mode: the reference models in one group give the disaggregated pipeline's exact output.

Two deployments of the same pipeline file side by side (own key prefixes): disaggregated (encoder TP2 →
NIXL → diffusion TP4) and ``mode = "aggregated"`` (one service: one group of four ranks laid out TP2 × SP2
for the job fan-out, running the encoder on ranks 0-1 as TP2 and the diffusion model on all four as TP4).  The same jobs
and seeds give bit-identical frames and audio (the digests of the tensors handed to the MP4 writer; the MP4s'
decoded frames agree within the encoder's own run-to-run noise), and the aggregated group never touched
a connector.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stageferry.cli import sample_media
from stageferry.config import PipelineConfig
from stageferry.schemas import RequestState, RequestStatus, Task
from tests.procs import Services, write_pipeline
from tests.test_pipeline_e2e import JOB, check_mp4, decoded_frames

pytestmark = pytest.mark.timeout(600)

STAGES: list[dict[str, Any]] = [
    {"name": "encoder", "model": "stageferry.stages.reference.encoder:factory", "tp": 2},
    {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "layout": {"tp": 4}},
]
JOBS: dict[str, dict[str, Any]] = {"t2va": JOB, "fl2va": {**JOB, "task": "fl2va"}, "t2va again": JOB}


def deploy(tmp_path: Path, redis_url: str, prefix: str, *, mode: str) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        STAGES,
        data_plane={"connector": "nixl"},
        aggregated={"layout": {"tp": 2, "sp": 2}},  # jobs fan out over a TP2 x SP2 grid (ignored when split)
    )
    path.write_text(f'mode = "{mode}"\noutput_dir = "{tmp_path / "out"}"\n' + path.read_text())
    return Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={})


def submit(svc: Services) -> dict[str, str]:
    client = svc.client()
    return {name: client.submit(job, uploads=sample_media(Task(job.get("task", "t2va")))) for name, job in JOBS.items()}


def wait(svc: Services, rids: dict[str, str]) -> dict[str, RequestStatus]:
    out = {}
    for name, rid in rids.items():
        status = svc.client().wait(rid, timeout=400)
        assert status.state is RequestState.DONE, (name, status.error, svc.logs())
        out[name] = status
    return out


def stopped(svc: Services) -> list[dict[str, Any]]:
    events = []
    for log in sorted(svc.tmp_path.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"group.stopped"' in line:
                events.append(json.loads(line))
    return events


def test_aggregated_config_folds_the_stages_into_one() -> None:
    pipeline = PipelineConfig.model_validate({"mode": "aggregated", "stages": STAGES})
    (stage,) = pipeline.stages
    assert (
        stage.name == "encoder" and stage.world_size == 4 and [p.name for p in stage.parts] == ["encoder", "diffusion"]
    )
    assert [s.name for s in pipeline.disaggregated().stages] == ["encoder", "diffusion"]
    again = PipelineConfig.model_validate(pipeline.model_dump(mode="json"))
    assert again == pipeline, "a dumped aggregated config loads back unchanged"


@pytest.mark.slow
def test_aggregated_and_disaggregated_give_identical_frames(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, prefix: str
) -> None:
    dis = deploy(tmp_path_factory.mktemp("disaggregated"), redis_url, prefix + "-d", mode="disaggregated")
    agg = deploy(tmp_path_factory.mktemp("aggregated"), redis_url, prefix + "-a", mode="aggregated")
    with dis, agg:
        dis.start("encoder", "a")
        dis.start("diffusion", "a")
        group = agg.start("encoder", "a")  # the aggregated stage keeps the first stage's name
        dis_rids, agg_rids = submit(dis), submit(agg)
        split, together = wait(dis, dis_rids), wait(agg, agg_rids)
        group.send_signal(signal.SIGTERM)
        assert group.wait(timeout=60) == 0
        (event,) = stopped(agg)

    # The aggregated group: four ranks, and not one payload put or get on any of them.
    assert event["rank_calls"] == [[0, 0]] * 4 and event["layout"] == "tp2xsp2"
    assert [r[:2] for r in event["rank_receipts"]] == [[3, 0]] * 4, "every job reached every rank once"
    for name, job in JOBS.items():
        a, d = together[name], split[name]
        check_mp4(a, job)
        assert a.result is not None and d.result is not None
        assert [t.stage for t in a.timings] == ["encoder"] and a.timings[0].transport.value == "none"
        assert [t.stage for t in d.timings] == ["encoder", "diffusion"] and d.timings[-1].transport.value == "nixl"
        info = a.result.data["aggregated"]
        assert info["parts"] == ["encoder", "diffusion"] and info["handovers"][0]["bytes"] > 0
        for key in ("frames_sha256", "audio_sha256"):  # the frames and audio the model produced: same bits
            assert a.result.data[key] == d.result.data[key], (name, key)
        # The MP4s hold those frames H.264-encoded at a constant quantiser: decoded, they are identical too.
        a_frames, d_frames = decoded_frames(a.result.location), decoded_frames(d.result.location)
        assert a_frames.shape == d_frames.shape
        assert np.array_equal(a_frames, d_frames), (name, float(np.abs(a_frames - d_frames).mean()))
    for statuses in (together, split):  # the same job twice: the same frames (and, above, the same MP4 facts)
        first, again = statuses["t2va"].result, statuses["t2va again"].result
        assert first is not None and again is not None
        assert first.data["frames_sha256"] == again.data["frames_sha256"]
