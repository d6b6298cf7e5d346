"""``memory``: an in-process L2 (a dict), the reference implementation the contract tests pin.

Real in every way that matters to the contract (envelope, checksums, all-or-nothing stores, capacity
with LRU), it only lacks persistence. Useful for tests and as a second, slower-than-L1 tier.
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


class MemoryConfig(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None  # --l2 keys, not flags

    size_gb: Annotated[float, option("capacity in GiB (LRU beyond it)", gt=0)] = 1.0
    workers: Annotated[int, option("threads running the tier's tasks", ge=1, le=256)] = 2


class MemoryAdapter(BackendAdapter):
    kind = "memory"

    def __init__(self, name: str, config: MemoryConfig, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self._capacity = int(config.size_gb * (1 << 30))
        # key -> (header+key, payload): kept apart so a store copies the payload once.
        self._objects: OrderedDict[ObjectKey, tuple[bytes, memoryview]] = OrderedDict()
        self._used = 0
        self._mu = threading.Lock()

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        src = memoryview(payload).cast("B")
        body = memoryview(np.empty(src.nbytes, np.uint8)).cast("B")  # not zero-filled: the copy writes every byte
        running = envelope.start_checksum(key)
        envelope.copy_hashed(running, src, body)  # the checksum of the bytes kept, in the copy's one pass
        head = envelope.encode_header_with(key, body.nbytes, running.digest())
        blob = (head, body)  # built before anything is visible
        size = len(head) + body.nbytes
        with self._mu:
            old = self._objects.pop(key, None)
            if old is not None:
                self._used -= len(old[0]) + old[1].nbytes
            self._make_room(size)
            self._objects[key] = blob
            self._used += size

    def _eviction_lock(self) -> threading.Lock:
        return self._mu

    def _still_here(self, keys: list[ObjectKey], recheck: bool) -> list[ObjectKey]:
        return [k for k in keys if k in self._objects]  # under _mu: see BackendAdapter._announce_stored

    def _make_room(self, need: int) -> None:
        if need > self._capacity:
            raise RejectedObject(f"object of {need} bytes exceeds the tier's {self._capacity}")
        for victim in list(self._objects):
            if self._used + need <= self._capacity:
                return
            if self.is_pinned(victim):
                continue
            head, body = self._objects.pop(victim)
            self._used -= len(head) + body.nbytes
            self._tell_removed((victim,), "evicted")
        if self._used + need > self._capacity:
            raise RejectedObject("memory tier is full of pinned objects")

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        with self._mu:
            blob = self._objects.get(key)
            if blob is not None:
                self._objects.move_to_end(key)
        if blob is None:
            return False
        head, body = blob
        header = envelope.decode_header(head)
        if len(head) != envelope.HEADER_BYTES + header.key_len:
            raise envelope.CorruptObject("header and key do not agree")
        dst = memoryview(dest).cast("B")
        if dst.nbytes != header.payload_len:
            raise envelope.DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
        envelope.copy_verified(key, header, head[envelope.HEADER_BYTES :], body, dst)
        return True

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        with self._mu:
            return [k in self._objects for k in keys]

    def _delete(self, key: ObjectKey) -> None:
        with self._mu:
            blob = self._objects.pop(key, None)
            if blob is not None:
                self._used -= len(blob[0]) + blob[1].nbytes

    def _clear(self) -> int:
        with self._mu:
            n = len(self._objects)
            self._objects.clear()
            self._used = 0
            return n

    def _usage(self) -> tuple[int, int, int]:
        with self._mu:
            return self._used, self._capacity, len(self._objects)

    def corrupt_for_test(self, key: ObjectKey, offset: int) -> None:
        """Flip one stored byte (tests prove a corrupt object is a miss, never bad KV)."""
        with self._mu:
            head, body = self._objects[key]
            if offset < len(head):
                whole = bytearray(head)
                whole[offset] ^= 0xFF
                self._objects[key] = (bytes(whole), body)
            else:
                body[offset - len(head)] ^= 0xFF


ADAPTER = AdapterType("memory", MemoryConfig, MemoryAdapter, help="in-process reference tier")
