"""``StoreController``: pushes every object that becomes READY in L1 to the tiers (write-through).

Its queue is bounded: when L2 cannot keep up, new objects are dropped from the push and counted, and
L1 keeps serving. ``skip_l1`` placement removes an object from L1 once every tier has it. It learns of
new objects from the object table's ``stored`` events, and never blocks the request path.

Eviction spares an object while it waits in the queue: the table holds every new object from the
moment it is READY (``ObjectTable.hold_for_l2``) until the push has read-locked it, or dropped it, and
evicts a held one only when nothing else in L1 can go (the table counts those). So ``skipped_gone``
counts objects removed on purpose meanwhile (a clear, an expiry, corruption) plus those last-resort
evictions: zero while L2 keeps up.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvdepot.config import Placement
from kvdepot.events import EventKind, ObjectEvent
from kvdepot.shm import SharedArena
from kvdepot.storage.controllers.owners import BACKGROUND_LEASE_TTL_S, PREFETCH_OWNER, STORE_OWNER
from kvdepot.storage.l1 import ObjectTable
from kvdepot.storage.l2.contract import L2Adapter, TaskKind, TaskResult
from kvdepot.types import ClientId, LeaseId, ObjectKey

log = logging.getLogger(__name__)


@dataclass
class _StoreBatch:
    lease: LeaseId
    keys: list[ObjectKey]
    pending: int  # tiers that have not answered yet
    stored_everywhere: list[bool]


@dataclass
class StoreStats:
    queued: int = 0
    in_flight: int = 0
    submitted: int = 0
    stored: int = 0
    failed: int = 0
    dropped: int = 0
    skipped_gone: int = 0


class StoreController:
    def __init__(
        self,
        table: ObjectTable,
        arena: SharedArena,
        tiers: Sequence[L2Adapter],
        wake: Callable[[], None],
        placement: Placement = Placement.WRITE_THROUGH,
        queue_limit: int = 65536,
        batch_size: int = 16,
        max_in_flight: int = 8,
    ) -> None:
        self._tiers = list(tiers)
        self.wake = wake
        self._table = table
        self._arena = arena
        self._placement = placement
        self._queue: deque[ObjectKey] = deque()
        self._queue_limit = queue_limit
        self._batch = batch_size
        self._max_in_flight = max_in_flight
        self._lock = threading.Lock()
        self._batches: dict[tuple[int, int], _StoreBatch] = {}  # (tier index, task id) -> batch
        self._open = 0
        self.stats = StoreStats()
        # Held from a batch's read lock until its stores are submitted to every tier; a delete or a clear
        # holds it while it removes from L1 and submits its own tier tasks. Without it, one that came in
        # between doomed the locked objects and reached the tiers first: the push, submitted after it,
        # counted as a newer write and brought the deleted objects back into the tiers.
        self.submitting = threading.Lock()

    def holds(self, writer: ClientId) -> bool:
        """Whether objects this writer commits are pushed (and so held in L1 until then)."""
        return writer != PREFETCH_OWNER

    def on_events(self, events: list[ObjectEvent]) -> None:
        """ObjectTable subscriber (runs on a request thread): enqueue new objects, never wait. What the
        prefetcher loaded from L2 is not pushed back: that would only repeat the bytes."""
        keys = [e.key for e in events if e.kind is EventKind.STORED and self.holds(e.writer)]
        if not keys:
            return
        dropped: list[ObjectKey] = []
        with self._lock:
            room = self._queue_limit - len(self._queue)
            if room < len(keys):
                self.stats.dropped += len(keys) - max(room, 0)
                keys, dropped = keys[: max(room, 0)], keys[max(room, 0) :]
            self._queue.extend(keys)
        if dropped:
            self._table.release_l2_hold(dropped)  # never pushed: evictable like any other object
        if keys:
            self.wake()

    def snapshot(self) -> StoreStats:
        with self._lock:
            self.stats.queued = len(self._queue)
            self.stats.in_flight = self._open
            return StoreStats(**vars(self.stats))

    def step(self, results: list[tuple[int, TaskResult]]) -> None:
        for tier_index, result in results:
            self._complete(tier_index, result)
        while True:
            with self._lock:
                if self._open >= self._max_in_flight or not self._queue:
                    return
                keys = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                self._open += 1  # in flight from the moment it leaves the queue: idle() never lies
            self._submit(keys)

    def _submit(self, keys: list[ObjectKey]) -> None:
        with self.submitting:
            self._submit_locked(keys)

    def _submit_locked(self, keys: list[ObjectKey]) -> None:
        lease, objects = self._table.acquire_read_each(keys, STORE_OWNER, ttl_s=BACKGROUND_LEASE_TTL_S)
        self._table.release_l2_hold(keys)  # the read lock protects them now
        with self._lock:
            self.stats.skipped_gone += len(keys) - len(objects)
            if not objects:
                self._open -= 1
                return
            self.stats.submitted += len(objects)
        items = [(key, memoryview(self._arena.buffer[off : off + size])) for key, off, size in objects]
        batch = _StoreBatch(lease, [k for k, _, _ in objects], len(self._tiers), [True] * len(objects))
        for i, tier in enumerate(self._tiers):
            try:
                task = tier.submit_store(items)
            except Exception:
                # (MemoryError, an adapter of another package.) No result will ever come for it: the batch
                # fails in that tier now, or it stayed in flight for good, holding its slot and read lease.
                log.exception("L2 %s could not take a push of %d objects: they are not stored there", tier.name, len(items))
                self._tier_answered(batch, [False] * len(items))
                continue
            with self._lock:
                self._batches[(i, task)] = batch

    def _complete(self, tier_index: int, result: TaskResult) -> None:
        if result.kind is not TaskKind.STORE:
            return
        with self._lock:
            batch = self._batches.pop((tier_index, result.task_id), None)
        if batch is not None:
            self._tier_answered(batch, result.value)

    def _tier_answered(self, batch: _StoreBatch, value: list[bool]) -> None:
        """One tier's outcome per object of ``batch``; the last tier's ends it."""
        with self._lock:
            for i, ok in enumerate(value):
                batch.stored_everywhere[i] &= bool(ok)
            stored = sum(1 for ok in value if ok)
            self.stats.stored += stored
            self.stats.failed += len(value) - stored
            batch.pending -= 1
            finished = batch.pending == 0
            if finished:
                self._open -= 1
        if not finished:
            return
        try:
            self._table.release_read(batch.lease, STORE_OWNER)
        except Exception:
            pass  # expired: nothing left to release
        if self._placement is Placement.SKIP_L1:
            self._table.discard([k for k, ok in zip(batch.keys, batch.stored_everywhere) if ok])
        self.wake()  # the in-flight slot is free: take more from the queue
