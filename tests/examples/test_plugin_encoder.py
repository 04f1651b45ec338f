"""The plug-in example, run exactly as ``docs/plugins.md`` says: ``PYTHONPATH=examples/plugin_encoder
stageferry --pipeline examples/plugin_encoder/pipeline.toml up`` — a private Redis, the example encoder
as its own stage process, the reference diffusion stage as a TP2 group, one t2va job to ``done``.

The services run in a temporary directory (the example's ``output_dir = "out"`` lands there), with the
example's directory on ``PYTHONPATH`` as an absolute path: the same command from another directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import av
import pytest

from stageferry.config import PipelineConfig
from tests.procs import ROOT

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
