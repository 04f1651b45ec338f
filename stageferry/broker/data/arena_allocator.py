"""Offsets within one arena: first fit over a sorted free list, neighbours merged on free.

Only numbers: no memory, no torch.  :class:`~stageferry.broker.data.pool.MemoryPool` carves its slots
out of its registered tensor with it.
"""

from __future__ import annotations

import bisect

DEFAULT_ALIGNMENT = 256
"""Slot offsets are multiples of this: enough for any dtype view and for GPU copy engines."""


class ArenaAllocator:
    """First-fit over a sorted free list, coalescing neighbours on free; offsets only, no memory.

    Sizes are rounded up to ``alignment`` (a zero-byte request still takes one unit, so every live slot
    has its own offset).
    """

    def __init__(self, capacity: int, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment}")
        if capacity < alignment:
            raise ValueError(f"capacity {capacity} is smaller than one alignment unit ({alignment})")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._free_offsets: list[int] = [0]  # sorted; parallel to _free_sizes
        self._free_sizes: list[int] = [self.capacity]
        self._live: dict[int, int] = {}  # offset -> rounded size
        self._in_use = 0

    @property
    def bytes_in_use(self) -> int:
        return self._in_use

    @property
    def live(self) -> int:
        return len(self._live)

    def size_of(self, offset: int) -> int:
        """The rounded size of the live block at ``offset`` (0 if none): what it adds to :attr:`bytes_in_use`."""
        return self._live.get(offset, 0)

    def free_blocks(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every free block, in address order (for tests and diagnostics)."""
        return list(zip(self._free_offsets, self._free_sizes, strict=True))

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new block of at least ``nbytes``, or None when no free block is large enough."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        size = max(1, -(-nbytes // self.alignment)) * self.alignment
        for i, free in enumerate(self._free_sizes):
            if free >= size:
                offset = self._free_offsets[i]
                if free == size:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += size
                    self._free_sizes[i] -= size
                self._live[offset] = size
                self._in_use += size
                return offset
        return None

    def shrink(self, offset: int, nbytes: int) -> None:
        """Keep the live block at ``offset`` only ``nbytes`` long (rounded up) and free its tail; a block
        already that small is left as it is.  ValueError for an offset that is not live."""
        size = self._live.get(offset)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        kept = max(1, -(-nbytes // self.alignment)) * self.alignment
        if kept >= size:
            return
        self._live[offset] = kept
        self._live[offset + kept] = size - kept  # the tail as a block of its own, freed (and merged) at once
        self.free(offset + kept)

    def free(self, offset: int) -> None:
        """Return a block; ValueError for an offset that is not live (double free, or never allocated)."""
        size = self._live.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated block")
        self._in_use -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        end = offset + size
        if i < len(self._free_offsets) and self._free_offsets[i] == end:  # merge with the next block
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:  # and the previous
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)


__all__ = ["DEFAULT_ALIGNMENT", "ArenaAllocator"]
