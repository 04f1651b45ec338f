"""The stage worker's outcomes with real stage processes: a cancel while the reference sampler denoises.

Reference encoder (TP1) and reference diffusion (TP2, so a follower rank has to stop too) over the
inline connector.  The job asks for many steps; once the diffusion stage reports progress it is
cancelled, and must end ``cancelled`` (not ``failed``) having run fewer steps than asked, with its
group still serving the next request.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stageferry.schemas import RequestState
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(400)

STEPS = 200
JOB = {"prompt": "a paper boat in the rain", "width": 160, "height": 96, "fps": 8, "duration": 1.0, "seed": 7}


def test_cancel_mid_denoise_ends_cancelled_and_the_group_carries_on(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "stageferry.stages.reference.encoder:factory", "tp": 1},
            {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "tp": 2},
        ],
        data_plane={"connector": "inline"},
        limits={"max_steps": STEPS},
    )
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n' + path.read_text())
    with Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={}) as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        svc.wait_live("encoder", "encoder-a", timeout=180)
        svc.wait_live("diffusion", "diffusion-a", timeout=180)
        client = svc.client()
        rid = client.submit({**JOB, "num_inference_steps": STEPS})

        def denoising() -> bool:
            status = client.status(rid)
            assert status is not None and not status.state.terminal, (status, svc.logs())
            progress = status.progress
            return progress is not None and progress.stage == "diffusion" and progress.step >= 2

        wait_for(denoising, 180, "the diffusion stage to denoise")
        assert client.cancel(rid)
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.CANCELLED, (status, svc.logs())
        assert status.error is not None and status.error.code == "cancelled"
        assert status.stage == "diffusion"
        assert 2 <= status.error.details["step"] < STEPS  # stopped by the sampler, mid-denoise
        assert '"event": "group.follower_cancelled"' in svc.logs()

        after = client.submit({**JOB, "num_inference_steps": 2})  # the group did not hang
        done = client.wait(after, timeout=180)
        assert done.state is RequestState.DONE, (done, svc.logs())
