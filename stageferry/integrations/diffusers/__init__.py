"""Hugging Face diffusers video pipelines, disaggregated: a stage model pair (``pip install
stageferry[diffusers]``; docs/diffusers.md).

```toml
[[stages]]
name = "encoder"
model = "stageferry.integrations.diffusers:encoder"
options = { model_path = "/models/LTX-2", dtype = "bfloat16" }

[[stages]]
name = "diffusion"
model = "stageferry.integrations.diffusers:diffusion"
options = { model_path = "/models/LTX-2", dtype = "bfloat16" }
```

The encoder stage loads only the checkpoint's text encoder (LTX-2: Gemma 3 and its connectors; Wan:
UMT5) and sends the pipeline's own precomputed conditioning; the diffusion stage loads only the
transformer, scheduler, VAE(s) and vocoder and calls the library's pipeline ``__call__`` with it, so its
frames (and audio) are the one-process pipeline's.  :mod:`.families` says how each family is split,
:mod:`.contract` what the payload holds, :mod:`.tiny` builds random-weight checkpoints offline.
"""

from stageferry.integrations.diffusers.stages import DiffusersDiffusion, DiffusersEncoder, diffusion, encoder

__all__ = ["DiffusersDiffusion", "DiffusersEncoder", "diffusion", "encoder"]
