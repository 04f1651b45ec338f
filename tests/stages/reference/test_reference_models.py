"""The reference encoder and diffusion models, run directly with a hand-built ``StageContext``.

TP equivalence: the models run in-process as TP1 (``process_group=None``, as the runtime gives a
one-rank stage) and in spawned gloo groups of 2 and 4 ranks (``tcp://127.0.0.1:<free port>``).

Tolerances (the ranks of one group must agree bit for bit; different TP sizes differ only by float
summation order in the row-parallel all_reduces):

* encoder text hidden states (bf16): TP2/TP4 vs TP1 within ``atol = rtol = 2e-2`` (a few bf16 ulps),
  mean abs diff below 1e-3; role ids and layout exactly; the (replicated) VAE / audio latents 1e-5;
* diffusion frames (uint8): TP2/TP4 vs TP1 mean abs diff ≤ 2 levels; audio mean abs diff ≤ 1e-2.

Seen on a 2-core CPU: hidden states differ by at most 2.4e-4 (one bf16 ulp, on 0.03 % of values), frames
by at most 1 level (mean 0.000), audio by at most 5e-6 — the bounds leave room for other BLAS builds.
"""

from __future__ import annotations

import dataclasses
import io
import math
import wave
from fractions import Fraction
from pathlib import Path
from typing import Any, TypedDict

import av
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from stageferry.broker.data.payload_codec import decode_inline, encode_inline
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import free_port
from stageferry.errors import CancelledRequestError, JobValidationError, PayloadContractError
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_layout import LAYOUT_VERSION, Layout
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.stages.reference import diffusion, encoder
from stageferry.stages.reference.mp4 import probe_mp4
from stageferry.testing import assert_same, tensor_bytes, tensors_of

pytestmark = pytest.mark.timeout(120)
PIPE = PipelineConfig()


class DiffusionSize(TypedDict):
    """The transformer-size arguments of :func:`stageferry.stages.reference.diffusion.factory`."""

    dim: int
    heads: int
    layers: int


SMALL: DiffusionSize = {"dim": 64, "heads": 4, "layers": 2}  # diffusion model size for the tests
PROMPT33 = "a red fox runs through deep snow."
assert len(PROMPT33.encode()) == 33


# ----------------------------------------------------------------------------------------------- media


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    img = Image.new("RGB", size, colour)
    img.paste((255 - colour[0], 255 - colour[1], 255 - colour[2]), (5, 5, 20, 15))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def tiny_video(frames: int = 12, fps: int = 12, size: tuple[int, int] = (64, 48)) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.time_base = Fraction(1, fps)
        for i in range(frames):
            arr = np.zeros((size[1], size[0], 3), dtype=np.uint8)
            arr[:, : (i * 5) % size[0]] = (200, 40, 10 * i)
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buf.getvalue()


def wav(seconds: float = 1.5, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    left = 0.4 * np.sin(2 * math.pi * 440 * t)
    right = 0.3 * np.sin(2 * math.pi * 660 * t)
    pcm = (np.stack([left, right], axis=1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


MEDIA = ("first_frame", "last_frame", "reference_video", "reference_audio")


def media() -> dict[str, bytes]:
    return {
        "first_frame": png((250, 30, 30)),
        "last_frame": png((20, 40, 240)),
        "reference_video": tiny_video(),
        "reference_audio": wav(),
    }


def job(task: str = "t2va", **kw: Any) -> JobRequest:
    base: dict[str, Any] = {"prompt": PROMPT33, "width": 128, "height": 64, "fps": 8, "num_frames": 9}
    base["num_inference_steps"] = 3
    if task == "fl2va":
        base["media"] = {"first_frame": {"path": "f.png"}, "last_frame": {"path": "l.png"}}
    elif task == "ref2va":
        base["media"] = {"reference_video": {"path": "v.mp4"}, "reference_audio": {"path": "a.wav"}}
    return JobRequest(task=task, **(base | kw))


def context(tmp: Path, *, rank: int = 0, world: int = 1, group: Any = None, **kw: Any) -> StageContext:
    return StageContext(
        stage="test",
        rank=rank,
        world_size=world,
        device=kw.pop("device", torch.device("cpu")),
        request_id=kw.pop("request_id", "req-1"),
        key="req-1_0_0",
        output_dir=tmp,
        process_group=group,
        media=kw.pop("media", media()),
        **kw,
    )


def run_models(ctx: StageContext, tmp: Path) -> dict[str, Any]:
    """Encoder payloads for the three tasks, and one diffusion run per task (frames, audio, MP4 facts)."""
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=512)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    out: dict[str, Any] = {}
    for task in ("t2va", "fl2va", "ref2va"):
        j = job(task, negative_prompt="blurry" if task == "t2va" else "")
        payload = enc(j, None, ctx)
        gen = dif.generate(j, payload, ctx)
        out[task] = {"payload": payload, "frames": gen.frames, "audio": gen.audio}
        if task == "t2va":  # the runtime's call: rank 0 writes the MP4, followers return None
            final = dif(j, payload, ctx)
            if ctx.rank == 0:
                assert isinstance(final, FinalOutput) and final.path is not None
                out["mp4"] = probe_mp4(final.path, count_frames=True)
            else:
                assert final is None
    return out


def _rank_main(rank: int, world: int, port: int, tmp: str) -> None:
    """One spawned rank.  Its arguments stay small: a spawn pickle larger than a pipe buffer makes the
    parent wait for each child to finish importing torch, which serialises the start-up."""
    torch.set_num_threads(1)
    blobs = {name: (Path(tmp) / "media" / name).read_bytes() for name in MEDIA}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ctx = context(Path(tmp), rank=rank, world=world, group=dist.group.WORLD, media=blobs)
        torch.save(run_models(ctx, Path(tmp)), Path(tmp) / f"tp{world}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """{tp size: [each rank's results]} for TP1 (in-process), TP2 and TP4 (spawned gloo groups)."""
    tmp = tmp_path_factory.mktemp("tp")
    blobs = media()
    (tmp / "media").mkdir()
    for name, data in blobs.items():
        (tmp / "media" / name).write_bytes(data)
    results = {1: [run_models(context(tmp, media=blobs), tmp)]}
    for world in (2, 4):
        mp.spawn(_rank_main, args=(world, free_port(), str(tmp)), nprocs=world, join=True)
        results[world] = [torch.load(tmp / f"tp{world}-rank{r}.pt", weights_only=False) for r in range(world)]
    return results


# ------------------------------------------------------------------------------------------ TP tests


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_of_one_group_agree_bit_for_bit(runs: dict[int, list[dict[str, Any]]], world: int) -> None:
    lead, *followers = runs[world]
    for other in followers:
        for task in ("t2va", "fl2va", "ref2va"):
            want, got = tensors_of(lead[task]["payload"]), tensors_of(other[task]["payload"])
            assert len(want) == len(got)
            for w, g in zip(want, got, strict=True):
                assert w.dtype == g.dtype and w.shape == g.shape and torch.equal(w, g), task
            assert {k: v for k, v in lead[task]["payload"].items() if not isinstance(v, dict | torch.Tensor)} == {
                k: v for k, v in other[task]["payload"].items() if not isinstance(v, dict | torch.Tensor)
            }
            assert torch.equal(lead[task]["frames"], other[task]["frames"]), task
            assert torch.equal(lead[task]["audio"], other[task]["audio"]), task
        assert "mp4" not in other


@pytest.mark.parametrize("world", [2, 4])
def test_tp_sizes_compute_the_same_function(runs: dict[int, list[dict[str, Any]]], world: int) -> None:
    for task in ("t2va", "fl2va", "ref2va"):
        ref, got = runs[1][0][task], runs[world][0][task]
        h_ref = ref["payload"]["text"]["hidden_states"].float()
        h_got = got["payload"]["text"]["hidden_states"].float()
        torch.testing.assert_close(h_got, h_ref, atol=2e-2, rtol=2e-2)
        assert (h_got - h_ref).abs().mean() < 1e-3
        assert torch.equal(got["payload"]["text"]["role_ids"], ref["payload"]["text"]["role_ids"])
        assert torch.equal(got["payload"]["layout"], ref["payload"]["layout"])
        for name in ("visual_latents", "audio_latents", "audio_style"):
            torch.testing.assert_close(got["payload"][name], ref["payload"][name], atol=1e-5, rtol=1e-5)
        diff = (got["frames"].float() - ref["frames"].float()).abs()
        assert diff.mean() <= 2.0, (task, float(diff.mean()))
        assert (got["audio"] - ref["audio"]).abs().mean() <= 1e-2


def test_tp_runs_write_the_mp4_on_rank_zero(runs: dict[int, list[dict[str, Any]]]) -> None:
    for world in (1, 2, 4):
        facts = runs[world][0]["mp4"]
        assert (facts["video_codec"], facts["pix_fmt"], facts["width"], facts["height"]) == ("h264", "yuv420p", 128, 64)
        assert facts["frames"] == 9 and facts["fps"] == 8.0
        assert (facts["audio_codec"], facts["audio_channels"], facts["sample_rate"]) == ("aac", 2, 32_000)


# ------------------------------------------------------------------------------------- payload shape


def test_t2va_payload_is_the_real_models_size(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE)
    payload = enc(JobRequest(prompt=PROMPT33, width=320, height=192, fps=24, duration=2.0), None, context(tmp_path))
    assert tensor_bytes(payload) == 359_024
    text = payload["text"]
    assert text["hidden_states"].shape == (35, 5120) and text["hidden_states"].dtype == torch.bfloat16
    assert text["role_ids"].tolist() == [0] + [1] * 33 + [0]
    assert payload["layout"].shape == (11,) and payload["layout"].dtype == torch.int64
    assert payload["visual_latents"].numel() == 0 and payload["audio_latents"].numel() == 0
    assert payload["audio_style"].shape == (1, 64) and payload["audio_style"].dtype == torch.float32
    assert payload["task"] == "t2va" and payload["meta"]["layout_version"] == LAYOUT_VERSION


def test_task_slots(runs: dict[int, list[dict[str, Any]]]) -> None:
    r = runs[1][0]
    t2va, fl2va, ref2va = (r[t]["payload"] for t in ("t2va", "fl2va", "ref2va"))
    # t2va: a negative prompt appends its own tokens, all with role 2
    roles = t2va["text"]["role_ids"]
    assert roles.shape == (35 + 8,) and roles[35:].eq(2).all() and t2va["meta"]["negative_tokens"] == 8
    assert t2va["visual_latents"].shape == (0, 16, 3, 8, 16) and t2va["audio_latents"].shape == (1, 64, 0)
    assert fl2va["visual_latents"].shape == (2, 16, 1, 8, 16) and fl2va["visual_latents"].abs().sum() > 0
    assert Layout.from_tensor(fl2va["layout"]).keyframes == (0, 8)
    # the colour channels make the first (red) and last (blue) frame latents differ
    assert not torch.allclose(fl2va["visual_latents"][0], fl2va["visual_latents"][1])
    # 12 frames at 12 fps resampled to 8 fps → 8 frames → 3 latent frames; 1.5 s of audio → 75 + 1 latents
    assert ref2va["visual_latents"].shape == (1, 16, 3, 8, 16)
    assert ref2va["audio_latents"].shape == (1, 64, 76)
    torch.testing.assert_close(ref2va["audio_style"], ref2va["audio_latents"].mean(dim=2))
    assert ref2va["meta"]["reference_latent_frames"] == 3


def test_payloads_survive_the_inline_codec(runs: dict[int, list[dict[str, Any]]], tmp_path: Path) -> None:
    """The data plane's inline codec carries every slot, and the frames made from the copy are the same."""
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    for task in ("t2va", "fl2va", "ref2va"):
        payload = runs[1][0][task]["payload"]
        decoded = decode_inline(*encode_inline(payload), cuda_device=None)
        assert_same(decoded, payload)
        j = job(task, negative_prompt="blurry" if task == "t2va" else "")
        assert torch.equal(dif.generate(j, decoded, context(tmp_path)).frames, runs[1][0][task]["frames"])


def test_ref2va_with_audio_only(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=64)
    j = JobRequest(
        task="ref2va", prompt="x", width=64, height=64, num_frames=5, media={"reference_audio": {"path": "a"}}
    )
    payload = enc(j, None, context(tmp_path, media={"reference_audio": wav(1.0)}))
    assert payload["visual_latents"].shape[0] == 0 and payload["audio_latents"].shape == (1, 64, 51)


# ------------------------------------------------------------------------------------- determinism


def test_same_seed_same_frames_other_seed_other_frames(runs: dict[int, list[dict[str, Any]]], tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=512)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    ctx = context(tmp_path)
    j = job("t2va", negative_prompt="blurry")
    again = dif.generate(j, enc(j, None, ctx), ctx)
    assert torch.equal(again.frames, runs[1][0]["t2va"]["frames"])
    assert torch.equal(again.audio, runs[1][0]["t2va"]["audio"])
    other = j.model_copy(update={"seed": 1})
    moved = dif.generate(other, enc(other, None, ctx), ctx)
    assert (moved.frames.float() - again.frames.float()).abs().mean() > 5.0
    assert not torch.equal(moved.audio, again.audio)


def test_prompt_and_first_last_frames_steer_the_output(runs: dict[int, list[dict[str, Any]]]) -> None:
    r = runs[1][0]
    assert (r["t2va"]["frames"].float() - r["fl2va"]["frames"].float()).abs().mean() > 5.0
    frames = r["fl2va"]["frames"].float()
    # first frame pinned to a red image, last to a blue one
    assert frames[0, ..., 0].mean() > frames[0, ..., 2].mean()
    assert frames[-1, ..., 2].mean() > frames[-1, ..., 0].mean()


# ------------------------------------------------------------------------------- runtime contract


def test_call_reports_progress_and_returns_final_output(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=256)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    steps: list[tuple[int, int, str | None]] = []
    ctx = context(tmp_path, request_id="req-mp4", report_progress=lambda s, t, phase=None: steps.append((s, t, phase)))
    j = job("t2va", num_inference_steps=4, guidance=1.0)
    out = dif(j, enc(j, None, ctx), ctx)
    assert isinstance(out, FinalOutput) and out.path == tmp_path / "req-mp4.mp4" and out.path.exists()
    # the steps, then the decode and the mux (which took a third of a large request's time on a CPU)
    assert steps[-6:] == [(1, 4, None), (2, 4, None), (3, 4, None), (4, 4, None), (4, 4, "decode"), (4, 4, "mux")]
    assert out.media["frames"] == j.frame_count and out.media["video_codec"] == "h264"
    assert out.info["steps"] == 4 and out.info["tp"] == 1 and set(out.info["timings"]) >= {"denoise_s", "mp4_s"}


def test_cancel_stops_denoising(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=256)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    ctx = context(tmp_path, is_cancelled=lambda: True)
    j = job("t2va")
    with pytest.raises(CancelledRequestError):
        dif.generate(j, enc(j, None, ctx), ctx)


def test_cancel_stops_within_one_step(tmp_path: Path) -> None:
    """The flag turns on while step 3 runs: step 3 is the last one, and the error says so."""
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=256)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    steps: list[int] = []
    ctx = context(tmp_path, report_progress=lambda s, t, phase=None: steps.append(s),
                  is_cancelled=lambda: len(steps) >= 3)  # fmt: skip
    j = job("t2va", num_inference_steps=12)
    payload = enc(j, None, dataclasses.replace(ctx, is_cancelled=lambda: False))
    steps.clear()
    with pytest.raises(CancelledRequestError) as err:
        dif.generate(j, payload, ctx)
    assert steps == [1, 2, 3] and err.value.details["step"] == 3


def test_bad_media_is_a_rejection(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=64)
    ctx = context(tmp_path, media={"first_frame": b"not an image", "last_frame": png((0, 0, 0))})
    with pytest.raises(JobValidationError) as err:
        enc(job("fl2va"), None, ctx)
    assert err.value.field_errors[0]["field"] == "media.first_frame"
    ctx = context(tmp_path, media={"reference_video": b"\x00" * 100, "reference_audio": wav()})
    with pytest.raises(JobValidationError):
        enc(job("ref2va"), None, ctx)
    with pytest.raises(JobValidationError, match="not loaded"):  # the runtime did not pass the bytes
        enc(job("fl2va"), None, context(tmp_path, media={}))


def test_layout_round_trip_and_checks(tmp_path: Path) -> None:
    layout = Layout.for_job(job("fl2va"))
    assert Layout.from_tensor(layout.to_tensor()) == layout
    bumped = layout.to_tensor()
    bumped[0] = LAYOUT_VERSION + 1
    with pytest.raises(PayloadContractError, match="layout: version"):
        Layout.from_tensor(bumped)
    bad = layout.to_tensor()
    bad[6] += 1  # latent frames that do not follow from the frame count
    with pytest.raises(PayloadContractError, match="layout: inconsistent"):
        Layout.from_tensor(bad)
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=64)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    ctx = context(tmp_path)
    payload = enc(job("t2va"), None, ctx)
    with pytest.raises(PayloadContractError, match="layout: does not match the job"):
        dif.generate(job("t2va", width=192), payload, ctx)
    with pytest.raises(PayloadContractError, match="audio_style: expected rank 2, got 1"):
        dif.generate(job("t2va"), {**payload, "audio_style": torch.zeros(3)}, ctx)


def test_large_jobs_pool_the_attention_keys(tmp_path: Path) -> None:
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=64)
    dense = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    pooled = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL, max_attention_tokens=40)
    ctx = context(tmp_path)
    j = job("t2va")  # 3 latent frames × 4 × 8 patches + 57 audio latents = 153 tokens > 40
    payload = enc(j, None, ctx)
    a, b = pooled.generate(j, payload, ctx), pooled.generate(j, payload, ctx)
    assert torch.equal(a.frames, b.frames) and a.frames.shape == (9, 64, 128, 3)
    assert not torch.equal(a.frames, dense.generate(j, payload, ctx).frames)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (runs on the device machine)")
def test_the_encoder_payload_stays_on_its_gpu_and_the_diffusion_stage_takes_it_there(tmp_path: Path) -> None:
    """Every tensor leaf on the rank's GPU, but the small layout descriptor, read on the host."""
    gpu = torch.device("cuda", torch.cuda.device_count() - 1)
    ctx = context(tmp_path, device=gpu)
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=512)
    dif = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)
    for task in ("t2va", "fl2va", "ref2va"):
        payload = enc(job(task), None, ctx)
        leaves = {**payload["text"], **{k: v for k, v in payload.items() if isinstance(v, torch.Tensor)}}
        assert {k: v.device for k, v in leaves.items() if k != "layout"} == dict.fromkeys(set(leaves) - {"layout"}, gpu)
        assert payload["layout"].device.type == "cpu"
        gen = dif.generate(job(task), payload, ctx)
        assert gen.frames.shape[0] == 9
