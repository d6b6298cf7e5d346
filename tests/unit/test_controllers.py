"""The L2 controllers driven by hand: a real object table over a real arena, real in-memory tiers, and
the test itself in the tier driver's place (it waits on the tiers' eventfds and steps the controllers
with their completions, as ``TierDriver`` does), so every step happens where the test says.

Objects are ``SIZE`` bytes; the arena holds ``SLOTS`` of them.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvdepot.config import Placement
from kvdepot.events import EventKind, ObjectEvent, RemovedBecause
from kvdepot.shm import HEADER_BYTES, SharedArena
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.controllers import (
    Prefetched,
    PREFETCH_OWNER,
    PrefetchController,
    PrefetchJob,
    PrefetchStats,
    StoreController,
    StoreStats,
)
from kvdepot.storage.eviction import LRUPolicy
from kvdepot.storage.l1 import ObjectTable
from kvdepot.storage.l2 import envelope
from kvdepot.storage.l2.contract import TaskKind, TaskResult
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig
from kvdepot.storage.manager import TIER_CLEAR_WAIT_S
from kvdepot.types import NO_LEASE, ClientId, ObjectKey, SlotStatus

SIZE = 4096
SLOTS = 16
WAIT_S = TIER_CLEAR_WAIT_S  # the longest the storage manager itself waits on a tier's answer
A = ClientId(b"client-a")
KEY_BYTES = 48
PAYLOAD_AT = envelope.HEADER_BYTES + KEY_BYTES  # where a memory-tier object's payload starts


def key(i: int, prompt: bytes = b"p") -> ObjectKey:
    return ObjectKey(prompt.ljust(16, b".") + i.to_bytes(32, "big"))


def keys(n: int, prompt: bytes = b"p") -> list[ObjectKey]:
    return [key(i, prompt) for i in range(n)]


def content(i: int, size: int = SIZE) -> np.ndarray:
    return np.full(size, 100 + i, np.uint8)


@dataclass
class Rig:
    """The parts manager.py wires, built by hand; ``wakes`` counts the controllers' wake-ups."""

    table: ObjectTable
    arena: SharedArena
    tiers: list[MemoryAdapter]
    events: list[ObjectEvent] = field(default_factory=list)
    wakes: int = 0
    delivered: set[tuple[int, int]] = field(default_factory=set)  # (tier, task id) handed out by run()
    _inbox: dict[int, list[TaskResult]] = field(default_factory=dict)

    def wake(self) -> None:
        self.wakes += 1

    def commit(self, ks: Sequence[ObjectKey], owner: ClientId = A, first_fill: int = 0) -> None:
        """Store ``ks`` in L1 as one batch; object i's bytes are ``content(first_fill + i)``."""
        r = self.table.reserve_write(ks, SIZE, owner)
        assert r.statuses == [SlotStatus.ALLOCATED] * len(ks)
        for i, off in enumerate(r.offsets):
            self.arena.buffer[off : off + SIZE] = content(first_fill + i)
        assert self.table.commit_write(r.lease_id, owner) == len(ks)

    def l1_bytes(self, ks: Sequence[ObjectKey]) -> list[bytes]:
        out = []
        for k in ks:
            obj = self.table.get(k)
            out.append(bytes(self.arena.buffer[obj.offset : obj.offset + obj.size]))
        return out

    def take(self, tier: int, n: int) -> list[tuple[int, TaskResult]]:
        """Wait for ``n`` completions of one tier (others stay where they are)."""
        box = self._inbox.setdefault(tier, [])
        poller = select.poll()
        poller.register(self.tiers[tier].eventfd, select.POLLIN)
        deadline = time.monotonic() + WAIT_S
        while len(box) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"tier {tier}: {len(box)} of {n} completions within {WAIT_S:g} s"
            if poller.poll(int(left * 1000) + 1):
                box.extend(self.tiers[tier].completed())
        got, self._inbox[tier] = box[:n], box[n:]
        return [(tier, r) for r in got]

    def run(self, steps: Sequence[Callable[[list[tuple[int, TaskResult]]], None]], done: Callable[[], bool]) -> None:
        """Be the tier driver until ``done()``: hand every completion of every tier to every step."""
        poller = select.poll()
        index = {}
        for i, t in enumerate(self.tiers):
            poller.register(t.eventfd, select.POLLIN)
            index[t.eventfd] = i
        for step in steps:
            step([])  # new work first, as the driver's first wake-up does
        deadline = time.monotonic() + WAIT_S
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, f"not done within {WAIT_S:g} s"
            results = [(index[fd], r) for fd, _ in poller.poll(int(left * 1000) + 1) for r in self.tiers[index[fd]].completed()]
            self.delivered.update((i, r.task_id) for i, r in results)
            for step in steps:
                step(results)

    def put(self, tier: int, items: Sequence[tuple[ObjectKey, np.ndarray]]) -> list[bool]:
        """Store objects straight into a tier (what an earlier write-through left there)."""
        t = self.tiers[tier]
        t.submit_store([(k, memoryview(a)) for k, a in items])
        [(_, r)] = self.take(tier, 1)
        assert r.kind is TaskKind.STORE
        return r.value

    def holds(self, tier: int, ks: Sequence[ObjectKey]) -> list[bool]:
        """Which of ``ks`` the tier holds (asked one by one; pins dropped again)."""
        out = []
        for k in ks:
            self.tiers[tier].submit_lookup_and_lock([k])
            [(_, r)] = self.take(tier, 1)
            out.append(r.value == 1)
            if r.value:
                self.tiers[tier].submit_unlock([k])
                self.take(tier, 1)
        return out


@pytest.fixture
def make_rig(tmp_path) -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(*tier_sizes: float) -> Rig:
        """One started memory tier per capacity given (in bytes); default: one roomy tier."""
        sizes = tier_sizes or (1 << 24,)
        table = ObjectTable(ExtentAllocator(SLOTS * SIZE, alignment=4096, base=HEADER_BYTES), LRUPolicy(), lease_ttl_s=60.0)
        arena = SharedArena.create(SLOTS * SIZE + HEADER_BYTES, shm_dir=str(tmp_path))
        # One worker per tier: its tasks run in the order submitted, so a marker task tells when the
        # ones before it are done (``settle``).
        tiers = [MemoryAdapter(f"mem{i}", MemoryConfig(size_gb=size / (1 << 30), workers=1)) for i, size in enumerate(sizes)]
        for t in tiers:
            t.start()
        rig = Rig(table, arena, tiers)
        table.subscribe(rig.events.extend)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        for t in rig.tiers:
            t.close()
        rig.arena.close()


def store_controller(rig: Rig, **options) -> StoreController:
    store = StoreController(rig.table, rig.arena, rig.tiers, rig.wake, **options)
    rig.table.hold_for_l2(store.holds)  # as manager.py wires it
    rig.table.subscribe(store.on_events)
    return store


def prefetch_controller(rig: Rig) -> PrefetchController:
    return PrefetchController(rig.table, rig.arena, rig.tiers, rig.wake)


def prefetch(rig: Rig, pf: PrefetchController, ks: list[ObjectKey], start: int = 0, steps=None) -> int:
    """Run one prefetch job to its end; returns how many chunks on_done said (it must say it exactly once)."""
    return prefetch_outcome(rig, pf, ks, start, steps).chunks


def prefetch_outcome(rig: Rig, pf: PrefetchController, ks: list[ObjectKey], start: int = 0, steps=None) -> Prefetched:
    told: list[Prefetched] = []
    pf.submit(PrefetchJob(ks, start, SIZE, "", told.append))
    rig.run(steps or [pf.step], lambda: bool(told))
    assert len(told) == 1
    return told[0]


def settle(rig: Rig, steps) -> None:
    """Let every tier finish what was submitted to it so far (the unlocks a prefetch sent last): a
    marker task, run after them by the tier's one worker, has completed."""
    for i, t in enumerate(rig.tiers):
        marker = t.submit_unlock([])
        rig.run(steps, lambda done=(i, marker): done in rig.delivered)


def pinned(rig: Rig, ks: Sequence[ObjectKey]) -> list[list[bool]]:
    """Per tier, which of ``ks`` it still pins against its own eviction."""
    return [[t.is_pinned(k) for k in ks] for t in rig.tiers]


def unpinned(rig: Rig, steps, ks: Sequence[ObjectKey]) -> None:
    """Every pin a prefetch took on ``ks`` is dropped again once the tiers have done its unlocks."""
    settle(rig, steps)
    assert pinned(rig, ks) == [[False] * len(ks)] * len(rig.tiers)


# --- the store controller ------------------------------------------------------------------------------


def test_a_full_queue_drops_new_objects_and_counts_them(make_rig):
    rig = make_rig()
    store = store_controller(rig, queue_limit=3)
    rig.commit(keys(2))
    assert rig.wakes == 1
    rig.commit(keys(4, b"q"))  # room for one of four
    assert store.snapshot() == StoreStats(queued=3, dropped=3)
    assert rig.wakes == 2
    rig.commit(keys(1, b"r"))  # no room at all: dropped, and nobody is woken for nothing
    assert store.snapshot() == StoreStats(queued=3, dropped=4)
    assert rig.wakes == 2
    assert rig.table.stats().awaiting_l2 == 3  # the dropped ones are not held: they will never be pushed

    store.step([])
    assert store.snapshot() == StoreStats(queued=0, in_flight=1, submitted=3, dropped=4)
    assert rig.table.stats().read_locked == 3  # the store reads L1 under a lease until the tier is done
    store.step(rig.take(0, 1))
    assert store.snapshot() == StoreStats(queued=0, in_flight=0, submitted=3, stored=3, dropped=4)
    assert rig.table.stats().leases == 0
    assert rig.holds(0, [*keys(2), *keys(4, b"q"), key(0, b"r")]) == [True, True, True, False, False, False, False]
    assert rig.tiers[0].usage().objects == 3


def test_batches_and_in_flight_are_bounded(make_rig):
    rig = make_rig()
    store = store_controller(rig, batch_size=2, max_in_flight=1)
    rig.commit(keys(5))
    store.step([])
    assert store.snapshot() == StoreStats(queued=3, in_flight=1, submitted=2)
    store.step([])  # the one in-flight slot is taken: nothing more goes
    assert store.snapshot() == StoreStats(queued=3, in_flight=1, submitted=2)
    wakes = rig.wakes
    store.step(rig.take(0, 1))  # the batch is done: its slot goes to the next two
    assert store.snapshot() == StoreStats(queued=1, in_flight=1, submitted=4, stored=2)
    assert rig.wakes == wakes + 1
    store.step(rig.take(0, 1))
    store.step(rig.take(0, 1))
    assert store.snapshot() == StoreStats(queued=0, in_flight=0, submitted=5, stored=5)
    assert rig.holds(0, keys(5)) == [True] * 5


def test_objects_gone_from_l1_before_their_push_are_skipped(make_rig):
    rig = make_rig()
    store = store_controller(rig)
    rig.commit(keys(3))
    assert rig.table.clear() == 3
    store.step([])
    assert store.snapshot() == StoreStats(skipped_gone=3)
    assert rig.tiers[0].usage().objects == 0


def test_objects_awaiting_their_push_are_evicted_last_and_counted(make_rig):
    rig = make_rig()
    store = store_controller(rig, batch_size=SLOTS)
    rig.commit(keys(4, b"old"), owner=PREFETCH_OWNER)  # oldest in LRU, but L2 has them: not held
    rig.commit(keys(SLOTS - 4))  # queued for the push: held
    assert rig.table.stats().awaiting_l2 == SLOTS - 4
    r = rig.table.reserve_write(keys(4, b"new"), SIZE, A)
    assert r.statuses == [SlotStatus.ALLOCATED] * 4
    assert rig.table.lookup(keys(SLOTS - 4)) == SLOTS - 4  # every held object survived
    assert rig.table.lookup(keys(4, b"old")) == 0
    # Nothing else left: a held object goes after all (L2 a whole L1 behind), counted.
    more = rig.table.reserve_write([key(0, b"more")], SIZE, A)
    assert more.statuses == [SlotStatus.ALLOCATED]
    assert rig.table.stats().evicted_awaiting_l2 == 1
    assert rig.table.stats().awaiting_l2 == SLOTS - 5
    [lost] = [k for k in keys(SLOTS - 4) if rig.table.get(k) is None]
    assert lost == key(SLOTS - 5)  # the prompt's tail first, as always
    rig.table.abort_write(r.lease_id, A)
    rig.table.abort_write(more.lease_id, A)
    store.step([])  # the push takes the rest (the hold ends: the read lock protects them)
    assert rig.table.stats().awaiting_l2 == 0
    store.step(rig.take(0, 1))
    assert store.snapshot() == StoreStats(submitted=SLOTS - 5, stored=SLOTS - 5, skipped_gone=1)
    assert rig.holds(0, keys(SLOTS - 4)) == [True] * (SLOTS - 5) + [False]
    rig.table.check_invariants()


def test_eviction_ahead_of_need_never_takes_an_object_awaiting_its_push(make_rig):
    rig = make_rig()
    store_controller(rig)
    rig.commit(keys(4, b"old"), owner=PREFETCH_OWNER)
    rig.commit(keys(SLOTS - 4))
    assert rig.table.evict_to(0) == 4  # the watermark controller: only what L2 already has goes
    assert rig.table.stats().evicted_awaiting_l2 == 0
    assert rig.table.lookup(keys(SLOTS - 4)) == SLOTS - 4


def test_what_is_cleared_while_held_is_counted_gone_and_unheld(make_rig):
    rig = make_rig()
    store = store_controller(rig)
    rig.commit(keys(3))
    rig.commit(keys(2, b"pf"), owner=PREFETCH_OWNER)  # what L2 itself gave back is never pushed, never held
    assert rig.table.stats().awaiting_l2 == 3
    assert rig.table.clear() == 5
    assert rig.table.stats().awaiting_l2 == 0
    rig.table.check_invariants()
    store.step([])
    assert store.snapshot() == StoreStats(skipped_gone=3)


def test_write_through_keeps_objects_in_l1(make_rig):
    rig = make_rig(1 << 24, 1 << 24)
    store = store_controller(rig)
    rig.commit(keys(2))
    store.step([])
    store.step(rig.take(0, 1) + rig.take(1, 1))
    assert store.snapshot() == StoreStats(submitted=2, stored=4)  # per tier
    assert rig.table.lookup(keys(2)) == 2


def test_skip_l1_drops_an_object_from_l1_once_every_tier_has_it(make_rig):
    rig = make_rig(1 << 24, 1 << 24)
    store = store_controller(rig, placement=Placement.SKIP_L1)
    rig.commit(keys(2))
    rig.events.clear()
    store.step([])
    store.step(rig.take(0, 1))  # one tier of two: still in L1
    assert rig.table.lookup(keys(2)) == 2
    assert rig.events == []
    store.step(rig.take(1, 1))
    assert rig.table.lookup(keys(2)) == 0
    assert [(e.kind, e.key, e.because) for e in rig.events] == [
        (EventKind.REMOVED, key(0), RemovedBecause.DISCARDED),
        (EventKind.REMOVED, key(1), RemovedBecause.DISCARDED),
    ]
    s = rig.table.stats()
    assert (s.objects, s.used_bytes, s.leases) == (0, 0, 0)
    assert rig.holds(0, keys(2)) == rig.holds(1, keys(2)) == [True, True]


def test_skip_l1_keeps_an_object_a_tier_refused(make_rig):
    rig = make_rig(1 << 24, SIZE // 2)  # the second tier is smaller than one object: it refuses each
    store = store_controller(rig, placement=Placement.SKIP_L1)
    rig.commit(keys(2))
    store.step([])
    store.step(rig.take(0, 1) + rig.take(1, 1))
    assert store.snapshot() == StoreStats(submitted=2, stored=2, failed=2)
    assert rig.table.lookup(keys(2)) == 2  # the only copy that every tier does not have stays
    assert rig.tiers[1].usage().healthy  # a refused object is not a tier failure


# --- the prefetch controller ---------------------------------------------------------------------------


def test_a_prefetch_loads_what_the_tier_holds_and_publishes_it(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    assert rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))]) == [True] * 3
    assert prefetch(rig, pf, keys(4)) == 3
    assert rig.table.lookup(keys(4)) == 3
    assert rig.l1_bytes(keys(3)) == [content(i).tobytes() for i in range(3)]
    assert [(e.kind, e.key, e.writer) for e in rig.events] == [(EventKind.STORED, k, PREFETCH_OWNER) for k in keys(3)]
    assert pf.snapshot() == PrefetchStats(jobs=1, running=0, lookups_hit=1, chunks_loaded=3, chunks_failed=0)
    assert rig.tiers[0].usage().loaded == 3
    assert rig.table.stats().leases == 0
    unpinned(rig, [pf.step], keys(4))


def test_what_the_prefetcher_loaded_is_not_pushed_back(make_rig):
    rig = make_rig()
    store = store_controller(rig)
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(2))])
    assert prefetch(rig, pf, keys(2), steps=[store.step, pf.step]) == 2
    assert store.snapshot() == StoreStats()
    rig.commit(keys(1, b"new"))  # a client's store still is
    assert store.snapshot() == StoreStats(queued=1)


def test_a_prefetch_takes_a_prefix_from_one_tier_and_the_rest_from_the_next(make_rig):
    rig = make_rig(1 << 24, 1 << 24)
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(2))])
    rig.put(1, [(k, content(i)) for i, k in enumerate(keys(4))])
    outcome = prefetch_outcome(rig, pf, keys(4))
    assert outcome == Prefetched(4, {rig.tiers[0].name: 2, rig.tiers[1].name: 2})  # who supplied what
    assert rig.l1_bytes(keys(4)) == [content(i).tobytes() for i in range(4)]
    assert (rig.tiers[0].usage().loaded, rig.tiers[1].usage().loaded) == (2, 2)  # the second only for the rest
    assert pf.snapshot() == PrefetchStats(jobs=1, running=0, lookups_hit=2, chunks_loaded=4, chunks_failed=0)
    unpinned(rig, [pf.step], keys(4))


def test_a_tier_that_holds_none_of_it_passes_the_job_on(make_rig):
    rig = make_rig(1 << 24, 1 << 24)
    pf = prefetch_controller(rig)
    rig.put(1, [(k, content(i)) for i, k in enumerate(keys(3))])
    assert prefetch(rig, pf, keys(3), start=1) == 2  # chunks 1 and 2
    assert rig.table.get(key(0)) is None
    assert rig.table.lookup(keys(3)[1:]) == 2
    assert (rig.tiers[0].usage().loaded, rig.tiers[1].usage().loaded) == (0, 2)


def test_chunks_already_in_l1_are_not_loaded_again(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))])
    rig.commit([key(1)], first_fill=1)
    assert prefetch(rig, pf, keys(3)) == 3
    assert rig.tiers[0].usage().loaded == 2
    assert pf.snapshot().chunks_loaded == 2
    assert rig.l1_bytes(keys(3)) == [content(i).tobytes() for i in range(3)]


def test_a_chunk_that_fails_to_load_ends_the_prefix_there(make_rig):
    rig = make_rig(1 << 24, 1 << 24)
    pf = prefetch_controller(rig)
    # Tier 0 holds chunk 1 at the wrong size (it cannot be loaded into a slot); tier 1 holds it whole.
    rig.put(0, [(key(0), content(0)), (key(1), content(1, SIZE // 2)), (key(2), content(2)), (key(3), content(3))])
    rig.put(1, [(k, content(i)) for i, k in enumerate(keys(4))])
    assert prefetch(rig, pf, keys(4)) == 1
    assert rig.table.lookup(keys(4)) == 1
    assert rig.table.get(key(1)) is None  # what did not load is never published
    assert pf.snapshot() == PrefetchStats(jobs=1, running=0, lookups_hit=1, chunks_loaded=3, chunks_failed=1)
    u0, u1 = rig.tiers[0].usage(), rig.tiers[1].usage()
    assert (u0.loaded, u0.corrupt, u0.objects) == (3, 0, 4)  # a size mismatch is not corruption
    assert u1.loaded == 0  # the prefix ended: the next tier was not asked
    unpinned(rig, [pf.step], keys(4))


def test_a_corrupt_object_is_a_miss_and_is_counted(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))])
    rig.tiers[0].corrupt_for_test(key(1), PAYLOAD_AT + 5)
    assert prefetch(rig, pf, keys(3)) == 1
    assert rig.table.get(key(1)) is None
    assert rig.l1_bytes([key(0)]) == [content(0).tobytes()]
    assert pf.snapshot() == PrefetchStats(jobs=1, running=0, lookups_hit=1, chunks_loaded=2, chunks_failed=1)
    u = rig.tiers[0].usage()
    assert (u.corrupt, u.loaded, u.objects, u.healthy) == (1, 2, 2, True)  # deleted from the tier
    assert prefetch(rig, pf, keys(3), start=1) == 0  # now a plain miss
    assert rig.tiers[0].usage().corrupt == 1


def test_a_prefetch_leaves_the_head_it_extends_most_recent_so_eviction_takes_the_tail_first(make_rig):
    """The head (chunks 0-1) was in L1 before the prefetch loaded the tail (2-5). Published alone, the
    tail was more recent than the head, and the next eviction (the watermark controller's, which a
    prefetch that fills L1 brings on) took the head first: a lock-free lookup had counted six chunks,
    and L1 then held a tail that is never a hit. The whole prefix is told as one run: the tail goes first."""
    rig = make_rig()
    pf = prefetch_controller(rig)
    ks = keys(6)
    rig.commit(ks[:2])
    assert rig.table.lookup(ks) == 2  # the LOOKUP that starts the prefetch touches the head
    rig.put(0, [(k, content(i)) for i, k in enumerate(ks)])
    assert prefetch(rig, pf, ks, start=2) == 4
    assert rig.table.evict_to(rig.table.used_bytes() - 2 * SIZE) == 2
    assert [rig.table.get(k) is not None for k in ks] == [True] * 4 + [False] * 2
    assert rig.table.lookup(ks) == 4
    unpinned(rig, [pf.step], ks)


def test_a_prefetch_with_no_room_in_l1_loads_nothing(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(2))])
    rig.commit(keys(SLOTS, b"full"))
    lock = rig.table.acquire_read(keys(SLOTS, b"full"), A)  # nothing can be evicted
    assert lock.lease_id != NO_LEASE and len(lock.offsets) == SLOTS
    assert prefetch(rig, pf, keys(2)) == 0
    assert (rig.table.get(key(0)), rig.table.get(key(1))) == (None, None)
    assert rig.tiers[0].usage().loaded == 0
    assert pf.snapshot() == PrefetchStats(jobs=1, running=0, lookups_hit=0, chunks_loaded=0, chunks_failed=0)
    assert rig.table.release_read(lock.lease_id, A) == SLOTS
    unpinned(rig, [pf.step], keys(2))
    assert rig.table.stats().leases == 0  # the prefetcher's reservation did not outlive it


# --- the tiers' pins -----------------------------------------------------------------------------------


def test_every_chunk_a_tier_pinned_is_unpinned_when_l1_takes_only_part_of_it(make_rig):
    """The tier pins every chunk its lookup found; L1 can take only the first two (chunk 2 is being
    written by a client: BUSY). The load covers two chunks, but all four pins must be dropped, or the
    tier can never evict chunks 2 and 3 again."""
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(4))])
    writing = rig.table.reserve_write([key(2)], SIZE, A)
    assert writing.statuses == [SlotStatus.ALLOCATED]
    assert prefetch(rig, pf, keys(4)) == 2
    assert rig.tiers[0].usage().loaded == 2
    settle(rig, [pf.step])
    assert pinned(rig, keys(4)) == [[False, False, False, False]]


def test_every_chunk_a_tier_pinned_is_unpinned_when_l1_has_room_for_part_of_it(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))])
    rig.commit(keys(SLOTS - 1, b"full"))
    lock = rig.table.acquire_read(keys(SLOTS - 1, b"full"), A)  # room for one chunk, and nothing to evict
    assert prefetch(rig, pf, keys(3)) == 1
    settle(rig, [pf.step])
    assert pinned(rig, keys(3)) == [[False, False, False]]
    rig.table.release_read(lock.lease_id, A)


def test_a_load_that_outlives_its_lease_ends_its_prefetch_with_nothing_kept(make_rig):
    """A backend that hangs past BACKGROUND_LEASE_TTL_S: the L1 lease ended meanwhile, and publishing
    raised LeaseExpired on the driver thread. The job was lost: its lookup never got an answer, the
    tier's pins stayed for good and ``running`` never came down."""
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))])

    def late(results):
        if any(r.kind is TaskKind.LOAD for _, r in results):
            rig.table.expire(now=time.monotonic() + 100_000)  # the load came back after its lease's TTL
        pf.step(results)

    assert prefetch(rig, pf, keys(3), steps=[late]) == 0
    assert rig.table.lookup(keys(3)) == 0  # nothing of a load past its lease is published
    s = pf.snapshot()
    assert (s.running, s.chunks_loaded, s.chunks_failed) == (0, 0, 3)
    assert rig.table.stats().used_bytes == 0 and rig.table.stats().quarantined_leases == 0
    unpinned(rig, [pf.step], keys(3))


def test_a_step_that_fails_for_one_prefetch_ends_that_one_and_serves_the_others(make_rig):
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(2))])
    real = rig.tiers[0].submit_lookup_and_lock
    calls = []

    def lookup_once_broken(ks, hints=None):
        calls.append(ks)
        if len(calls) == 1:
            raise RuntimeError("the tier's pool is gone")
        return real(ks, hints)

    rig.tiers[0].submit_lookup_and_lock = lookup_once_broken
    told: list[Prefetched] = []
    pf.submit(PrefetchJob(keys(2, b"x"), 0, SIZE, "", told.append))  # asked first: its lookup raises
    pf.submit(PrefetchJob(keys(2), 0, SIZE, "", told.append))
    rig.run([pf.step], lambda: len(told) == 2)
    assert sorted(t.chunks for t in told) == [0, 2]
    assert pf.snapshot().running == 0
    assert rig.table.lookup(keys(2)) == 2


class _TierThatRecordsStores:
    name, kind = "recording", "memory"

    def __init__(self) -> None:
        self.stores: list[list[ObjectKey]] = []

    def submit_store(self, items):
        self.stores.append([k for k, _ in items])
        return len(self.stores)


def test_skip_l1_never_discards_a_newer_object_still_awaiting_its_own_push(tmp_path):
    """skip_l1 drops a pushed batch from L1 by key. When the pushed object went meanwhile (a DELETE
    doomed it under the push's read lock) and the key was stored again before the drop, the drop took
    the new object, which no tier had yet: after a DELETE and a fresh store, the key was nowhere."""
    from kvdepot.storage.l1 import Toucher

    k = ObjectKey(b"k" * 48)
    a, b = ClientId(b"a"), ClientId(b"b")
    arena = SharedArena.create(HEADER_BYTES + SLOTS * SIZE, shm_dir=str(tmp_path))
    try:
        table = ObjectTable(ExtentAllocator((SLOTS - 1) * SIZE, SIZE, base=HEADER_BYTES), LRUPolicy())
        tier = _TierThatRecordsStores()
        ctl = StoreController(table, arena, [tier], lambda: None, placement=Placement.SKIP_L1)
        table.hold_for_l2(ctl.holds)
        table.subscribe(ctl.on_events)

        def store(owner):
            r = table.reserve_write([k], SIZE, owner, toucher=Toucher.CLIENT)
            assert r.lease_id
            table.commit_write(r.lease_id, owner)

        store(a)  # generation 1, queued
        ctl.step([])  # pushed: read-locked by the store controller
        assert tier.stores == [[k]]
        assert table.remove([k]) == (0, 1)  # an operator's DELETE: doomed under the push's read lock
        real_release = table.release_read

        def release_then_store_again(*args, **kwargs):  # another client's STORE lands right after
            n = real_release(*args, **kwargs)
            assert table.get(k) is None  # generation 1 went with the push's lock
            store(b)  # generation 2: READY, held for its own push
            return n

        table.release_read = release_then_store_again
        ctl.step([(0, TaskResult(1, TaskKind.STORE, [True]))])  # generation 1's push is done
        table.release_read = real_release
        obj = table.get(k)
        assert obj is not None and obj.generation == 2, "generation 2 was dropped before any tier had it"
        ctl.step([])
        assert tier.stores == [[k], [k]]  # generation 2's own push took it
        table.check_invariants()
    finally:
        arena.close()


# --- a tier whose submit raises (an allocation that fails: MemoryError) ----------------------------------


def _raises_once(real, exc: BaseException):
    calls = []

    def submit(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise exc
        return real(*args, **kwargs)

    return submit


def as_the_driver(step, results) -> None:
    """Step a controller as TierDriver does: an exception is logged there, and the driver goes on."""
    try:
        step(results)
    except Exception:
        pass


def test_a_store_batch_a_tier_could_not_take_ends_failed_and_frees_its_slot_and_lease(make_rig):
    """A tier's submit_store that raised (MemoryError copying the batch, an adapter of another package)
    left the batch in flight for good: nothing would ever complete it. Its in-flight slot never came
    back (max_in_flight such failures and no store reached L2 again) and its read lease held the objects
    in L1 for BACKGROUND_LEASE_TTL_S."""
    rig = make_rig(1 << 24, 1 << 24)
    store = store_controller(rig, max_in_flight=1)
    rig.tiers[1].submit_store = _raises_once(rig.tiers[1].submit_store, MemoryError())
    rig.commit(keys(2))
    as_the_driver(store.step, [])  # tier 0 takes the batch; tier 1's submit raises
    store.step(rig.take(0, 1))
    assert store.snapshot() == StoreStats(submitted=2, stored=2, failed=2)
    assert rig.table.stats().leases == 0
    rig.commit(keys(3, b"q"))  # the slot is free: the next batch goes to both tiers
    store.step([])
    store.step(rig.take(0, 1) + rig.take(1, 1))
    assert store.snapshot() == StoreStats(submitted=5, stored=8, failed=2)
    assert rig.holds(1, keys(3, b"q")) == [True] * 3


def test_a_load_a_tier_could_not_take_frees_the_slots_and_pins_it_took(make_rig):
    """A tier's submit_load that raised, after L1 slots were reserved for the load and the tier had
    pinned what its lookup found: the job ended, but the slots stayed reserved for
    BACKGROUND_LEASE_TTL_S and the tier's pins for good (those objects could never be evicted from it)."""
    rig = make_rig()
    pf = prefetch_controller(rig)
    rig.put(0, [(k, content(i)) for i, k in enumerate(keys(3))])
    rig.tiers[0].submit_load = _raises_once(rig.tiers[0].submit_load, MemoryError())
    assert prefetch(rig, pf, keys(3)) == 0  # its lookup is answered: nothing loaded
    assert pf.snapshot().running == 0
    assert rig.table.stats().leases == 0 and rig.table.stats().used_bytes == 0
    unpinned(rig, [pf.step], keys(3))
    assert prefetch(rig, pf, keys(3)) == 3  # the next lookup's prefetch loads them
