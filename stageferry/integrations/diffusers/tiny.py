"""Random-weight diffusers checkpoints built in code: tiny ones for tests and the example, and ones at a
real model's configuration for measuring memory where no weights can be downloaded.

Each builder makes every component from its config (the shapes diffusers' own fast tests use), with a
tokenizer built offline from a character vocabulary, and writes them with ``save_pretrained``: the stages
then load the directory through the ordinary ``from_pretrained`` path, as they would a real checkpoint.
Nothing here touches the network.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

#: Characters of the offline tokenizers' vocabulary (one token each; others are the unknown token).
CHARS = string.ascii_lowercase + string.digits + " .,'-!?"


def _gemma_tokenizer() -> Any:
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    vocab = {tok: i for i, tok in enumerate(specials + [c if c != " " else "▁" for c in CHARS])}
    return GemmaTokenizer(vocab=vocab, merges=[])


def _t5_tokenizer() -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -3.0) for c in CHARS if c != " "]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def ltx2_components(*, seed: int = 0) -> dict[str, Any]:
    """LTX-2 (text → video + audio): a tiny Gemma 3, connectors, DiT, video and audio VAEs, vocoder."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = _gemma_tokenizer()
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "sliding_window": 16,
        "pad_token_id": 0,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    }
    torch.manual_seed(seed)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=4)
    text_encoder = Gemma3ForConditionalGeneration(config).eval()
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    torch.manual_seed(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=2,
        qk_norm="rms_norm_across_heads",
        caption_channels=hidden,
        rope_double_precision=False,
        rope_type="split",
    )
    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=hidden,
        text_proj_in_factor=layers + 1,
        video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_theta=10000.0,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatial",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1,),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    torch.manual_seed(seed)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,  # the audio VAE's output_channels × mel_bins
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "audio_vae": audio_vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "connectors": connectors,
        "vocoder": vocoder,
    }


def wan_components(*, seed: int = 0, transformer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wan 2.1 T2V: a tiny UMT5 encoder, the Wan VAE and DiT.  ``transformer`` overrides the DiT's config
    (e.g. :data:`WAN21_1_3B_TRANSFORMER`, the real 1.3B model's, for a memory run on a GPU)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    tokenizer = _t5_tokenizer()
    dit = transformer or {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 32,
        "freq_dim": 256,
        "ffn_dim": 32,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 32,
    }
    torch.manual_seed(seed)
    config = UMT5Config(
        vocab_size=len(tokenizer),
        d_model=dit["text_dim"],
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    text_encoder = UMT5EncoderModel(config).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    torch.manual_seed(seed)
    return {
        "transformer": WanTransformer3DModel(**dit),
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "transformer_2": None,
    }


#: Wan2.1-T2V-1.3B's transformer (its ``transformer/config.json``), for random weights at the real size.
WAN21_1_3B_TRANSFORMER: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

FAMILIES = {"ltx2": ltx2_components, "wan": wan_components}


def write_checkpoint(family: str, path: str | Path, *, seed: int = 0, **kwargs: Any) -> Path:
    """Build ``family``'s components and write them as a diffusers checkpoint directory at ``path``."""
    from diffusers import LTX2Pipeline, WanPipeline

    pipeline_class: Any = {"ltx2": LTX2Pipeline, "wan": WanPipeline}[family]
    pipe = pipeline_class(**FAMILIES[family](seed=seed, **kwargs))
    path = Path(path)
    pipe.save_pretrained(path)
    return path


#: UMT5-XXL's encoder (Wan's text encoder, ``text_encoder/config.json``), for random weights at the real size.
UMT5_XXL: dict[str, Any] = {
    "vocab_size": 256_384,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10_240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "feed_forward_proj": "gated-gelu",
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}


def write_wan_1_3b(path: str | Path, *, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0) -> Path:
    """A Wan2.1-T2V-1.3B-sized checkpoint with random weights: its DiT, UMT5-XXL's encoder, the Wan VAE at
    its default (real) configuration and Wan's UniPC flow scheduler; the tokenizer is the offline one (its
    ids are a few dozen of the 256k the embedding holds, which sets no size).  For measuring each stage's
    memory and time where no weights can be downloaded."""
    import transformers

    import diffusers

    wan: Any = diffusers  # the library's classes, untyped at this depth
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    torch.manual_seed(seed)
    with torch.device(device):
        umt5: Any = transformers.UMT5EncoderModel(transformers.UMT5Config(**UMT5_XXL))
        text_encoder = umt5.to(torch_dtype).eval()
        transformer = wan.WanTransformer3DModel(**WAN21_1_3B_TRANSFORMER).to(torch_dtype)
        vae = wan.AutoencoderKLWan().to(torch.float32)  # Wan keeps its VAE in float32
    scheduler = wan.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    pipe = wan.WanPipeline(
        tokenizer=_t5_tokenizer(), text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    path = Path(path)
    pipe.save_pretrained(path)
    return path
