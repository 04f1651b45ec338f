"""What a running job's readers see besides steps: a phase after the steps (decode, mux) in the status
the stage publishes; and, when its stage dies mid-job — the status still says ``running``, its last
writer is gone — that no live worker holds it (the gateway's video object and ``stageferry status``),
until one is back.

A module of its own: its last test kills the diffusion stage of its module's deployment (real
processes, Redis, uvicorn).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from stageferry.cli import app
from tests.gateway.conftest import Deployment
from tests.procs import wait_for

pytestmark = pytest.mark.timeout(300)

SMALL = {"width": "64", "height": "64", "fps": "8", "num_frames": "1", "num_inference_steps": "1"}


def video(http: httpx.Client, vid: str) -> dict[str, Any]:
    body: dict[str, Any] = http.get(f"/v1/videos/{vid}").json()
    return body


def test_a_phase_after_the_steps_is_in_the_status(deployment: Deployment, http: httpx.Client) -> None:
    vid = http.post("/v1/videos", data={"prompt": "phase:60 a long decode", **SMALL}).json()["id"]
    client = deployment.services.client()

    def in_phase() -> Any:
        status = client.status(vid)
        return status if status is not None and status.progress is not None and status.progress.phase else None

    status = wait_for(in_phase, 60, "the phase in the status")
    assert status.progress.stage == "diffusion" and status.progress.phase == "decode"
    http.delete(f"/v1/videos/{vid}")
    wait_for(lambda: video(http, vid)["stageferry_state"] == "cancelled", 60, "the cancel")


@pytest.mark.slow
def test_a_job_whose_stage_died_says_no_live_worker_holds_it(deployment: Deployment, http: httpx.Client) -> None:
    vid = http.post("/v1/videos", data={"prompt": "sleep:120 held by a stage that dies", **SMALL}).json()["id"]
    running = wait_for(lambda: (v := video(http, vid))["stageferry_state"] == "running" and v["progress"] >= 50
                       and v, 120, "the job at the diffusion stage")  # fmt: skip
    assert running["stageferry_note"] is None
    diffusion = deployment.services.procs[1]
    diffusion.send_signal(signal.SIGKILL)  # no drain: the heartbeat just stops
    diffusion.wait(timeout=30)
    stalled = wait_for(lambda: (v := video(http, vid))["stageferry_note"] and v, 60, "the note")
    assert stalled["status"] == "in_progress" and stalled["stageferry_state"] == "running"
    assert stalled["stageferry_note"].startswith("no live worker holds it: stage 'diffusion'")
    cli = CliRunner().invoke(app, ["--redis-url", deployment.redis_url, "--prefix", deployment.prefix, "status", vid])
    assert cli.exit_code == 0, cli.output
    assert '"state": "running"' in cli.stdout and "no live worker holds it: stage 'diffusion'" in cli.stderr
    # `submit --wait` follows a new job to the stage that has no worker: its live line says so (its first look
    # comes after LIVENESS_EVERY_S, 5 s)
    command = [sys.executable, "-m", "stageferry", "--redis-url", deployment.redis_url, "--prefix", deployment.prefix,
               "submit", "--prompt", "x", "--width", "64", "--height", "64", "--fps", "8", "--duration", "0.125",
               "--steps", "1", "--wait", "--timeout", "8"]  # fmt: skip
    waited = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    assert waited.returncode == 1 and "error [deadline_exceeded]" in waited.stderr, waited.stderr
    assert "no live worker holds it: stage 'diffusion'" in waited.stderr, waited.stderr
    deployment.services.start("diffusion", "b")  # a worker of that stage is back: the note goes
    deployment.services.wait_live("diffusion", "diffusion-b", timeout=180)
    back = wait_for(lambda: (v := video(http, vid))["stageferry_note"] is None and v, 60, "the note to go")
    assert back["stageferry_state"] in ("running", "queued")
    http.delete(f"/v1/videos/{vid}")
