"""Tiny random-weight diffusers checkpoints (written once per session, loaded back through
``from_pretrained``) and the plain one-process pipeline the disaggregated runs are compared with."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from stageferry.integrations.diffusers.stages import digest  # noqa: E402
from stageferry.integrations.diffusers.tiny import write_checkpoint  # noqa: E402

#: LTX-2's spatio-temporal and modality guidance off (the tiny DiT has 2 blocks, not 28): one forward
#: per step and CFG, as a real LTX-2.0 run without STG.
LTX2_CALL = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}
MAX_LEN = 16
JOBS: dict[str, dict[str, Any]] = {
    "wan": {"prompt": "a paper boat in the rain", "negative_prompt": "blurry", "width": 64, "height": 64,
            "fps": 16, "num_frames": 9, "num_inference_steps": 2, "guidance": 5.0, "seed": 3},
    "ltx2": {"prompt": "a robot dancing", "negative_prompt": "blurry", "width": 64, "height": 64,
             "fps": 25, "num_frames": 9, "num_inference_steps": 2, "guidance": 3.0, "seed": 3},
}  # fmt: skip
CALLS = {"wan": {}, "ltx2": LTX2_CALL}


@pytest.fixture(scope="session", autouse=True)
def offline() -> Iterator[None]:
    """No test touches the network (the stage processes inherit it)."""
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield
    if old is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = old


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: write_checkpoint(family, root / family) for family in ("wan", "ltx2")}


def options(path: Path, family: str, dtype: str = "float32") -> dict[str, Any]:
    return {"model_path": str(path), "dtype": dtype, "max_sequence_length": MAX_LEN, "call": CALLS[family]}


def first_frame_png(width: int = 80, height: int = 48) -> bytes:
    from PIL import Image

    ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(ramp, mode="RGB").save(buf, format="PNG")
    return buf.getvalue()


def baseline(
    path: Path, family: str, job: dict[str, Any], device: str = "cpu", image: bytes | None = None
) -> dict[str, Any]:
    """The plain diffusers pipeline in one process, called as its own docs call it: the prompts as text."""
    import diffusers
    from PIL import Image

    name = {"wan": "WanPipeline", "ltx2": "LTX2ImageToVideoPipeline" if image else "LTX2Pipeline"}[family]
    pipe = getattr(diffusers, name).from_pretrained(path, dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    kwargs: dict[str, Any] = {
        "prompt": job["prompt"], "negative_prompt": job["negative_prompt"], "height": job["height"],
        "width": job["width"], "num_frames": job["num_frames"], "num_inference_steps": job["num_inference_steps"],
        "guidance_scale": job["guidance"], "generator": torch.Generator("cpu").manual_seed(job["seed"]),
        "output_type": "np", "max_sequence_length": MAX_LEN, **CALLS[family],
    }  # fmt: skip
    if family == "ltx2":
        kwargs["frame_rate"] = float(job["fps"])
    if image is not None:
        kwargs["image"] = Image.open(io.BytesIO(image)).convert("RGB")
    out = pipe(**kwargs)
    frames = np.asarray(out.frames[0])
    audio = out.audio[0].float().cpu().numpy() if family == "ltx2" else None
    return {
        "frames": frames,
        "frames_sha256": digest(frames),
        "audio_sha256": digest(audio) if audio is not None else None,
    }
