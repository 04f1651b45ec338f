"""A group frame's sizing: the next frame fits the job's region in grains, and a follower refuses any size
a leader could not have announced (a header is read from shared memory or the wire: never trusted)."""

from __future__ import annotations

import pytest
import torch

from stageferry.stages.group.frames import FRAME_BYTES, INLINE_GRAIN, checked_capacity, checked_carrier, next_capacity

INLINE_MAX = 2 << 20


def test_the_next_frame_fits_the_region_in_grains_or_stays() -> None:
    assert next_capacity(FRAME_BYTES, None, INLINE_MAX) == FRAME_BYTES
    assert next_capacity(12345, torch.empty(0, dtype=torch.uint8), INLINE_MAX) == 12345
    assert next_capacity(FRAME_BYTES, torch.empty(1, dtype=torch.uint8), INLINE_MAX) == FRAME_BYTES + INLINE_GRAIN
    region = torch.empty(INLINE_GRAIN + 1, dtype=torch.uint8)
    assert next_capacity(FRAME_BYTES, region, INLINE_MAX) == FRAME_BYTES + 2 * INLINE_GRAIN
    too_big = torch.empty(INLINE_MAX + 1, dtype=torch.uint8)
    assert next_capacity(FRAME_BYTES + INLINE_GRAIN, too_big, INLINE_MAX) == FRAME_BYTES, "rides apart: no room"


@pytest.mark.parametrize("value", [FRAME_BYTES - 1, FRAME_BYTES + INLINE_MAX + INLINE_GRAIN + 1, -1, "12x"])
def test_a_frame_size_no_leader_could_announce_is_refused(value: object) -> None:
    with pytest.raises(ValueError):
        checked_capacity(value, INLINE_MAX)


def test_announced_sizes_within_bounds_are_taken() -> None:
    assert checked_capacity(FRAME_BYTES, INLINE_MAX) == FRAME_BYTES
    assert (
        checked_capacity(str(FRAME_BYTES + INLINE_MAX + INLINE_GRAIN), INLINE_MAX)
        == FRAME_BYTES + INLINE_MAX + INLINE_GRAIN
    )
    assert checked_carrier(64, 1 << 20) == 64
    for bad in (0, (1 << 20) + 1):
        with pytest.raises(ValueError):
            checked_carrier(bad, 1 << 20)
