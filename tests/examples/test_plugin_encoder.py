"""The plug-in example, run exactly as ``docs/plugins.md`` says: ``PYTHONPATH=examples/plugin_encoder
stageferry --pipeline examples/plugin_encoder/pipeline.toml up`` — a private Redis, the example encoder
as its own stage process, the reference diffusion stage as a TP2 group, one t2va job to ``done``.

The services run in a temporary directory (the example's ``output_dir = "out"`` lands there), with the
example's directory on ``PYTHONPATH`` as an absolute path: the same command from another directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import av
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.client import SyncClient
from stageferry.config import PipelineConfig
from stageferry.errors import JobValidationError
from stageferry.schemas import RequestState
from tests.procs import ROOT, Services

pytestmark = pytest.mark.timeout(600)
EXAMPLE = ROOT / "examples" / "plugin_encoder"


def test_the_example_pipeline_names_the_plugin_and_the_reference_diffusion() -> None:
    pipeline = PipelineConfig.load(EXAMPLE / "pipeline.toml")
    assert [s.model for s in pipeline.stages] == [
        "tiny_encoder:factory",
        "stageferry.stages.reference.diffusion:factory",
    ]


@pytest.mark.slow
def test_the_documented_command_runs_the_example_to_done(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), str(ROOT)])
    command = [
        *(sys.executable, "-m", "stageferry", "--pipeline", str(EXAMPLE / "pipeline.toml"), "up"),
        *("--width", "160", "--height", "96", "--fps", "8", "--duration", "1", "--steps", "2"),
        *("--startup-timeout", "180", "--timeout", "400", "--log-dir", str(tmp_path / "logs")),
        *("--warm-runs", "0"),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    logs = "".join(p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log"))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert ": done" in result.stdout, result.stdout
    videos = list((tmp_path / "out").glob("*.mp4"))
    assert len(videos) == 1, result.stdout
    with av.open(str(videos[0])) as container:
        stream = container.streams.video[0]
        assert (stream.width, stream.height) == (160, 96)
        assert sum(1 for _ in container.decode(video=0)) == 8
        assert container.streams.audio[0].sample_rate == 32_000


def test_a_task_the_example_cannot_serve_is_refused_on_submission(redis_url: str, prefix: str) -> None:
    """limits.tasks = ["t2va"]: the client refuses fl2va before anything is enqueued (the gateway and the
    first stage run the same check), naming `task`; a prompt beyond the text model's length likewise."""
    pipeline = PipelineConfig.load(EXAMPLE / "pipeline.toml")
    with SyncClient(redis_url, prefix=prefix, pipeline=pipeline) as client:
        with pytest.raises(JobValidationError) as refused:
            client.submit({"task": "fl2va", "prompt": "x", "media": {"first_frame": {"path": "/a.png"},
                                                                    "last_frame": {"path": "/b.png"}}})  # fmt: skip
        assert refused.value.field_errors[0]["field"] == "task"
        assert refused.value.field_errors[0]["type"] == "unsupported_task"
        with pytest.raises(JobValidationError, match="at most 254 characters"):
            client.submit({"prompt": "x" * 300})
    with sync_redis.Redis.from_url(redis_url) as r:
        assert r.xlen(Keys(prefix).stage_stream("encoder")) == 0  # nothing was enqueued


@pytest.mark.slow
def test_the_example_encoder_refuses_at_entry_what_it_cannot_serve(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """A raw client skips the client's checks: the example's own stage refuses its fl2va entry as the job's
    fault (`invalid_job`, field `task`) at admission, before any media is read, instead of the
    diffusion stage failing it later as `payload_contract`; and a prompt of more tokens than its text
    model reads (in utf-8 bytes, under the character limit) is refused by the model, naming `prompt`."""
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(ROOT)])}
    with Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=EXAMPLE / "pipeline.toml",
                  extra_env=env) as services:  # fmt: skip
        services.start("encoder", "a")
        services.wait_live("encoder", "encoder-a", timeout=180)
        keys = services.keys  # upload keys that were never written: the refusal comes before any is read
        media = {n: {"upload_key": keys.upload("raw-fl2va", n)} for n in ("first_frame", "last_frame")}
        fl2va = {"task": "fl2va", "prompt": "x", "width": 64, "height": 64, "num_frames": 1, "media": media}
        long = {"prompt": "é" * 200, "width": 64, "height": 64, "num_frames": 1}  # 200 chars, 400 bytes
        with sync_redis.Redis.from_url(redis_url) as r:
            stream = services.keys.stage_stream("encoder")
            r.xadd(stream, {"request_id": "raw-fl2va", "job": json.dumps(fl2va)})
            r.xadd(stream, {"request_id": "raw-long", "job": json.dumps(long)})
        client = services.client()
        for rid, field, kind in (("raw-fl2va", "task", "unsupported_task"), ("raw-long", "prompt", "too_many_tokens")):
            status = client.wait(rid, timeout=120)
            assert status.state is RequestState.REJECTED and status.error is not None, status
            assert status.error.code == "invalid_job", status.error
            (error,) = status.error.details["field_errors"]
            assert (error["field"], error["type"]) == (field, kind), status.error
        refused = client.status("raw-fl2va")
        assert refused is not None and refused.error is not None
        assert refused.error.message.endswith("this deployment serves t2va only (limits.tasks)")  # at admission
