"""The diffusers pair as a deployment: a real Redis, the encoder and diffusion stages as their own
processes, the payload over NIXL (``inline_max_bytes = 0``: the tiny payload would otherwise ride
inline) or the inline connector — and the frames and audio the plain one-process pipeline gives.
Also ``stageferry up`` on the example pipeline file: an MP4, and the hop with its transport and bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import av
import pytest

from stageferry.schemas import RequestState, RequestStatus
from tests.integrations.conftest import JOBS, baseline, first_frame_png, options
from tests.procs import ROOT, Services, write_pipeline

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
TASKS = {"ltx2": ["t2va", "i2va"], "wan": ["t2va"]}  # what each family serves (limits.tasks), as the examples say


def deploy(tmp_path: Path, redis_url: str, prefix: str, checkpoint: Path, family: str, connector: str) -> Services:
    opts = options(checkpoint, family)
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "stageferry.integrations.diffusers:encoder", "device": "cpu"},
            {"name": "diffusion", "model": "stageferry.integrations.diffusers:diffusion", "device": "cpu"},
        ],
        data_plane={"connector": connector, "inline_max_bytes": 0 if connector == "nixl" else 65_536},
        limits={"tasks": TASKS[family]},
    )
    text = path.read_text().replace('model = "stageferry.integrations.diffusers:encoder"', _with(opts, "encoder"))
    text = text.replace('model = "stageferry.integrations.diffusers:diffusion"', _with(opts, "diffusion"))
    path.write_text(f'output_dir = "{tmp_path / "out"}"\n' + text)
    return Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={"HF_HUB_OFFLINE": "1"})


def _with(opts: dict[str, Any], part: str) -> str:
    from tests.procs import toml_value

    return f'model = "stageferry.integrations.diffusers:{part}"\noptions = {toml_value(opts)}'


def run(svc: Services, jobs: dict[str, tuple[dict[str, Any], dict[str, Path]]]) -> dict[str, RequestStatus]:
    svc.start("encoder", "a")
    svc.start("diffusion", "a")
    client = svc.client()
    rids = {name: client.submit(job, uploads=uploads) for name, (job, uploads) in jobs.items()}
    out = {}
    for name, rid in rids.items():
        status = client.wait(rid, timeout=400)
        assert status.state is RequestState.DONE, (name, status.error, svc.logs())
        out[name] = status
    return out


def hop(status: RequestStatus) -> Any:
    return [t for t in status.timings if t.stage == "diffusion"][-1]


def test_ltx2_over_nixl_and_inline_gives_the_one_process_frames_and_audio(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, prefix: str, checkpoints: dict[str, Path]
) -> None:
    png = tmp_path_factory.mktemp("media") / "first.png"
    png.write_bytes(first_frame_png())
    i2va = {**JOBS["ltx2"], "task": "i2va"}
    jobs = {"t2va": (JOBS["ltx2"], {}), "i2va": (i2va, {"first_frame": png})}
    ckpt = checkpoints["ltx2"]
    with deploy(tmp_path_factory.mktemp("nixl"), redis_url, prefix + "-n", ckpt, "ltx2", "nixl") as svc:
        nixl = run(svc, jobs)
    with deploy(tmp_path_factory.mktemp("inline"), redis_url, prefix + "-i", ckpt, "ltx2", "inline") as svc:
        inline = run(svc, {"t2va": jobs["t2va"]})["t2va"]
    plain = baseline(ckpt, "ltx2", JOBS["ltx2"])
    plain_i2va = baseline(ckpt, "ltx2", JOBS["ltx2"], image=png.read_bytes())
    for status, want, transport in (
        (nixl["t2va"], plain, "nixl"),
        (inline, plain, "inline"),
        (nixl["i2va"], plain_i2va, "nixl"),
    ):  # noqa: E501
        assert status.result is not None
        assert (status.result.data["frames_sha256"], status.result.data["audio_sha256"]) == (
            want["frames_sha256"],
            want["audio_sha256"],
        ), transport
        assert hop(status).transport.value == transport and hop(status).payload_bytes > 8_000
        with av.open(status.result.location) as container:
            assert container.streams.audio[0].sample_rate == 16_000
            assert sum(1 for _ in container.decode(video=0)) == JOBS["ltx2"]["num_frames"]


def test_the_openai_sdk_gets_an_i2va_job_from_one_image_on_ltx2(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, prefix: str, checkpoints: dict[str, Path]
) -> None:
    """The real ``openai`` SDK against a real gateway on the LTX-2 pair (tasks t2va and i2va: no fl2va):
    ``create(input_reference=<one image>)`` names no task; the gateway infers i2va, a task this deployment
    serves, the video object says so, and its frames and audio are the one-process i2va pipeline's."""
    import openai

    from stageferry.config import PipelineConfig
    from stageferry.gateway import GatewayConfig
    from tests.gateway.conftest import running_gateway

    tmp = tmp_path_factory.mktemp("sdk")
    png = tmp / "first.png"
    png.write_bytes(first_frame_png())
    job = JOBS["ltx2"]
    with deploy(tmp, redis_url, prefix + "-s", checkpoints["ltx2"], "ltx2", "inline") as svc:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        config = GatewayConfig(redis_url=redis_url, prefix=prefix + "-s", pipeline=PipelineConfig.load(svc.pipeline))
        with (
            running_gateway(config) as base,
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120) as sdk,
        ):
            extra = {k: job[k] for k in ("negative_prompt", "fps", "num_frames", "num_inference_steps", "seed")}
            created = sdk.videos.create(
                prompt=job["prompt"], size="64x64", input_reference=png,  # type: ignore[arg-type]
                extra_body={**extra, "guidance_scale": job["guidance"]},
            )  # fmt: skip
            assert created.model_extra is not None and created.model_extra["task"] == "i2va", created
            video = sdk.videos.poll(created.id, poll_interval_ms=200)
            assert video.status == "completed", (video, svc.logs())
            assert video.model_extra is not None and video.model_extra["task"] == "i2va"
            assert sdk.videos.download_content(video.id).read()[4:8] == b"ftyp"
        status = svc.client().status(video.id)
    assert status is not None and status.result is not None
    want = baseline(checkpoints["ltx2"], "ltx2", job, image=png.read_bytes())
    got = (status.result.data["frames_sha256"], status.result.data["audio_sha256"])
    assert got == (want["frames_sha256"], want["audio_sha256"])


def test_wan_over_nixl_gives_the_one_process_frames_and_says_it_has_no_audio(
    tmp_path: Path, redis_url: str, prefix: str, checkpoints: dict[str, Path]
) -> None:
    with deploy(tmp_path, redis_url, prefix, checkpoints["wan"], "wan", "nixl") as svc:
        status = run(svc, {"t2va": (JOBS["wan"], {})})["t2va"]
    assert status.result is not None
    assert status.result.data["frames_sha256"] == baseline(checkpoints["wan"], "wan", JOBS["wan"])["frames_sha256"]
    assert status.result.data["audio"] == "none: this pipeline makes video only"
    assert hop(status).transport.value == "nixl"
    with av.open(status.result.location) as container:
        assert not container.streams.audio and container.streams.video[0].frames == JOBS["wan"]["num_frames"]


def test_stageferry_up_runs_the_example_to_an_mp4_over_nixl(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    example = (ROOT / "examples" / "diffusers" / "wan-tiny.toml").read_text()
    pipeline = tmp_path / "wan-tiny.toml"
    pipeline.write_text(example.replace("/tmp/stageferry-tiny/wan", str(checkpoints["wan"])))
    env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")}
    env |= {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env["HF_HUB_OFFLINE"] = "1"
    command = [
        *(sys.executable, "-m", "stageferry", "--pipeline", str(pipeline), "up"),
        *("--width", "64", "--height", "64", "--fps", "16", "--duration", "0.5", "--steps", "2"),
        *("--startup-timeout", "240", "--timeout", "400", "--log-dir", str(tmp_path / "logs")),
        *("--warm-runs", "0"),
    ]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    logs = "".join(p.read_text()[-3000:] for p in (tmp_path / "logs").glob("*.log"))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert ": done" in result.stdout and "nixl" in result.stdout, result.stdout
    videos = list((tmp_path / "out").glob("*.mp4"))
    assert len(videos) == 1, result.stdout
    with av.open(str(videos[0])) as container:
        assert container.streams.video[0].frames == 9  # 0.5 s × 16 fps = 8 frames, rounded to 4k+1
    print(result.stdout)
