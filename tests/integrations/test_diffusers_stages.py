"""The diffusers stage pair in one process: what each stage loads, its payload, the consumer's contract,
the refusals, and the frames (and audio) against the plain one-process pipeline — bit-exact on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from stageferry.broker.data.payload_codec import decode_inline, encode_inline
from stageferry.config import PipelineConfig
from stageferry.errors import ConfigError, JobValidationError, PayloadContractError
from stageferry.integrations.diffusers import DiffusersDiffusion, DiffusersEncoder, diffusion, encoder
from stageferry.schemas import JobRequest
from stageferry.stages.model import StageContext, input_contract_of
from stageferry.stages.reference.encoder import factory as reference_encoder
from tests.integrations.conftest import JOBS, baseline, first_frame_png, options

pytestmark = pytest.mark.timeout(300)


def hop(payload: Any) -> Any:
    """The payload as the inline hop carries it: encoded to its manifest and bytes, decoded as a consumer does."""
    manifest, blob = encode_inline(payload)
    cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return decode_inline(manifest, blob, cuda_device=cuda)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def pair(path: Path, family: str, device: str = "cpu", **opts: Any) -> tuple[DiffusersEncoder, DiffusersDiffusion]:
    o = {**options(path, family), **opts}
    stages = [
        {"name": "encoder", "model": "stageferry.integrations.diffusers:encoder", "options": o, "device": device},
        {"name": "diffusion", "model": "stageferry.integrations.diffusers:diffusion", "options": o, "device": device},
    ]
    pipeline = PipelineConfig.model_validate({"stages": stages})
    return encoder(stage=pipeline.stages[0], pipeline=pipeline), diffusion(stage=pipeline.stages[1], pipeline=pipeline)


def ctx(stage: str, tmp_path: Path, media: dict[str, bytes] | None = None) -> StageContext:
    return StageContext(
        stage=stage, rank=0, world_size=1, device=torch.device("cpu"), request_id=f"r-{stage}", key="k",
        output_dir=tmp_path, media=media or {},
    )  # fmt: skip


@pytest.fixture(scope="module", params=DEVICES)
def pairs(request: pytest.FixtureRequest, checkpoints: dict[str, Path]) -> dict[str, Any]:
    """Both families' pairs on the CPU, and (on a GPU host) on CUDA; ``pairs["device"]`` says which."""
    made: dict[str, Any] = {family: pair(path, family, request.param) for family, path in checkpoints.items()}
    made["device"] = request.param
    return made


@pytest.mark.parametrize(
    ("family", "encoder_holds", "diffusion_holds"),
    [
        ("wan", {"text_encoder"}, {"transformer", "vae"}),
        ("ltx2", {"text_encoder", "connectors"}, {"transformer", "vae", "audio_vae", "vocoder"}),
    ],
)
def test_each_stage_loads_only_its_components(
    pairs: dict[str, Any], family: str, encoder_holds: set[str], diffusion_holds: set[str]
) -> None:
    enc, dif = pairs[family]
    held = {name for name, size in enc.loaded.items() if size}
    assert held == encoder_holds  # never the transformer
    assert {name for name, size in dif.loaded.items() if size} == diffusion_holds  # never the text encoder
    base = enc.pipes[next(iter(enc.pipes))]
    assert base.transformer is None and base.vae is None
    assert dif.pipes[next(iter(dif.pipes))].text_encoder is None
    contract = input_contract_of(dif)
    assert contract is dif.input_contract and contract is not None and contract.id == f"stageferry.diffusers.{family}/1"


@pytest.mark.parametrize("family", ["wan", "ltx2"])
def test_the_pair_over_the_inline_codec_equals_the_plain_pipeline(
    pairs: dict[str, Any], checkpoints: dict[str, Path], family: str, tmp_path: Path
) -> None:
    enc, dif = pairs[family]
    job = JobRequest.model_validate(JOBS[family])
    payload = enc(job, None, ctx("encoder", tmp_path))
    sent = hop(payload)
    dif.input_contract.check(job, sent)
    result = dif(job, sent, ctx("diffusion", tmp_path))
    assert result is not None and result.path is not None and result.path.exists()
    plain = baseline(checkpoints[family], family, JOBS[family], pairs["device"])
    assert result.info["frames_sha256"] == plain["frames_sha256"]
    assert result.info["audio_sha256"] == plain["audio_sha256"]
    # the checkpoint named as the client may see it: a local directory by its name, not the server's path
    assert result.info["model_path"] == checkpoints[family].name and "/" not in result.info["model_path"]
    assert result.media["frames"] == JOBS[family]["num_frames"] and result.media["width"] == 64
    if family == "wan":
        assert "audio_codec" not in result.media and result.info["audio"].startswith("none")
    else:
        assert result.media["audio_codec"] == "aac" and result.media["sample_rate"] == 16_000


def test_ltx2_image_to_video_from_a_first_frame_equals_the_plain_pipeline(
    pairs: dict[str, Any], checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    enc, dif = pairs["ltx2"]
    png = first_frame_png()
    job = JobRequest.model_validate({**JOBS["ltx2"], "task": "i2va", "media": {"first_frame": {"path": "/x.png"}}})
    payload = hop(enc(job, None, ctx("encoder", tmp_path, {"first_frame": png})))
    assert payload["image"].shape == (48, 80, 3) and payload["image_crf"] == 33  # Gemma 3's default CRF
    dif.input_contract.check(job, payload)
    result = dif(job, payload, ctx("diffusion", tmp_path))
    plain = baseline(checkpoints["ltx2"], "ltx2", JOBS["ltx2"], pairs["device"], image=png)
    assert result is not None and result.info["model"] == "diffusers:LTX2ImageToVideoPipeline"
    assert (result.info["frames_sha256"], result.info["audio_sha256"]) == (
        plain["frames_sha256"],
        plain["audio_sha256"],
    )


def test_wan_drops_the_padding_and_ltx2_sends_the_connector_outputs(pairs: dict[str, Any], tmp_path: Path) -> None:
    job = JobRequest.model_validate(JOBS["wan"])
    wan = pairs["wan"][0](job, None, ctx("encoder", tmp_path))
    assert wan["prompt_embeds"].shape == (16, 32)  # the prompt fills the 16 tokens
    assert wan["negative_prompt_embeds"].shape == (8, 32)  # "▁blurry" + "</s>": the 8 padding rows dropped
    ltx = pairs["ltx2"][0](JobRequest.model_validate(JOBS["ltx2"]), None, ctx("encoder", tmp_path))
    assert ltx["prompt_embeds"].shape == (2, 16, 32)  # [negative, positive] × tokens × connector width
    assert ltx["attention_mask"].dtype == torch.int64
    no_cfg = pairs["ltx2"][0](JobRequest.model_validate({**JOBS["ltx2"], "guidance": 1.0}), None, ctx("e", tmp_path))
    assert no_cfg["prompt_embeds"].shape[0] == 2  # audio_guidance_scale (7.0 by default) still guides


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("ltx2", {"width": 80}, "width"),  # LTX-2 makes multiples of 32
        ("ltx2", {"width": 64, "height": 80}, "height"),
        ("wan", {"audio_flow_shift": 2.0}, "audio_flow_shift"),
        ("ltx2", {"num_frames": 10}, "num_frames"),  # 8k+1 (the tiny VAE: 2k+1)
        ("wan", {"num_frames": 8}, "num_frames"),  # 4k+1
        ("wan", {"task": "i2va", "media": {"first_frame": {"path": "/x.png"}}}, "task"),
        ("ltx2", {"task": "fl2va", "media": {"first_frame": {"path": "/a"}, "last_frame": {"path": "/b"}}}, "task"),
        ("wan", {"lora": "style"}, "lora"),
        ("ltx2", {"flow_shift": 3.0}, "flow_shift"),
    ],
)
def test_what_a_pipeline_cannot_do_is_refused_by_name(
    pairs: dict[str, Any], tmp_path: Path, family: str, change: dict[str, Any], field: str
) -> None:
    job = JobRequest.model_validate({**JOBS[family], **change})
    for stage in pairs[family]:
        with pytest.raises(JobValidationError) as info:
            stage(job, None, ctx("x", tmp_path))
        assert [e["field"] for e in info.value.field_errors] == [field], info.value


def test_a_duration_is_rounded_to_a_frame_count_the_pipeline_makes(pairs: dict[str, Any]) -> None:
    wan = pairs["wan"][1].family
    job = JobRequest.model_validate({**JOBS["wan"], "num_frames": None, "duration": 1.0})  # 16 frames
    assert wan.frames(job) == 17


def test_the_consumer_refuses_a_payload_that_breaks_its_contract(pairs: dict[str, Any], tmp_path: Path) -> None:
    enc, dif = pairs["ltx2"]
    job = JobRequest.model_validate(JOBS["ltx2"])
    good = enc(job, None, ctx("encoder", tmp_path))
    bad = {
        **good,
        "prompt_embeds": good["prompt_embeds"][1:],  # CFG needs [negative, positive]
        "audio_prompt_embeds": good["audio_prompt_embeds"].to(torch.int32),
        "attention_mask": good["attention_mask"] * 3,
        "family": "wan",
        "stray": 1,
    }
    with pytest.raises(PayloadContractError) as info:
        dif.input_contract.check(job, bad)
    fields = [e["field"] for e in info.value.field_errors]
    assert fields == ["family", "prompt_embeds", "audio_prompt_embeds", "attention_mask", "stray"], fields
    assert "must be 2 as in the job's guidance, got 1" in info.value.field_errors[1]["message"]
    nan = {**good, "prompt_embeds": torch.full_like(good["prompt_embeds"], float("nan"))}
    with pytest.raises(PayloadContractError, match="non-finite"):
        dif.input_contract.check(job, nan)
    wan_job = JobRequest.model_validate(JOBS["wan"])
    wan = pairs["wan"][0](wan_job, None, ctx("encoder", tmp_path))
    missing = {k: v for k, v in wan.items() if k != "negative_prompt_embeds"}
    with pytest.raises(PayloadContractError, match="negative_prompt_embeds: missing"):
        pairs["wan"][1].input_contract.check(wan_job, missing)
    wide = {**wan, "prompt_embeds": torch.zeros(3, 48)}
    with pytest.raises(PayloadContractError, match=r"prompt_embeds: dimension 1 \(32\) must be 32, got 48"):
        pairs["wan"][1].input_contract.check(wan_job, wide)
    # plain ints the consumer allocates from or passes on are bounded (a producer's 10**12 padded to OOM)
    for payload, field, contract, job_ in (
        ({**wan, "max_sequence_length": 10**12}, "max_sequence_length", pairs["wan"][1].input_contract, wan_job),
        ({**wan, "max_sequence_length": True}, "max_sequence_length", pairs["wan"][1].input_contract, wan_job),
        ({**good, "image_crf": -(10**9)}, "image_crf", dif.input_contract, job),
    ):
        with pytest.raises(PayloadContractError) as info:
            contract.check(job_, payload)
        assert [e["field"] for e in info.value.field_errors] == [field], info.value.field_errors


def test_bad_options_stop_the_service_at_start(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="bad diffusers options"):
        pair(checkpoints["wan"], "wan", model_pth="/x")
    with pytest.raises(ConfigError, match="'num_frames' is not a pipeline argument"):
        pair(checkpoints["ltx2"], "ltx2", call={"num_frames": 9})
    with pytest.raises(ConfigError, match="not a diffusers checkpoint index"):
        pair(tmp_path, "wan")


def test_i2va_is_a_job_of_its_own_and_the_reference_models_refuse_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"i2va needs media\.first_frame"):
        JobRequest.model_validate({"prompt": "x", "task": "i2va"})
    with pytest.raises(ValueError, match=r"i2va takes media\.first_frame only"):
        JobRequest.model_validate(
            {"prompt": "x", "task": "i2va", "media": {"first_frame": {"path": "/a"}, "last_frame": {"path": "/b"}}}
        )
    job = JobRequest.model_validate({"prompt": "x", "task": "i2va", "media": {"first_frame": {"path": "/a"}}})
    model = reference_encoder(stage=PipelineConfig().stages[0], pipeline=PipelineConfig())
    with pytest.raises(JobValidationError) as info:
        model(job, None, ctx("encoder", tmp_path))
    assert info.value.field_errors[0]["field"] == "task" and "does not generate i2va" in str(info.value)


def test_the_planner_says_a_diffusers_group_computes_on_rank_0(checkpoints: dict[str, Path]) -> None:
    from stageferry.stages.process.placement import plan

    o = options(checkpoints["wan"], "wan")
    stages = [
        {"name": "encoder", "model": "stageferry.integrations.diffusers:encoder", "options": o},
        {"name": "diffusion", "model": "stageferry.integrations.diffusers:diffusion", "options": o, "tp": 2},
    ]
    the_plan = plan(PipelineConfig.model_validate({"stages": stages}), 0)
    assert [s["computing_ranks"] for s in the_plan.to_json()["stages"]] == [1, 1]
    assert "compute: rank 0 only (its model runs on one device; ranks 1..1 idle)" in the_plan.render()
    reference = plan(PipelineConfig(), 0).to_json()["stages"]
    assert [s["computing_ranks"] for s in reference] == [2, 4]
