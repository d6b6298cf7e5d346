"""The published pool: this node's host memory that other nodes read pages from.

``put`` copies a page into the pool (the one copy a page costs its writer) and gives it a generation
no other page of this pool ever had, not even after a restart (it starts at the clock in ns). Readers,
local or remote, ask for a (key, generation); only that exact page is handed out, pinned while it is
read. A range's life::

    FREE ──put──► PUBLISHED ──evict / replace / delete──► RETIRED ──last reader unpins──► FREE
                     │  (in the index: new readers get it)  (out of the index: no new reader,
                     └──────────────no reader pinned it───────────────────────────────► FREE

A retired range is quarantined: its space is not handed to another page while a reader may still be
sending it (the L1's rule for space a lease holder may still touch), so a read that races an eviction
gets either the old bytes whole, under their own generation, or a miss; never another page's bytes.
LRU order is by last write or read; eviction skips pinned pages.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from kvdepot.storage.allocator import SLOT_PAGE_OFFSET, ExtentAllocator
from kvdepot.storage.l2.envelope import copy_digest

ALIGNMENT = 4096


@dataclass(slots=True)
class PoolEntry:
    key: bytes
    offset: int
    length: int
    generation: int
    checksum: bytes
    pins: int = 0
    published: bool = True  # False once retired


@dataclass(frozen=True, slots=True)
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    keys: int
    retired: int
    evictions: int


class PublishedPool:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < ALIGNMENT:
            raise ValueError(f"pool of {capacity_bytes} bytes is smaller than one page ({ALIGNMENT})")
        self._mm = mmap.mmap(-1, capacity_bytes + ALIGNMENT)
        self._view = memoryview(self._mm)
        self._alloc = ExtentAllocator(capacity_bytes, ALIGNMENT, base=SLOT_PAGE_OFFSET)
        self._index: OrderedDict[bytes, PoolEntry] = OrderedDict()
        self._retired = 0
        self._evictions = 0
        self._lock = threading.Lock()
        self._generation = time.time_ns()

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    def fresh_generation(self) -> int:
        """A generation newer than every page's so far, from the same sequence (the record of a page kept
        on disk only: newer than what this node's earlier incarnation published, older than the page's
        next copy into the pool). The sequence starts at the clock, so a restart starts above it."""
        with self._lock:
            self._generation += 1
            return self._generation

    def put(self, key: bytes, data) -> tuple[PoolEntry | None, list[PoolEntry]]:
        """Copy ``data`` in as ``key``'s newest page. Returns the entry (None when it cannot fit: larger
        than the pool, or the pool is full of pages being read) and the pages evicted to make room."""
        strided = isinstance(data, np.ndarray) and not data.flags.c_contiguous
        src = data if strided else memoryview(data).cast("B")
        size = data.nbytes if strided else src.nbytes
        if size == 0:
            raise ValueError("an empty page cannot be published")
        evicted: list[PoolEntry] = []
        with self._lock:
            offset = self._alloc.allocate(size) if size <= self._alloc.capacity else None
            while offset is None and size <= self._alloc.capacity:
                victim = next((e for e in self._index.values() if e.pins == 0), None)
                if victim is None:
                    break
                self._retire(self._index.pop(victim.key))
                self._evictions += 1
                evicted.append(victim)
                offset = self._alloc.allocate(size)
            if offset is None:
                return None, evicted
        dest = self._view[offset : offset + size]
        if strided:  # a page spread over a strided host pool: gathered straight into the pool, one copy
            np.copyto(np.frombuffer(dest, dtype=data.dtype).reshape(data.shape), data)
            digest = xxhash.xxh3_128_digest(dest)
        else:
            digest = copy_digest(src, dest)  # the copy and its checksum in one pass over memory
        entry = PoolEntry(key, offset, size, 0, digest)
        with self._lock:
            self._generation += 1
            entry.generation = self._generation
            old = self._index.pop(key, None)
            if old is not None:
                self._retire(old)
            self._index[key] = entry
        return entry, evicted

    def acquire(self, key: bytes, generation: int = 0) -> PoolEntry | None:
        """Pin ``key``'s page if it is still the one of ``generation`` (0: whatever is newest)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or (generation and entry.generation != generation):
                return None
            entry.pins += 1
            self._index.move_to_end(key)
            return entry

    def peek(self, key: bytes) -> PoolEntry | None:
        """``key``'s newest page as it is now, unpinned (for a record: a read still names its generation)."""
        with self._lock:
            return self._index.get(key)

    def release(self, entry: PoolEntry) -> None:
        with self._lock:
            entry.pins -= 1
            if entry.pins == 0 and not entry.published:
                self._alloc.free(entry.offset)
                self._retired -= 1

    def view(self, entry: PoolEntry) -> memoryview:
        """The page's bytes; valid while the caller holds a pin on ``entry``."""
        return self._view[entry.offset : entry.offset + entry.length]

    def remove(self, key: bytes) -> PoolEntry | None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._retire(entry)
            return entry

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def entries(self) -> list[PoolEntry]:
        """Every published page (a snapshot, for re-publishing after the ring changed)."""
        with self._lock:
            return list(self._index.values())

    def clear(self) -> list[PoolEntry]:
        with self._lock:
            gone = list(self._index.values())
            self._index.clear()
            for entry in gone:
                self._retire(entry)
            return gone

    def stats(self) -> PoolStats:
        with self._lock:
            s = self._alloc.stats()
            return PoolStats(s.capacity, s.used, len(self._index), self._retired, self._evictions)

    def close(self) -> None:
        try:
            self._view.release()
            self._mm.close()
        except BufferError:
            pass  # a reader still holds a view: the mapping goes with the process

    def _retire(self, entry: PoolEntry) -> None:
        """Out of the index (called with the lock held); its space is free once no reader pins it."""
        entry.published = False
        if entry.pins == 0:
            self._alloc.free(entry.offset)
        else:
            self._retired += 1
