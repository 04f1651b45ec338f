"""Payloads shaped like the product's three tasks, and exact comparison — for tests and benchmarks.

The byte totals are those measured on the real model: T2VA 359,024, FL2VA 11,158,136 and Ref2VA
64,963,792 bytes of tensors (bf16 text hidden states [tokens, 5120], int64 role ids and layout, fp32
visual and audio latents), with non-contiguous tensors, empty leaves and plain values mixed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

HIDDEN = 5120


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _text(tokens: int, layout: int) -> dict[str, Any]:
    return {
        "hidden_states": randn(tokens, HIDDEN, dtype=torch.bfloat16, seed=tokens),
        "role_ids": torch.arange(tokens, dtype=torch.int64) % 3,
        "layout": torch.arange(layout, dtype=torch.int64) * 1000,
    }


def t2va() -> Any:
    return {
        "task": "t2va",
        "text": _text(35, 11),
        "visual_latents": torch.empty(0, 16, 21, 60, 104),
        "audio_latents": randn(1, 64, seed=1),
        "extras": ((), [], {}, None),
        "steps": 50,
        "guidance": 4.5,
        "flags": {"use_audio": True, "t": "not a tensor", "d": {"l": [1, 2], "v": None}},
    }


def fl2va() -> Any:
    frames = randn(2, 240, 16, 320, seed=2).transpose(1, 2)  # non-contiguous: [2, 16, 240, 320]
    return {
        "task": "fl2va",
        "text": _text(120, 23),
        "visual_latents": {"first_last": frames},
        "audio_latents": [randn(1, 64, 382, seed=3)],
        "size": (480, 832),
    }


def ref2va() -> Any:
    video = randn(16, 31, 120, 416, seed=4)[:, :, :, ::2]  # non-contiguous slice: [16, 31, 120, 208]
    return {
        "task": "ref2va",
        "text": _text(256, 2458),
        "visual_latents": {"reference": video, "mask": torch.ones(0, dtype=torch.bool)},
        "audio_latents": (randn(1, 64, 50_000, seed=5), {"present": True}),
        "fps": 24.0,
    }


TASKS: dict[str, tuple[Callable[[], Any], int]] = {
    "T2VA": (t2va, 359_024),
    "FL2VA": (fl2va, 11_158_136),
    "Ref2VA": (ref2va, 64_963_792),
}


def sized_payload(nbytes: int, *, seed: int = 0, device: torch.device | str = "cpu") -> dict[str, Any]:
    """A one-tensor payload of exactly ``nbytes`` (uint8), for size sweeps."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return {"blob": data.to(device), "nbytes": nbytes}


def on_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor moved to ``device`` (dicts, lists and tuples rebuilt around them)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: on_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(on_device(v, device) for v in obj)
    return obj


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same-width integers: compares NaN payloads and signed zeros exactly."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


def tensor_bytes(payload: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(payload))


def assert_same(got: Any, want: Any, path: str = "$") -> None:
    """Same structure, types, dtypes, shapes and bits (device kind compared, not device index)."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.device.type == want.device.type, f"{path}: device {got.device} != {want.device}"
        assert torch.equal(bits(got.cpu()), bits(want.cpu())), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert repr(got) == repr(want), path
    else:
        assert got == want, path
