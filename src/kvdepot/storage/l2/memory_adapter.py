"""``memory``: an in-process L2 (a dict), the reference implementation the contract tests pin.

Real in every way that matters to the contract (envelope, checksums, all-or-nothing stores, capacity
with LRU), it only lacks persistence. Useful for tests and as a second, slower-than-L1 tier.

A full tier evicts one object for each it stores, nearly always of the same size (a chunk): the evicted
object's buffer is kept as a spare and the next store of that size copies into it, instead of into
fresh memory whose pages fault in during the copy. A buffer is kept only when no load is reading it,
and spares stay under ``SPARE_BYTES`` (beyond ``size_gb``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Annotated, ClassVar

import numpy as np

from kvdepot.config import ConfigStruct, option
from kvdepot.storage.l2 import envelope
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import AdapterType, TierServices
from kvdepot.storage.l2.envelope import RejectedObject
from kvdepot.types import ObjectKey

SPARE_BYTES = 256 << 20  # at most this much of removed objects' buffers is kept for stores to reuse


class _Stored:
    """One object: its header and key, its payload (kept apart, so a store copies the payload once),
    and how many loads are copying out of it now (a buffer being read is never reused)."""

    __slots__ = ("head", "body", "readers")

    def __init__(self, head: bytes, body: memoryview) -> None:
        self.head, self.body, self.readers = head, body, 0

    @property
    def size(self) -> int:
        return len(self.head) + self.body.nbytes


class MemoryConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    size_gb: Annotated[float, option("capacity in GiB (LRU beyond it)", gt=0)] = 1.0
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 2


class MemoryAdapter(BackendAdapter):
    kind = "memory"

    def __init__(self, name: str, config: MemoryConfig, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self._capacity = int(config.size_gb * (1 << 30))
        self._objects: OrderedDict[ObjectKey, _Stored] = OrderedDict()
        self._used = 0
        self._spares: dict[int, list[memoryview]] = {}  # payload size -> buffers of removed objects
        self._spare_bytes = 0
        self._spare_limit = min(SPARE_BYTES, self._capacity // 8)
        self._mu = threading.Lock()

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        src = memoryview(payload).cast("B")
        with self._mu:
            body = self._take_spare(src.nbytes)
        if body is None:
            body = memoryview(np.empty(src.nbytes, np.uint8)).cast("B")  # not zero-filled: the copy writes every byte
        running = envelope.start_checksum(key)
        envelope.copy_hashed(running, src, body)  # the checksum of the bytes kept, in the copy's one pass
        head = envelope.encode_header_with(key, body.nbytes, running.digest())
        stored = _Stored(head, body)  # built before anything is visible
        with self._mu:
            old = self._objects.pop(key, None)  # out of the way: its own bytes never make room for it
            if old is not None:
                self._used -= old.size
            try:
                self._make_room(stored.size)
            except RejectedObject:
                if old is not None:  # refused: the copy there stays (a refused store changes nothing)
                    self._objects[key] = old
                    self._used += old.size
                self._retire(stored)
                raise
            if old is not None:
                self._retire(old)
            self._objects[key] = stored
            self._used += stored.size

    def _take_spare(self, size: int) -> memoryview | None:
        spares = self._spares.get(size)
        if not spares:
            return None
        self._spare_bytes -= size
        return spares.pop()

    def _retire(self, stored: _Stored) -> None:
        """``stored`` left the table (under ``_mu``): keep its buffer for a later store when nobody
        reads it and there is room among the spares; else it goes with its last reference."""
        size = stored.body.nbytes
        if stored.readers == 0 and self._spare_bytes + size <= self._spare_limit:
            self._spares.setdefault(size, []).append(stored.body)
            self._spare_bytes += size

    def _eviction_lock(self) -> threading.Lock:
        return self._mu

    def _still_here(self, keys: list[ObjectKey], recheck: bool) -> list[ObjectKey]:
        return [k for k in keys if k in self._objects]  # under _mu: see BackendAdapter._announce_stored

    def _make_room(self, need: int) -> None:
        if need > self._capacity:
            raise RejectedObject(f"object of {need} bytes exceeds the tier's {self._capacity}")
        # Walk from the oldest end only as far as needed, choosing first and removing after: a copy of
        # the whole table on every put held _mu for tens of ms at a few hundred thousand objects.
        over = self._used + need - self._capacity
        victims: list[ObjectKey] = []
        for key, stored in self._objects.items():
            if over <= 0:
                break
            if self.is_pinned(key):
                continue
            victims.append(key)
            over -= stored.size
        if over > 0:
            raise RejectedObject("memory tier is full of pinned objects")
        for victim in victims:
            gone = self._objects.pop(victim)
            self._used -= gone.size
            self._retire(gone)
            self._tell_removed((victim,), "evicted")

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        with self._mu:
            stored = self._objects.get(key)
            if stored is None:
                return False
            self._objects.move_to_end(key)
            stored.readers += 1  # its buffer is not reused while this copy reads it
        try:
            head = stored.head
            header = envelope.decode_header(head)
            if len(head) != envelope.HEADER_BYTES + header.key_len:
                raise envelope.CorruptObject("header and key do not agree")
            dst = memoryview(dest).cast("B")
            if dst.nbytes != header.payload_len:
                raise envelope.DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
            envelope.copy_verified(key, header, head[envelope.HEADER_BYTES :], stored.body, dst)
            return True
        finally:
            with self._mu:
                stored.readers -= 1

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        with self._mu:
            return [k in self._objects for k in keys]

    def _delete(self, key: ObjectKey) -> None:
        with self._mu:
            gone = self._objects.pop(key, None)
            if gone is not None:
                self._used -= gone.size
                self._retire(gone)

    def _clear(self) -> int:
        with self._mu:
            n = len(self._objects)
            for gone in self._objects.values():
                self._retire(gone)
            self._objects.clear()
            self._used = 0
            return n

    def _usage(self) -> tuple[int, int, int]:
        with self._mu:
            return self._used, self._capacity, len(self._objects)

    def corrupt_for_test(self, key: ObjectKey, offset: int, mask: int = 0xFF) -> None:
        """Flip one stored byte (its ``mask`` bits; tests prove a corrupt object is a miss, never bad KV)."""
        with self._mu:
            stored = self._objects[key]
            if offset < len(stored.head):
                whole = bytearray(stored.head)
                whole[offset] ^= mask
                stored.head = bytes(whole)
            else:
                stored.body[offset - len(stored.head)] ^= mask


ADAPTER = AdapterType("memory", MemoryConfig, MemoryAdapter, help="in-process reference tier")
