"""Background movers between L1 and the L2 tiers. Neither ever blocks the request path.

``StoreController`` pushes every object that becomes READY in L1 to the tiers (write-through). Its queue
is bounded: when L2 cannot keep up, new objects are dropped from the push and counted, and L1 keeps
serving. ``skip_l1`` placement removes an object from L1 once every tier has it.

``PrefetchController`` serves LOOKUP misses: it asks the tiers for the missing chunks, reserves L1 slots,
loads into them, and publishes only what loaded and verified. The session then reports the full hit and
a retrieve reads from L1.

One ``TierDriver`` thread sleeps in ``poll`` on a wake-up eventfd and the tiers' eventfds, and hands
every completion to both controllers (each ignores task ids it does not own; a tier's results can be
drained only once, so one thread must own that). Controllers work in small batches and keep bookkeeping
under their own locks. No backend I/O happens on the driver: the adapters' threads do that.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvdepot.protocol.messages import SlotStatus
from kvdepot.storage.arena import SharedArena
from kvdepot.storage.l1 import NO_LEASE, ObjectTable, Toucher
from kvdepot.storage.l2.base import L2Adapter, TaskKind, TaskResult
from kvdepot.types import ClientId, LeaseId, ObjectKey

log = logging.getLogger(__name__)

STORE_OWNER = ClientId(b"\x00kvdepot-l2-store")
PREFETCH_OWNER = ClientId(b"\x00kvdepot-l2-prefetch")
BACKGROUND_LEASE_TTL_S = 600.0  # L2 I/O has its own timeouts; this only bounds a stuck backend


class Placement(str, Enum):
    WRITE_THROUGH = "write_through"  # in L1 and every tier
    SKIP_L1 = "skip_l1"  # in every tier; dropped from L1 once they all have it


Step = Callable[[list[tuple[int, TaskResult]]], None]  # (tier index, result) pairs


class TierDriver:
    """The one thread that drains tier completions and runs the controllers' steps."""

    def __init__(self, tiers: Sequence[L2Adapter]) -> None:
        self._tiers = list(tiers)
        self._steps: list[Step] = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, step: Step) -> None:
        self._steps.append(step)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdepot-l2-driver", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        os.close(self._wake_fd)
        self._wake_fd = -1

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        index_of_fd = {}
        for i, tier in enumerate(self._tiers):
            poller.register(tier.eventfd, select.POLLIN)
            index_of_fd[tier.eventfd] = i
        while not self._stop.is_set():
            events = poller.poll(500)
            results: list[tuple[int, TaskResult]] = []
            for fd, _ in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                elif fd in index_of_fd:
                    i = index_of_fd[fd]
                    results.extend((i, r) for r in self._tiers[i].completed())
            for step in self._steps:
                try:
                    step(results)
                except Exception:
                    log.exception("L2 controller step failed")


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

    def on_ready(self, keys: list[ObjectKey], writer: ClientId) -> None:
        """ObjectTable listener (runs on a request thread): enqueue, never wait."""
        if writer == PREFETCH_OWNER:
            return  # it came from L2: writing it back would only repeat the bytes
        with self._lock:
            room = self._queue_limit - len(self._queue)
            if room < len(keys):
                self.stats.dropped += len(keys) - max(room, 0)
                keys = keys[: max(room, 0)]
            self._queue.extend(keys)
        if keys:
            self.wake()

    def idle(self) -> bool:
        """Nothing queued and nothing in flight (tests and the restart benchmark wait on this)."""
        with self._lock:
            return not self._queue and self._open == 0

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
        lease, objects = self._table.acquire_read_each(keys, STORE_OWNER, ttl_s=BACKGROUND_LEASE_TTL_S)
        with self._lock:
            self.stats.skipped_gone += len(keys) - len(objects)
            if not objects:
                self._open -= 1
                return
            self.stats.submitted += len(objects)
        items = [(key, memoryview(self._arena.buffer[off : off + size])) for key, off, size in objects]
        batch = _StoreBatch(lease, [k for k, _, _ in objects], len(self._tiers), [True] * len(objects))
        for i, tier in enumerate(self._tiers):
            task = tier.submit_store(items)
            with self._lock:
                self._batches[(i, task)] = batch

    def _complete(self, tier_index: int, result: TaskResult) -> None:
        if result.kind is not TaskKind.STORE:
            return
        with self._lock:
            batch = self._batches.pop((tier_index, result.task_id), None)
            if batch is None:
                return
            for i, ok in enumerate(result.value):
                batch.stored_everywhere[i] &= bool(ok)
            stored = sum(1 for ok in result.value if ok)
            self.stats.stored += stored
            self.stats.failed += len(result.value) - stored
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


class PrefetchState(Enum):
    LOOKUP = "lookup"
    LOAD = "load"
    DONE = "done"


@dataclass
class PrefetchJob:
    """One LOOKUP's fetch of missing chunks ``keys[start:]`` from L2. ``on_done(loaded)`` gets how many
    chunks from the first ``start`` on are now READY in L1 (a prefix). Tiers are asked in order; a tier
    that holds part of what is missing supplies that part, and the next tier is asked for the rest."""

    keys: list[ObjectKey]
    start: int  # advances as tiers supply chunks
    size: int
    salt: str
    on_done: Callable[[int], None]
    state: PrefetchState = PrefetchState.LOOKUP
    tier: int = 0
    found: int = 0
    loaded: int = 0  # chunks supplied so far, from the first start on
    lease: LeaseId = NO_LEASE
    load_keys: list[ObjectKey] = field(default_factory=list)


@dataclass
class PrefetchStats:
    jobs: int = 0
    running: int = 0
    lookups_hit: int = 0
    chunks_loaded: int = 0
    chunks_failed: int = 0


class PrefetchController:
    def __init__(self, table: ObjectTable, arena: SharedArena, tiers: Sequence[L2Adapter], wake: Callable[[], None]) -> None:
        self._tiers = list(tiers)
        self.wake = wake
        self._table = table
        self._arena = arena
        self._lock = threading.Lock()
        self._incoming: deque[PrefetchJob] = deque()
        self._tasks: dict[tuple[int, int], PrefetchJob] = {}
        self.stats = PrefetchStats()

    def submit(self, job: PrefetchJob) -> None:
        with self._lock:
            self._incoming.append(job)
            self.stats.jobs += 1
            self.stats.running += 1
        self.wake()

    def snapshot(self) -> PrefetchStats:
        with self._lock:
            return PrefetchStats(**vars(self.stats))

    def step(self, results: list[tuple[int, TaskResult]]) -> None:
        with self._lock:
            new = list(self._incoming)
            self._incoming.clear()
        for job in new:
            self._ask(job)
        for tier_index, result in results:
            with self._lock:
                job = self._tasks.pop((tier_index, result.task_id), None)
            if job is None:
                continue
            if job.state is PrefetchState.LOOKUP and result.kind is TaskKind.LOOKUP:
                self._after_lookup(job, result)
            elif job.state is PrefetchState.LOAD and result.kind is TaskKind.LOAD:
                self._after_load(job, result)

    def _ask(self, job: PrefetchJob) -> None:
        """Ask the job's current tier how many of the missing chunks it holds."""
        if job.tier >= len(self._tiers) or job.start >= len(job.keys):
            self._finish(job, job.loaded)
            return
        task = self._tiers[job.tier].submit_lookup_and_lock(job.keys[job.start :])
        with self._lock:
            self._tasks[(job.tier, task)] = job

    def _after_lookup(self, job: PrefetchJob, result: TaskResult) -> None:
        if not result.ok or result.value == 0:
            job.tier += 1  # try the next tier
            self._ask(job)
            return
        job.found = result.value
        wanted = job.keys[job.start : job.start + job.found]
        res = self._table.reserve_write(
            wanted, job.size, PREFETCH_OWNER, job.salt, ttl_s=BACKGROUND_LEASE_TTL_S, toucher=Toucher.SERVER
        )
        usable = 0
        for status in res.statuses:
            if status not in (SlotStatus.ALLOCATED, SlotStatus.EXISTS):
                break
            usable += 1
        job.lease = res.lease_id
        job.load_keys = [k for k, st in zip(wanted[:usable], res.statuses) if st == SlotStatus.ALLOCATED]
        dests = [memoryview(self._arena.buffer[off : off + job.size]) for off, st in zip(res.offsets[:usable], res.statuses) if st == SlotStatus.ALLOCATED]
        job.found = usable
        if not job.load_keys:
            self._table.finish_write(job.lease, PREFETCH_OWNER, set())
            self._unlock(job, wanted)
            self._advance(job, usable, complete=usable == len(wanted))
            return
        job.state = PrefetchState.LOAD
        task = self._tiers[job.tier].submit_load(job.load_keys, dests)
        with self._lock:
            self._tasks[(job.tier, task)] = job
            self.stats.lookups_hit += 1

    def _after_load(self, job: PrefetchJob, result: TaskResult) -> None:
        loaded = {k for k, ok in zip(job.load_keys, result.value) if ok}
        published = self._table.finish_write(job.lease, PREFETCH_OWNER, loaded)
        self._unlock(job, job.keys[job.start : job.start + job.found])
        with self._lock:
            self.stats.chunks_loaded += published
            self.stats.chunks_failed += len(job.load_keys) - len(loaded)
        # The usable prefix ends at the first chunk that is neither loaded nor already present.
        prefix = 0
        for key in job.keys[job.start : job.start + job.found]:
            if key in job.load_keys and key not in loaded:
                break
            prefix += 1
        self._advance(job, prefix, complete=prefix == job.found)

    def _advance(self, job: PrefetchJob, supplied: int, complete: bool) -> None:
        """``supplied`` more chunks are in L1. If the tier gave all it had, ask the next tier for the
        rest; a chunk that failed to load ends the prefix here."""
        job.loaded += supplied
        job.start += supplied
        job.state = PrefetchState.LOOKUP
        if complete and job.start < len(job.keys):
            job.tier += 1
            self._ask(job)
        else:
            self._finish(job, job.loaded)

    def _unlock(self, job: PrefetchJob, keys: list[ObjectKey]) -> None:
        if keys:
            self._tiers[job.tier].submit_unlock(keys)

    def _finish(self, job: PrefetchJob, loaded: int) -> None:
        job.state = PrefetchState.DONE
        with self._lock:
            self.stats.running -= 1
        try:
            job.on_done(loaded)
        except Exception:
            log.exception("prefetch completion callback failed")
