"""``PrefetchController``: serves LOOKUP misses from the tiers.

It asks the tiers for the missing chunks, reserves L1 slots, loads into them, and publishes only what
loaded and verified. The session then reports the full hit and a retrieve reads from L1.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvdepot.errors import IllegalTransition, KVDepotError
from kvdepot.shm import SharedArena
from kvdepot.storage.controllers.owners import BACKGROUND_LEASE_TTL_S, PREFETCH_OWNER
from kvdepot.storage.l1 import ObjectTable, Toucher
from kvdepot.storage.l2.contract import L2Adapter, LookupHints, TaskKind, TaskResult
from kvdepot.types import NO_LEASE, LeaseId, ObjectKey, SlotStatus, leading_run

log = logging.getLogger(__name__)


class PrefetchState(Enum):
    LOOKUP = "lookup"
    LOAD = "load"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Prefetched:
    """What a prefetch brought into L1: ``chunks`` leading chunks from the first ``start`` on are READY
    now, ``by_tier`` of them loaded from each tier (by tier name; chunks that were in L1 meanwhile, put
    there by another client, are in no tier's count: they are L1's hits)."""

    chunks: int
    by_tier: dict[str, int]


@dataclass
class PrefetchJob:
    """One LOOKUP's fetch of missing chunks ``keys[start:]`` from L2. ``on_done(Prefetched)`` says how
    many chunks from the first ``start`` on are now READY in L1 (a prefix). Tiers are asked in order; a tier
    that holds part of what is missing supplies that part, and the next tier is asked for the rest::

        LOOKUP(tier t) ──has none (or failed): next_tier──► LOOKUP(t+1)
           │ has some: start_load                    ▲
           ▼                                         │ supplied all it had, more missing: supplied
         LOAD(t) ──loaded: supplied─────────────────┘
           │                                     (a chunk failed, no tier left, or nothing missing)
           └────────────────────────── finish ──► DONE

    Each transition checks the state it leaves and raises IllegalTransition (changing nothing) when
    called from another; only the driver thread moves a job."""

    keys: list[ObjectKey]
    start: int  # advances as tiers supply chunks
    size: int
    salt: str
    on_done: Callable[[Prefetched], None]
    hints: LookupHints | None = None  # what the engine told its lookup (a router's hint, its prefill rate)
    # Does anyone still wait for it? (its lookup's session was not ended: None, always). Asked before each
    # tier is asked and before each load: a job nobody waits for ends there, with what it has.
    wanted: Callable[[], bool] | None = None
    state: PrefetchState = PrefetchState.LOOKUP
    tier: int = 0
    found: int = 0  # chunks the current tier holds (and pinned) from ``start`` on
    usable: int = 0  # of those, the leading ones L1 can take (the rest are busy or find no room)
    loaded: int = 0  # chunks supplied so far, from the first start on
    lease: LeaseId = NO_LEASE
    load_keys: list[ObjectKey] = field(default_factory=list)
    load_clears: int = -1  # the tier's clears begun when this load was submitted; -1: one was running then
    by_tier: dict[int, int] = field(default_factory=dict)  # tier index -> chunks it supplied

    def _require(self, *states: PrefetchState) -> None:
        if self.state not in states:
            raise IllegalTransition(f"prefetch job is {self.state.value}, not {' or '.join(s.value for s in states)}")

    def next_tier(self) -> None:
        """The current tier had none of the missing chunks (or failed): ask the next one."""
        self._require(PrefetchState.LOOKUP)
        self.tier += 1

    def start_load(self, lease: LeaseId, keys: list[ObjectKey], found: int, usable: int) -> None:
        """L1 slots are reserved under ``lease`` for ``keys``: those of the ``usable`` leading chunks (of
        the ``found`` the tier holds and pinned) that L1 does not hold yet."""
        self._require(PrefetchState.LOOKUP)
        self.state, self.lease, self.load_keys = PrefetchState.LOAD, lease, keys
        self.found, self.usable = found, usable

    def supplied(self, n: int, complete: bool, loaded: int | None = None) -> bool:
        """``n`` more chunks are READY in L1, ``loaded`` of them from the current tier (None: all; the
        others were in L1 meanwhile); returns whether to ask the next tier for the rest (the tier gave
        all it had and more is missing)."""
        self._require(PrefetchState.LOOKUP, PrefetchState.LOAD)
        self.state = PrefetchState.LOOKUP
        loaded = n if loaded is None else loaded
        if loaded:
            self.by_tier[self.tier] = self.by_tier.get(self.tier, 0) + loaded
        self.loaded += n
        self.start += n
        if complete and self.start < len(self.keys):
            self.tier += 1
            return True
        return False

    def finish(self) -> int:
        self._require(PrefetchState.LOOKUP, PrefetchState.LOAD)
        self.state = PrefetchState.DONE
        return self.loaded


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
        # Per tier: its clears begun, and those not ended yet. A load that overlapped a clear (submitted
        # while one ran, or one began before it ended) may have read what the clear removes: it publishes
        # nothing, or a clear of everything would find the cleared KV back in L1 once it answered.
        self._clears_begun = [0] * len(self._tiers)
        self._clears_running = [0] * len(self._tiers)
        self.stats = PrefetchStats()

    def tier_clear_begins(self, tier: int) -> None:
        """A clear of tier ``tier`` is about to be submitted (before L1 is emptied, for a clear of both):
        what a load from it brings back from now until ``tier_clear_ended`` is not kept."""
        with self._lock:
            self._clears_begun[tier] += 1
            self._clears_running[tier] += 1

    def tier_clear_ended(self, tier: int) -> None:
        """That clear's task ended (done, failed, or never run)."""
        with self._lock:
            self._clears_running[tier] -= 1

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
            self._guarded(job, lambda job=job: self._ask(job))
        for tier_index, result in results:
            with self._lock:
                job = self._tasks.pop((tier_index, result.task_id), None)
            if job is None:
                continue
            if job.state is PrefetchState.LOOKUP and result.kind is TaskKind.LOOKUP:
                self._guarded(job, lambda job=job, result=result: self._after_lookup(job, result))
            elif job.state is PrefetchState.LOAD and result.kind is TaskKind.LOAD:
                self._guarded(job, lambda job=job, result=result: self._after_load(job, result))

    def _guarded(self, job: PrefetchJob, move: Callable[[], None]) -> None:
        """One job's step: whatever goes wrong ends that job with what it has (its LOOKUP answered,
        its count right), never the other jobs of this step, and never silently."""
        try:
            move()
        except Exception:
            log.exception("a prefetch from L2 failed: that lookup ends with the chunks it had")
            if job.state is not PrefetchState.DONE:
                self._finish(job)

    @staticmethod
    def _abandoned(job: PrefetchJob) -> bool:
        """Nobody waits for this job any more (its session ended: the engine gave up on the lookup).
        Its loads would reserve L1 space and keep the tier busy ahead of jobs somebody waits for."""
        return job.wanted is not None and not job.wanted()

    def _ask(self, job: PrefetchJob) -> None:
        """Ask the job's current tier how many of the missing chunks it holds."""
        if job.tier >= len(self._tiers) or job.start >= len(job.keys) or self._abandoned(job):
            self._finish(job)
            return
        task = self._tiers[job.tier].submit_lookup_and_lock(job.keys[job.start :], job.hints)
        with self._lock:
            self._tasks[(job.tier, task)] = job

    def _after_lookup(self, job: PrefetchJob, result: TaskResult) -> None:
        if not result.ok or result.value == 0:
            job.next_tier()
            self._ask(job)
            return
        wanted = job.keys[job.start : job.start + result.value]
        if self._abandoned(job):
            self._unlock(job, wanted)  # the pins the tier's lookup took
            self._finish(job)
            return
        # The leading chunks already in L1 (the lookup's, and what earlier tiers supplied) are the prefix
        # this load extends: making room by evicting them would load chunks past a gap (a lock-free
        # lookup's count would then name chunks no retrieve can get).
        res = self._table.reserve_write(
            wanted, job.size, PREFETCH_OWNER, job.salt, ttl_s=BACKGROUND_LEASE_TTL_S, protect=job.keys[: job.start],
            toucher=Toucher.SERVER,
        )
        usable = leading_run(s.holds for s in res.statuses)
        load_keys = [k for k, st in zip(wanted[:usable], res.statuses) if st == SlotStatus.ALLOCATED]
        dests = [memoryview(self._arena.buffer[off : off + job.size]) for off, st in zip(res.offsets[:usable], res.statuses) if st == SlotStatus.ALLOCATED]
        if not load_keys:  # all already in L1 (or none could get a slot)
            self._table.finish_write(res.lease_id, PREFETCH_OWNER, set())
            self._unlock(job, wanted)
            self._advance(job, usable, complete=usable == len(wanted), loaded=0)
            return
        job.start_load(res.lease_id, load_keys, len(wanted), usable)
        with self._lock:
            job.load_clears = -1 if self._clears_running[job.tier] else self._clears_begun[job.tier]
        try:
            task = self._tiers[job.tier].submit_load(job.load_keys, dests)
        except Exception:
            # No result will come: give back the slots reserved for it and the pins the lookup took (they
            # stayed for the lease's TTL, and for good), then let _guarded end the job.
            self._table.finish_write(res.lease_id, PREFETCH_OWNER, set())
            self._unlock(job, wanted)
            raise
        with self._lock:
            self._tasks[(job.tier, task)] = job
            self.stats.lookups_hit += 1

    def _after_load(self, job: PrefetchJob, result: TaskResult) -> None:
        loaded = {k for k, ok in zip(job.load_keys, result.value) if ok}
        self._unlock(job, job.keys[job.start : job.start + job.found])  # every pin the tier took, used or not
        try:
            # Under the lock a clear's begin takes: either this publishes before a clear of L1 that
            # follows it (which removes it), or it sees the clear and publishes nothing.
            with self._lock:
                if job.load_clears < 0 or job.load_clears != self._clears_begun[job.tier]:
                    loaded = set()  # it may have read what a clear of the tier removed meanwhile
                # The whole prefix, head most recent: the head was in L1 before these, and LRU would take
                # it first (a lookup's count then names chunks past a gap; see ObjectTable.finish_write).
                published = self._table.finish_write(job.lease, PREFETCH_OWNER, loaded, run=job.keys[: job.start + job.usable])
        except KVDepotError as exc:
            # The load outlived its lease (a backend that hung for BACKGROUND_LEASE_TTL_S): nothing of it
            # was published, and the lookup still gets its answer.
            log.warning("a prefetch's load from L2 %s ended after its lease: nothing of it is kept (%s)", self._tiers[job.tier].name, exc)
            published, loaded = 0, set()
        with self._lock:
            self.stats.chunks_loaded += published
            self.stats.chunks_failed += len(job.load_keys) - len(loaded)
        # The usable prefix ends at the first chunk that is neither loaded nor already present.
        failed = set(job.load_keys) - loaded
        run = job.keys[job.start : job.start + job.usable]
        prefix = leading_run(key not in failed for key in run)
        # The tier is credited with what it loaded; the prefix's other chunks were in L1 (L1's hits).
        self._advance(job, prefix, complete=prefix == job.found, loaded=sum(1 for key in run[:prefix] if key in loaded))

    def _advance(self, job: PrefetchJob, supplied: int, complete: bool, loaded: int | None = None) -> None:
        """``supplied`` more chunks are in L1 (``loaded`` of them from the tier: see ``supplied``). If the
        tier gave all it had, ask the next tier for the rest; a chunk that failed to load ends the prefix here."""
        if job.supplied(supplied, complete, loaded):
            self._ask(job)
        else:
            self._finish(job)

    def _unlock(self, job: PrefetchJob, keys: list[ObjectKey]) -> None:
        if keys:
            self._tiers[job.tier].submit_unlock(keys)

    def _finish(self, job: PrefetchJob) -> None:
        loaded = job.finish()
        with self._lock:
            self.stats.running -= 1
        try:
            job.on_done(Prefetched(loaded, {self._tiers[t].name: n for t, n in job.by_tier.items()}))
        except Exception:
            log.exception("prefetch completion callback failed")
