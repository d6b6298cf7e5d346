"""An extent allocator over ``[base, base + capacity)``: best fit, coalescing, O(log n) per operation.

It knows nothing about shared memory or keys; it hands out offsets ``base + k * alignment``, where
``base`` need not be aligned itself (the L1 and the peer pool start half a page in: ``SLOT_PAGE_OFFSET``).
Free extents are indexed by (size, offset) in a sorted list for best fit, and by start and end for
constant-time coalescing.
Not thread-safe: its owner (the L1 object table) serialises calls under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from sortedcontainers import SortedList

# Slots that engines copy into and out of (the L1 arena, the peer pool) start half a page in. Those
# copies run in glibc's memcpy, which moves runs of 4 KiB to a few hundred KiB with ``rep movsb``; on AMD
# Zen that runs ~3 x slower when the destination sits a few bytes past the source modulo 4 KiB (measured
# on the 2-core VM: 2.2 against 7-9 GB/s). numpy's large arrays sit 16 bytes past a page, torch's 64,
# mmap'd and pinned buffers at 0: a page-aligned slot read into a numpy array met exactly that. Half a
# page is far from all of them.
SLOT_PAGE_OFFSET = 2048


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    free_extents: int
    allocations: int

    @property
    def fragmentation(self) -> float:
        """0 when all free space is one extent; towards 1 as free space splinters."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free


class ExtentAllocator:
    def __init__(self, capacity: int, alignment: int = 4096, base: int = 0) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if base < 0:
            raise ValueError(f"base must not be negative, got {base}")
        self.alignment = alignment
        self.base = base
        self.capacity = capacity - capacity % alignment
        self._by_size: SortedList = SortedList()  # (size, offset)
        self._by_start: dict[int, int] = {}  # offset -> size
        self._by_end: dict[int, int] = {}  # end -> offset
        self._allocated: dict[int, int] = {}  # offset -> size
        self._used = 0
        if self.capacity > 0:
            self._add_free(base, self.capacity)

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"ExtentAllocator(capacity={s.capacity}, used={s.used}, free_extents={s.free_extents}, "
            f"fragmentation={s.fragmentation:.3f})"
        )

    def round_up(self, size: int) -> int:
        return -(-size // self.alignment) * self.alignment

    def allocate(self, size: int) -> int | None:
        """An offset (``base`` plus a multiple of the alignment) of at least ``size`` bytes, or None when
        no free extent is large enough."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = self.round_up(size)
        i = self._by_size.bisect_left((need, -1))
        if i == len(self._by_size):
            return None
        ext_size, offset = self._by_size[i]
        self._remove_free(offset, ext_size)
        if ext_size > need:
            self._add_free(offset + need, ext_size - need)
        self._allocated[offset] = need
        self._used += need
        return offset

    def allocate_run(self, size: int, count: int) -> list[int]:
        """``count`` allocations of ``size`` bytes side by side, carved from one free extent (best fit
        for the whole run): ascending offsets, each freed on its own later. Empty when no free extent
        holds the run (the caller then allocates one by one). One index update for the run instead of
        one per allocation: the L1 reserves a request's chunks this way."""
        if size <= 0 or count <= 0:
            raise ValueError(f"allocation size and count must be positive, got {size} x {count}")
        need = self.round_up(size)
        total = need * count
        i = self._by_size.bisect_left((total, -1))
        if i == len(self._by_size):
            return []
        ext_size, offset = self._by_size[i]
        self._remove_free(offset, ext_size)
        if ext_size > total:
            self._add_free(offset + total, ext_size - total)
        offsets = list(range(offset, offset + total, need))
        self._allocated.update(dict.fromkeys(offsets, need))
        self._used += total
        return offsets

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise KeyError(f"offset {offset} is not allocated")
        self._used -= size
        start, end = offset, offset + size
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            prev_size = self._by_start[prev_start]
            self._remove_free(prev_start, prev_size)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove_free(end, next_size)
            end += next_size
        self._add_free(start, end - start)

    def size_of(self, offset: int) -> int:
        return self._allocated[offset]

    def can_allocate(self, size: int) -> bool:
        need = self.round_up(size)
        return bool(self._by_size) and self._by_size[-1][0] >= need

    def stats(self) -> AllocatorStats:
        largest = self._by_size[-1][0] if self._by_size else 0
        return AllocatorStats(
            capacity=self.capacity,
            used=self._used,
            free=self.capacity - self._used,
            largest_free=largest,
            free_extents=len(self._by_size),
            allocations=len(self._allocated),
        )

    def check_invariants(self) -> None:
        """For tests: extents tile the range exactly, free ones never touch, counts agree."""
        spans = sorted([(o, s, "used") for o, s in self._allocated.items()] + [(o, s, "free") for o, s in self._by_start.items()])
        pos = self.base
        last_kind = None
        for offset, size, kind in spans:
            assert offset == pos, f"gap or overlap at {offset} (expected {pos})"
            assert (offset - self.base) % self.alignment == 0 and size % self.alignment == 0
            assert not (kind == "free" and last_kind == "free"), "adjacent free extents were not coalesced"
            pos += size
            last_kind = kind
        assert pos == self.base + self.capacity, "extents do not cover the capacity"
        assert len(self._by_size) == len(self._by_start) == len(self._by_end)
        assert self._used == sum(self._allocated.values())

    def _add_free(self, offset: int, size: int) -> None:
        self._by_size.add((size, offset))
        self._by_start[offset] = size
        self._by_end[offset + size] = offset

    def _remove_free(self, offset: int, size: int) -> None:
        self._by_size.remove((size, offset))
        del self._by_start[offset]
        del self._by_end[offset + size]
