"""The layout metadata: round trip for every task, and hostile layout tensors refused naming ``layout``
(never another exception), before anything is sized from them."""

from __future__ import annotations

import pytest
import torch

from stageferry.errors import PayloadContractError
from stageferry.schemas import Task
from stageferry.schemas.payload_layout import FIELDS, HEADER, LAYOUT_VERSION, Layout, audio_samples, latent_frames


@pytest.mark.parametrize("task", list(Task))
def test_round_trip(task: Task) -> None:
    layout = Layout.of(task, 320, 192, 24, 49)
    assert Layout.from_tensor(layout.to_tensor()) == layout
    assert layout.video_latent_shape == (16, 13, 24, 40)
    assert layout.audio_latent_shape == (1, 64, audio_samples(49, 24) // 640 + 1)
    assert layout.keyframes == ((0, 48) if task is Task.FL2VA else ())
    assert layout.to_tensor().numel() == HEADER + len(layout.keyframes) == len(FIELDS) - 1 + len(layout.keyframes)


def test_latent_frames_group_frame_zero_alone_then_fours() -> None:
    assert [latent_frames(f) for f in (1, 2, 5, 6, 9, 49)] == [1, 2, 2, 3, 3, 13]


HOSTILE = [
    ("not a tensor", [1, 0, 320, 192, 24, 49, 13, 24, 40, 77, 0]),
    ("float", torch.zeros(11)),
    ("2-d", torch.zeros(1, 11, dtype=torch.int64)),
    ("short", torch.tensor([LAYOUT_VERSION, 0, 320], dtype=torch.int64)),
    ("long", torch.zeros(1 << 16, dtype=torch.int64)),
    ("keyframe count", torch.tensor([1, 0, 320, 192, 24, 49, 13, 24, 40, 77, 5], dtype=torch.int64)),
    ("task code", torch.tensor([1, 9, 320, 192, 24, 49, 13, 24, 40, 77, 0], dtype=torch.int64)),
    ("zero fps", torch.tensor([1, 0, 320, 192, 0, 49, 13, 24, 40, 77, 0], dtype=torch.int64)),
    ("huge", torch.tensor([1, 0, 2**62, 2**62, 1, 2**62, 1, 1, 1, 1, 0], dtype=torch.int64)),
    ("inconsistent", torch.tensor([1, 0, 320, 192, 24, 49, 12, 24, 40, 77, 0], dtype=torch.int64)),
]


@pytest.mark.parametrize(("what", "value"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_layouts_are_refused_naming_the_entry(what: str, value: object) -> None:
    with pytest.raises(PayloadContractError) as info:
        Layout.from_tensor(value)
    assert info.value.field_errors[0]["field"] == "layout"
    assert str(info.value).startswith("layout: ")
