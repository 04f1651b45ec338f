"""The arena allocator (``arena_allocator``): offsets only, so a property test can drive it hard."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stageferry.broker.data.arena_allocator import ArenaAllocator

ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 1500)),
        st.tuples(st.just("free"), st.integers(0, 63)),
        st.tuples(st.just("shrink"), st.integers(0, 63)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, alignment=st.sampled_from([64, 256]))
def test_allocator_never_overlaps_and_coalesces(ops: list[tuple[str, int]], alignment: int) -> None:
    a = ArenaAllocator(8192 + 100, alignment)
    assert a.capacity == 8192 + 100 - 100 % alignment
    live: dict[int, int] = {}  # offset -> requested bytes
    for op, arg in ops:
        if op == "alloc":
            off = a.allocate(arg)
            if off is not None:
                assert off % alignment == 0 and off not in live
                live[off] = arg
        elif live and op == "free":
            off = sorted(live)[arg % len(live)]
            a.free(off)
            del live[off]
        elif live:  # shrink a live block to half what it asked for: its tail is free again
            off = sorted(live)[arg % len(live)]
            a.shrink(off, live[off] // 2)
            live[off] //= 2
        spans = sorted((o, o + max(1, -(-n // alignment)) * alignment) for o, n in live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
        assert all(end <= a.capacity for _, end in spans)
        assert a.live == len(live) and a.bytes_in_use == sum(e - s for s, e in spans)
        free = a.free_blocks()
        assert sum(size for _, size in free) + a.bytes_in_use == a.capacity
        assert all(o1 + s1 < o2 for (o1, s1), (o2, _) in itertools.pairwise(free))  # coalesced
    for off in list(live):
        a.free(off)
    assert a.free_blocks() == [(0, a.capacity)] and a.bytes_in_use == 0 and a.live == 0


def test_allocator_shrink_frees_the_tail_and_merges_it() -> None:
    a = ArenaAllocator(1024, 256)
    x = a.allocate(1000)
    assert x is not None
    a.shrink(x, 300)  # two units kept, the last two free again and one block
    assert a.bytes_in_use == 512 and a.free_blocks() == [(512, 512)]
    a.shrink(x, 600)  # already that small: nothing changes
    assert a.bytes_in_use == 512
    assert a.allocate(512) == 512
    with pytest.raises(ValueError, match="not an allocated block"):
        a.shrink(256, 1)


def test_allocator_first_fit_reuse_and_errors() -> None:
    a = ArenaAllocator(1024, 256)
    x, y, z = a.allocate(10), a.allocate(256), a.allocate(300)
    assert (x, y, z) == (0, 256, 512)
    assert a.allocate(1) is None
    a.free(256)
    assert a.allocate(0) == 256  # zero bytes still takes one unit at a unique offset
    with pytest.raises(ValueError):
        a.free(256 + 1)
    a.free(0)
    with pytest.raises(ValueError, match="not an allocated block"):
        a.free(0)
    with pytest.raises(ValueError):
        a.allocate(-1)
    for bad in ((100, 256), (1024, 0), (1024, 48)):
        with pytest.raises(ValueError):
            ArenaAllocator(*bad)


# -- one pool ---------------------------------------------------------------------------------------------
