"""The diffusers pair's options (``[stages.options]`` of the pipeline file) and the checkpoint they name.

```toml
[[stages]]
name = "diffusion"
model = "stageferry.integrations.diffusers:diffusion"
[stages.options]
model_path = "/models/Wan2.1-T2V-1.3B-Diffusers"   # a local diffusers checkpoint directory
dtype = "bfloat16"
call = { guidance_scale_2 = 3.0 }                   # more arguments of the pipeline's __call__
```

Both stages name the same checkpoint; each loads only its own components from it.  Options are checked
when the service starts: a wrong one is a ``config`` error and the service does not start.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CallValue = StrictBool | StrictInt | StrictFloat | str | list[StrictInt] | list[StrictFloat]


class DiffusersOptions(BaseModel):
    """One stage's options; each field's docstring is its documentation (docs/diffusers.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    model_path: Annotated[str, Field(min_length=1, max_length=4096)]
    """A local diffusers checkpoint directory (with `model_index.json`): nothing is downloaded."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """The dtype the stage's components are loaded in (`torch_dtype`)."""
    dtypes: Annotated[dict[str, Literal["float32", "bfloat16", "float16"]], Field(max_length=16)] = {}
    """Per-component dtypes over `dtype`, e.g. `{vae = "float32"}` (Wan's VAE is usually kept in float32)."""
    max_sequence_length: Annotated[int, Field(ge=1, le=4096)] | None = None
    """Text tokens the encoder pads and truncates to (default: the pipeline's own: LTX-2 1024, Wan 512)."""
    call: Annotated[dict[str, CallValue], Field(max_length=32)] = {}
    """More keyword arguments of the pipeline's `__call__` (diffusion stage), e.g. LTX-2's `stg_scale`;
    the ones a job sets (size, frames, steps, guidance, seed, prompts) cannot be given here."""
    qp: Annotated[int, Field(ge=0, le=51)] = 23
    """H.264 constant quantiser of the MP4."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def load_dtype(self) -> torch.dtype | dict[str, torch.dtype]:
        """``dtype`` for ``from_pretrained``: one for all, or per component with the rest at ``dtype``."""
        if not self.dtypes:
            return self.torch_dtype
        return {"default": self.torch_dtype, **{name: DTYPES[d] for name, d in self.dtypes.items()}}


def options_of(stage: StageConfig) -> DiffusersOptions:
    """The stage's options, checked; a bad one is a :class:`ConfigError` naming the stage."""
    try:
        return DiffusersOptions.model_validate(stage.options)
    except ValidationError as exc:
        raise ConfigError(f"stage {stage.name!r}: bad diffusers options: {exc}", stage=stage.name) from exc


def diffusion_options(stage: StageConfig, pipeline: PipelineConfig) -> DiffusersOptions:
    """The diffusion stage's options as the encoder stage sees them (it follows the diffusion stage's
    ``call`` to know whether the pipeline will run classifier-free guidance): the next stage's when it is
    a diffusers diffusion stage, else this stage's."""
    nxt = pipeline.disaggregated().next_stage(stage.name)
    if nxt is not None and nxt.model.startswith("stageferry.integrations.diffusers"):
        return options_of(nxt)
    return options_of(stage)


def pipeline_class_name(model_path: str) -> str:
    """The checkpoint's pipeline class, from its ``model_index.json``."""
    index = Path(model_path) / "model_index.json"
    try:
        data = json.loads(index.read_text())
        name = data["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{index} is not a diffusers checkpoint index: {exc}", model_path=model_path) from exc
    if not isinstance(name, str):
        raise ConfigError(f"{index}: _class_name is not a string", model_path=model_path)
    return name


def components_of(model_path: str) -> list[str]:
    """The component names a checkpoint holds (the keys of ``model_index.json`` that name a class)."""
    data: dict[str, Any] = json.loads((Path(model_path) / "model_index.json").read_text())
    return [k for k, v in data.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None]
