"""StorageManager as the server's handlers see it: a real arena (1 MiB, in ``tmp_path``), a real object
table, the real eviction controller and, where a test says so, a real in-memory L2 tier; no server.

Objects are ``SIZE`` bytes, so L1 holds exactly ``SLOTS`` of them. Tests that must not see background
eviction set both watermarks to 1.0 (usage can never exceed capacity, so the controller never evicts by
watermark); everything background-driven (the eviction controller, the tier driver) is waited for by
polling the manager's own snapshot against the manager's own bound on a tier's answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from kvdepot.config import EvictionPolicyName, StorageConfig
from kvdepot.errors import UnknownLease
from kvdepot.events import EventKind, ObjectEvent, RemovedBecause
from kvdepot.shm import HEADER_BYTES
from kvdepot.storage.allocator import SLOT_PAGE_OFFSET
from kvdepot.storage.l1 import Toucher
from kvdepot.storage.manager import (
    LEASE_ID_SPREAD,
    TIER_CLEAR_WAIT_S,
    ClearResult,
    L1Stats,
    L2Usage,
    PrefaultStatus,
    Prefetched,
    PrefetchStats,
    StorageManager,
    StorageSnapshot,
    StoreStats,
)
from kvdepot.types import NO_LEASE, ClearScope, ClientId, ObjectKey, SlotStatus

L1_GB = 1 / 1024  # 1 MiB
SIZE = 64 << 10
SLOTS = 16
TIER = "memory:size_gb=0.01"
TIER_NAME = "memory0"  # a tier's default name: its type and its index
FIRST = HEADER_BYTES + SLOT_PAGE_OFFSET  # the first slot's offset in the arena
ENVELOPE = 32 + 48  # an L2 object's header and key, before its payload (see storage/l2/envelope.py)
A, B = ClientId(b"client-a"), ClientId(b"client-b")
WAIT_S = TIER_CLEAR_WAIT_S  # the longest the manager itself waits on a tier's answer
AL, EX, BU, NS, OQ = SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY, SlotStatus.NO_SPACE, SlotStatus.OVER_QUOTA


def key(prompt: str, i: int) -> ObjectKey:
    return ObjectKey(prompt.encode().ljust(16, b".") + i.to_bytes(32, "big"))


def keys(prompt: str, n: int, first: int = 0) -> list[ObjectKey]:
    return [key(prompt, i) for i in range(first, first + n)]


def wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S:g} s")
        time.sleep(0.001)  # yield to the background thread; the assertion is the predicate, not the pause


@pytest.fixture
def make_manager(tmp_path) -> Iterator[Callable[..., StorageManager]]:
    built: list[StorageManager] = []

    def make(*tiers: str, **options) -> StorageManager:
        options.setdefault("high_watermark", 1.0)
        options.setdefault("low_watermark", 1.0)
        config = StorageConfig(l1_size_gb=L1_GB, shm_dir=str(tmp_path), prefault=False, l2=tiers, **options)
        m = StorageManager(config)
        m.start()
        built.append(m)
        return m

    yield make
    for m in built:
        m.close()


def store(m: StorageManager, ks: list[ObjectKey], owner: ClientId = A, salt: str = "", fill: int | None = None) -> list[SlotStatus]:
    """Reserve and commit ``ks`` as one batch (one prompt); ``fill``: write each object's bytes first
    (object i gets ``fill + i`` in every byte)."""
    r = m.reserve(ks, SIZE, owner, salt, toucher=Toucher.CLIENT)
    if fill is not None:
        for i, off in enumerate(r.offsets):
            if off >= 0:
                m.copy_into(off, [np.full(SIZE, (fill + i) % 256, np.uint8)])
    m.commit(r.lease_id, owner)
    return r.statuses


def store_one_by_one(m: StorageManager, ks: list[ObjectKey]) -> None:
    for k in ks:
        assert store(m, [k]) == [AL]


def l1(m: StorageManager) -> L1Stats:
    return m.snapshot().l1


def tier_settled(m: StorageManager, stored: int) -> Callable[[], bool]:
    """The store controller pushed ``stored`` objects and let go of every read lock it took."""

    def done() -> bool:
        s = m.snapshot()
        return s.store.stored == stored and s.store.in_flight == 0 and s.l1.leases == 0

    return done


# --- writes and reads ---------------------------------------------------------------------------------


def test_a_reservation_is_invisible_until_committed(make_manager):
    m = make_manager()
    ks = keys("p", 3)
    r = m.reserve(ks, SIZE, A, toucher=Toucher.CLIENT)
    assert r.statuses == [AL, AL, AL]
    assert r.offsets == [FIRST, FIRST + SIZE, FIRST + 2 * SIZE]
    assert m.lookup(ks) == 0
    s = l1(m)
    assert (s.objects, s.writing, s.ready, s.leases, s.used_bytes) == (3, 3, 0, 1, 3 * SIZE)

    assert m.commit(r.lease_id, A) == 3
    assert m.lookup(ks) == 3
    s = l1(m)
    assert (s.objects, s.writing, s.ready, s.leases, s.used_bytes) == (3, 0, 3, 0, 3 * SIZE)
    with pytest.raises(UnknownLease):
        m.commit(r.lease_id, A)  # a lease is finished once


def test_every_slot_starts_half_a_page_in_and_l1_holds_its_whole_size(make_manager):
    """A slot at a page boundary and a numpy array (16 bytes past one) make memcpy run ~3 x slower on
    AMD Zen (4 KiB aliasing under ``rep movsb``): slots sit half a page in, every one of them, and the
    arena has room for all of L1 after that shift."""
    m = make_manager()
    r = m.reserve(keys("p", SLOTS), SIZE, A, toucher=Toucher.CLIENT)
    assert r.statuses == [AL] * SLOTS
    assert {off % 4096 for off in r.offsets} == {SLOT_PAGE_OFFSET}
    arena = m.arena_bytes()
    assert max(r.offsets) + SIZE <= len(arena)
    arena[max(r.offsets) : max(r.offsets) + SIZE] = 7  # the last slot is writable to its end


def test_each_server_starts_its_lease_ids_somewhere_else(make_manager):
    """A restarted server that numbered leases from 1 again would take a finish meant for the old one's
    lease (a release sent behind, a late commit, from the same client) as the finish of a new lease of
    that client, and drop pins another of its threads still reads under."""
    firsts = []
    for i in range(4):
        m = make_manager()
        r = m.reserve(keys(f"p{i}", 1), SIZE, A, toucher=Toucher.CLIENT)
        firsts.append(int(r.lease_id))
        assert 1 <= r.lease_id <= LEASE_ID_SPREAD
        second = m.reserve(keys(f"q{i}", 1), SIZE, A, toucher=Toucher.CLIENT).lease_id
        assert second == r.lease_id + 1  # then counted, as before
    assert len(set(firsts)) == len(firsts), firsts


def test_an_abort_frees_only_what_the_lease_reserved(make_manager):
    m = make_manager()
    head = keys("p", 2)
    assert store(m, head) == [AL, AL]
    r = m.reserve(keys("p", 4), SIZE, A, toucher=Toucher.CLIENT)
    assert r.statuses == [EX, EX, AL, AL]
    assert r.offsets[:2] == [-1, -1]
    busy = m.reserve(keys("p", 4), SIZE, B, toucher=Toucher.CLIENT)
    assert busy.statuses == [EX, EX, BU, BU] and busy.lease_id == NO_LEASE
    with pytest.raises(UnknownLease):
        m.abort(r.lease_id, B)  # another client's lease: refused, nothing changed
    assert l1(m).writing == 2

    assert m.abort(r.lease_id, A) == 2
    assert m.lookup(keys("p", 4)) == 2
    s = l1(m)
    assert (s.objects, s.writing, s.used_bytes, s.leases) == (2, 0, 2 * SIZE, 0)
    again = m.reserve(keys("p", 2, first=2), SIZE, B, toucher=Toucher.CLIENT)
    assert again.statuses == [AL, AL]  # the aborted keys are free for another writer
    assert sorted(again.offsets) == sorted(r.offsets[2:])  # in the space the abort gave back


def test_copy_into_lands_in_the_slot_and_payload_reads_it_back(make_manager):
    m = make_manager()
    r = m.reserve(keys("p", 1), SIZE, A, toucher=Toucher.SERVER)
    first, second = np.arange(SIZE // 2, dtype=np.uint8), np.full(SIZE // 2, 7, np.uint8)
    m.copy_into(r.offsets[0], [first, second.tobytes()])  # frames, in order
    m.commit(r.lease_id, A)
    lock = m.lock_prefix(keys("p", 1), B, toucher=Toucher.SERVER)
    assert bytes(m.payload(lock.offsets[0], lock.size)) == first.tobytes() + second.tobytes()
    m.release(lock.lease_id, B)


def test_a_prefix_lock_covers_the_leading_run_and_pins_it_until_released(make_manager):
    m = make_manager()
    store_one_by_one(m, keys("p", 3))
    lock = m.lock_prefix([*keys("p", 2), key("p", 9), key("p", 2)], B, toucher=Toucher.CLIENT)
    assert lock.offsets == [FIRST, FIRST + SIZE]  # stops at the gap
    assert lock.size == SIZE and lock.lease_id != NO_LEASE
    assert (l1(m).read_locked, m.leases_of(B)) == (2, 1)
    assert m.lock_prefix([key("p", 9)], B, toucher=Toucher.CLIENT).lease_id == NO_LEASE

    # Fill L1, then ask for more: the locked (least recent) objects are not evicted, the next ones are.
    store_one_by_one(m, keys("q", SLOTS - 3))
    assert store(m, keys("r", 2)) == [AL, AL]
    assert m.lookup(keys("p", 2)) == 2
    assert m.lookup(keys("p", 3, first=2)) == 0  # p2 was the least recent unlocked object
    assert m.lookup(keys("q", 1)) == 0  # then q0
    assert m.lookup(keys("q", SLOTS - 4, first=1)) == SLOTS - 4

    assert m.release(lock.lease_id, B, 0, 1) == 1  # part of a lease
    assert m.release(lock.lease_id, B) == 1  # the rest; the lease ends with its last lock
    assert (l1(m).read_locked, m.leases_of(B)) == (0, 0)
    with pytest.raises(UnknownLease):
        m.release(lock.lease_id, B)


# --- capacity and eviction ----------------------------------------------------------------------------


def test_a_reservation_larger_than_l1_is_no_space_and_evicts_nothing(make_manager):
    m = make_manager()
    store_one_by_one(m, keys("p", 4))
    r = m.reserve(keys("big", 2), m.capacity + 4096, A, toucher=Toucher.CLIENT)
    assert (r.lease_id, r.offsets, r.statuses) == (NO_LEASE, [-1, -1], [NS, NS])
    s = l1(m)
    assert (s.objects, s.used_bytes, s.evicted_objects, s.leases) == (4, 4 * SIZE, 0, 0)
    assert m.lookup(keys("p", 4)) == 4


def test_a_full_l1_evicts_least_recent_first_and_a_prompt_loses_its_tail_first(make_manager):
    m = make_manager()
    events: list[ObjectEvent] = []
    m.subscribe(events.extend)
    half = SLOTS // 2
    assert store(m, keys("a", half)) == [AL] * half
    assert store(m, keys("b", half)) == [AL] * half
    assert l1(m).used_bytes == m.capacity
    events.clear()

    assert store(m, keys("c", 3)) == [AL, AL, AL]
    removed = [(e.key, e.because) for e in events if e.kind is EventKind.REMOVED]
    assert removed == [(key("a", 7), RemovedBecause.EVICTED), (key("a", 6), RemovedBecause.EVICTED), (key("a", 5), RemovedBecause.EVICTED)]
    assert m.lookup(keys("a", half)) == half - 3  # the head of prompt a is still a hit
    assert m.lookup(keys("b", half)) == half
    assert l1(m).evicted_objects == 3

    # A lookup makes a prompt recent (the lookups above did too): b is now the least recent prompt.
    m.lookup(keys("a", half - 3))
    m.lookup(keys("c", 3))
    events.clear()
    assert store(m, keys("d", 1)) == [AL]
    assert [(e.kind, e.key) for e in events] == [(EventKind.REMOVED, key("b", 7)), (EventKind.STORED, key("d", 0))]


def test_a_store_protects_the_prefix_it_extends(make_manager):
    m = make_manager()
    store_one_by_one(m, keys("p", SLOTS))  # p0 is the least recent
    r = m.reserve(keys("x", 1), SIZE, A, toucher=Toucher.CLIENT, protect=keys("p", 1))
    assert r.statuses == [AL]
    m.commit(r.lease_id, A)
    assert m.lookup(keys("p", 1)) == 1
    assert m.lookup(keys("p", 1, first=1)) == 0  # p1 went instead


def test_the_eviction_controller_brings_l1_down_to_the_low_watermark_when_a_store_passes_the_high(make_manager):
    m = make_manager(high_watermark=0.75, low_watermark=0.5)
    assert store(m, keys("a", 8)) == [AL] * 8  # 50%: under the high watermark
    assert l1(m).evicted_objects == 0
    assert store(m, keys("b", 5)) == [AL] * 5  # 81%: the reservation kicks the controller
    low = int(0.5 * m.capacity)
    wait_for("eviction to the low watermark", lambda: l1(m).used_bytes <= low)
    s = l1(m)
    assert (s.used_bytes, s.objects, s.evicted_objects) == (low, 8, 5)
    assert m.lookup(keys("a", 8)) == 3  # a lost its tail a7..a3, the least recent objects
    assert m.lookup(keys("b", 5)) == 5


# --- clear ---------------------------------------------------------------------------------------------


def test_clear_without_tiers_empties_l1_and_reports_no_tiers(make_manager):
    m = make_manager()
    store_one_by_one(m, keys("p", 3))
    assert m.clear(ClearScope.TIERS) == ClearResult(0, {})
    assert m.lookup(keys("p", 3)) == 3
    assert m.clear(ClearScope.L1) == ClearResult(3, {})
    assert m.lookup(keys("p", 3)) == 0
    s = l1(m)
    assert (s.objects, s.used_bytes) == (0, 0)
    assert m.clear(ClearScope.ALL) == ClearResult(0, {})


def test_a_locked_object_outlives_a_clear_until_its_last_lock_goes(make_manager):
    m = make_manager()
    events: list[ObjectEvent] = []
    m.subscribe(events.extend)
    store(m, keys("p", 3))
    lock = m.lock_prefix(keys("p", 1), B, toucher=Toucher.CLIENT)
    events.clear()
    assert m.clear() == ClearResult(2, {})  # the locked one is not counted: it is doomed
    assert m.lookup(keys("p", 1)) == 0  # invisible at once
    assert l1(m).objects == 1
    assert m.reserve(keys("p", 1), SIZE, A, toucher=Toucher.CLIENT).statuses == [BU]
    m.release(lock.lease_id, B)
    assert l1(m).objects == 0
    assert [(e.key, e.because) for e in events] == [
        (key("p", 1), RemovedBecause.CLEARED),
        (key("p", 2), RemovedBecause.CLEARED),
        (key("p", 0), RemovedBecause.CLEARED),
    ]


def test_clear_by_scope_counts_per_tier(make_manager):
    m = make_manager(TIER)
    store(m, keys("p", 3))
    wait_for("write-through", tier_settled(m, 3))
    assert m.snapshot().tiers[0].objects == 3

    assert m.clear(ClearScope.L1) == ClearResult(3, {})
    assert m.snapshot().tiers[0].objects == 3  # the tier keeps its copies
    assert m.clear(ClearScope.TIERS) == ClearResult(0, {TIER_NAME: 3})
    assert m.snapshot().tiers[0].objects == 0

    store(m, keys("q", 2))
    wait_for("write-through", tier_settled(m, 5))
    assert m.clear(ClearScope.ALL) == ClearResult(2, {TIER_NAME: 2})
    s = m.snapshot()
    assert (s.l1.objects, s.tiers[0].objects, s.tiers[0].used_bytes) == (0, 0, 0)


# --- quotas --------------------------------------------------------------------------------------------


def test_quotas_exist_only_under_isolated_lru(make_manager):
    assert make_manager().quotas() is None
    assert make_manager(eviction_policy="noop").quotas() is None
    assert make_manager(eviction_policy=EvictionPolicyName.ISOLATED_LRU).quotas() is not None


def test_a_quota_set_through_the_manager_is_enforced(make_manager):
    m = make_manager(eviction_policy=EvictionPolicyName.ISOLATED_LRU)
    q = m.quotas()
    events: list[ObjectEvent] = []
    m.subscribe(events.extend)
    store(m, keys("t", 4), salt="tenant")
    store(m, keys("o", 2), salt="other")
    assert (q.used("tenant"), q.used("other")) == (4 * SIZE, 2 * SIZE)
    assert (q.get("tenant"), q.all()) == (None, {})
    events.clear()

    q.set("tenant", 2 * SIZE)
    assert (q.get("tenant"), q.all()) == (2 * SIZE, {"tenant": 2 * SIZE})
    # The eviction controller's thread enforces it; its events reach subscribers after its pass.
    wait_for("the quota to be enforced", lambda: len(events) >= 2)
    assert q.used("tenant") == 2 * SIZE
    assert m.lookup(keys("t", 4)) == 2  # the tail went first
    assert m.lookup(keys("o", 2)) == 2  # other salts are untouched
    assert [(e.key, e.because) for e in events] == [
        (key("t", 3), RemovedBecause.OVER_QUOTA),
        (key("t", 2), RemovedBecause.OVER_QUOTA),
    ]

    r = m.reserve(keys("t", 1, first=10), 3 * SIZE, A, "tenant", toucher=Toucher.CLIENT)
    assert (r.statuses, r.lease_id) == ([OQ], NO_LEASE)  # never fits its quota: refused, not stored
    assert l1(m).quota_refused == 1
    q.set("tenant", None)
    assert (q.get("tenant"), q.all()) == (None, {})


def test_a_batch_its_quota_cuts_short_gives_back_the_slots_it_did_not_use(make_manager):
    """The batch's slots are carved in one run before the quota check of each key: what the quota
    refused goes back to the free space at once, not held until the lease ends."""
    m = make_manager(eviction_policy=EvictionPolicyName.ISOLATED_LRU)
    m.quotas().set("tenant", 2 * SIZE)
    r = m.reserve(keys("q", 4), SIZE, A, "tenant", toucher=Toucher.CLIENT)
    assert r.statuses == [AL, AL, OQ, OQ]
    assert r.offsets[1] == r.offsets[0] + SIZE
    s = m.snapshot().l1
    assert (s.used_bytes, s.writing, s.largest_free_bytes) == (2 * SIZE, 2, (SLOTS - 2) * SIZE)
    m.commit(r.lease_id, A)
    assert m.lookup(keys("q", 4)) == 2


# --- snapshot ------------------------------------------------------------------------------------------


def test_a_snapshot_without_tiers_is_typed_and_matches_what_was_done(make_manager, tmp_path):
    m = make_manager()
    store(m, keys("p", 3))
    lock = m.lock_prefix(keys("p", 2), B, toucher=Toucher.CLIENT)
    pending = m.reserve(keys("w", 1), SIZE, A, toucher=Toucher.CLIENT)
    s = m.snapshot()
    assert isinstance(s, StorageSnapshot)
    assert s.l1 == L1Stats(
        capacity_bytes=SLOTS * SIZE,
        used_bytes=4 * SIZE,
        objects=4,
        ready=3,
        writing=1,
        read_locked=2,
        leases=2,
        fragmentation=0.0,
        largest_free_bytes=(SLOTS - 4) * SIZE,
        evicted_objects=0,
        expired_leases=0,
    )
    assert s.prefault == PrefaultStatus("off", 0.0, False, False)
    assert (s.quarantine, s.tiers, s.store, s.prefetch) == ([], [], None, None)
    assert s.shm_path.startswith(str(tmp_path)) and s.eviction_policy is EvictionPolicyName.LRU
    assert m.tier_count == 0
    m.release(lock.lease_id, B)
    m.abort(pending.lease_id, A)


def test_a_snapshot_with_a_tier_counts_what_the_tier_did(make_manager):
    m = make_manager(TIER)
    store(m, keys("p", 3))
    wait_for("write-through", tier_settled(m, 3))
    s = m.snapshot()
    assert len(s.tiers) == 1 and isinstance(s.tiers[0], L2Usage)
    assert s.tiers[0] == L2Usage(
        name=TIER_NAME,
        kind="memory",
        healthy=True,
        used_bytes=3 * (ENVELOPE + SIZE),
        capacity_bytes=int(0.01 * (1 << 30)),
        objects=3,
        stored=3,
        loaded=0,
        corrupt=0,
        failures=0,
        last_error="",
    )
    assert s.store == StoreStats(queued=0, in_flight=0, submitted=3, stored=3, failed=0, dropped=0, skipped_gone=0)
    assert s.prefetch == PrefetchStats(jobs=0, running=0, lookups_hit=0, chunks_loaded=0, chunks_failed=0)
    assert m.tier_count == 1


# --- events --------------------------------------------------------------------------------------------


def test_subscribers_get_stored_then_removed_with_increasing_generations(make_manager):
    m = make_manager()
    events: list[ObjectEvent] = []
    m.subscribe(events.extend)
    ks = keys("p", 2)
    store(m, ks, owner=A, salt="s")
    m.clear()
    store(m, ks[:1], owner=B)  # the same key again: a new object, a newer generation
    assert [(e.kind, e.key, e.generation, e.writer, e.because) for e in events] == [
        (EventKind.STORED, ks[0], 1, A, None),
        (EventKind.STORED, ks[1], 2, A, None),
        (EventKind.REMOVED, ks[0], 1, None, RemovedBecause.CLEARED),
        (EventKind.REMOVED, ks[1], 2, None, RemovedBecause.CLEARED),
        (EventKind.STORED, ks[0], 3, B, None),
    ]
    assert [(e.size, e.salt) for e in events] == [(SIZE, "s")] * 4 + [(SIZE, "")]


def test_an_aborted_write_tells_subscribers_nothing(make_manager):
    m = make_manager()
    events: list[ObjectEvent] = []
    m.subscribe(events.extend)
    r = m.reserve(keys("p", 2), SIZE, A, toucher=Toucher.CLIENT)
    m.abort(r.lease_id, A)
    assert events == []


# --- L2: write-through and prefetch --------------------------------------------------------------------


def test_a_prefetch_while_a_delete_waits_on_its_tier_does_not_bring_the_deleted_back(make_manager):
    """DELETE empties L1, then waits for the tiers: a lookup's prefetch that ran in between loaded the
    tier's copy back into L1 before the tier deleted it, and the deleted KV stayed servable."""
    m = make_manager(TIER)
    ks = keys("p", 3)
    store(m, ks, fill=1)
    wait_for("write-through", tier_settled(m, 3))
    assert m.clear(ClearScope.L1) == ClearResult(3, {})
    tier = m._tiers[0]
    deleting, go = threading.Event(), threading.Event()
    delete_one = tier._delete

    def slow_delete(k):
        deleting.set()
        assert go.wait(WAIT_S)
        delete_one(k)

    tier._delete = slow_delete
    result: list = []
    deleter = threading.Thread(target=lambda: result.append(m.delete(ks)))
    deleter.start()
    assert deleting.wait(WAIT_S)
    loaded = threading.Event()
    assert m.prefetch(ks, 0, SIZE, "", lambda p: loaded.set()) is True  # a lookup between the two passes
    assert loaded.wait(WAIT_S)
    go.set()
    deleter.join(WAIT_S + 5)
    assert result and result[0].tiers_removed == {TIER_NAME: 3}
    assert m.lookup(ks) == 0 and l1(m).objects == 0


def test_a_prefetch_while_a_clear_waits_on_its_tier_does_not_bring_the_cleared_back(make_manager):
    """A clear of everything empties L1, then waits for the tiers: a lookup's prefetch that ran in
    between loaded the tier's copy back into L1 before the tier cleared it, and the cleared KV stayed
    servable after the clear had answered (a DELETE of a prefix takes a second L1 pass for this; a
    clear took none)."""
    m = make_manager(TIER)
    ks = keys("p", 3)
    store(m, ks, fill=1)
    wait_for("write-through", tier_settled(m, 3))
    assert m.clear(ClearScope.L1) == ClearResult(3, {})
    tier = m._tiers[0]
    clearing, go = threading.Event(), threading.Event()
    clear_all = tier._clear

    def slow_clear():
        clearing.set()
        assert go.wait(WAIT_S)
        return clear_all()

    tier._clear = slow_clear
    result: list = []
    clearer = threading.Thread(target=lambda: result.append(m.clear(ClearScope.ALL)))
    clearer.start()
    assert clearing.wait(WAIT_S)
    loaded = threading.Event()
    assert m.prefetch(ks, 0, SIZE, "", lambda p: loaded.set()) is True  # a lookup while the tier clears
    assert loaded.wait(WAIT_S)
    go.set()
    clearer.join(WAIT_S + 5)
    assert result and result[0].tiers_removed == {TIER_NAME: 3}
    assert m.lookup(ks) == 0, "the cleared KV is back in L1 after the clear answered"
    assert l1(m).objects == 0 and l1(m).leases == 0


def test_prefetch_without_tiers_says_so(make_manager):
    m = make_manager()
    called: list[int] = []
    assert m.prefetch(keys("p", 2), 0, SIZE, "", called.append) is False
    assert called == []


def test_write_through_then_prefetch_brings_the_same_bytes_back_into_l1(make_manager):
    m = make_manager(TIER)
    ks = keys("p", 4)
    store(m, ks, fill=10)
    wait_for("write-through", tier_settled(m, 4))
    assert m.clear(ClearScope.L1) == ClearResult(4, {})
    assert m.lookup(ks) == 0

    done = threading.Event()
    got: list[Prefetched] = []

    def on_done(p: Prefetched) -> None:
        got.append(p)
        done.set()

    # The first chunk is back in L1 already: the prefetch is asked for the rest only.
    store(m, ks[:1], fill=10)
    wait_for("write-through", tier_settled(m, 5))
    assert m.prefetch(ks, 1, SIZE, "", on_done) is True
    assert done.wait(WAIT_S)
    assert got == [Prefetched(3, {TIER_NAME: 3})]
    assert m.lookup(ks) == 4
    lock = m.lock_prefix(ks, B, toucher=Toucher.SERVER)
    assert [bytes(m.payload(off, SIZE)) for off in lock.offsets] == [bytes([10 + i]) * SIZE for i in range(4)]
    m.release(lock.lease_id, B)

    s = m.snapshot()
    assert s.prefetch == PrefetchStats(jobs=1, running=0, lookups_hit=1, chunks_loaded=3, chunks_failed=0)
    assert s.tiers[0].loaded == 3
    # What the prefetcher loaded is not pushed back (it would be queued by now: the table tells the
    # store controller before on_done runs): only the client's re-store of chunk 0 was.
    assert s.store == StoreStats(queued=0, in_flight=0, submitted=5, stored=5, failed=0, dropped=0, skipped_gone=0)


def test_a_prefetch_of_what_no_tier_holds_finds_nothing(make_manager):
    m = make_manager(TIER)
    done = threading.Event()
    got: list[Prefetched] = []
    m.prefetch(keys("nowhere", 3), 0, SIZE, "", lambda p: (got.append(p), done.set()))
    assert done.wait(WAIT_S)
    assert got == [Prefetched(0, {})]
    assert m.snapshot().prefetch == PrefetchStats(jobs=1, running=0, lookups_hit=0, chunks_loaded=0, chunks_failed=0)
    assert l1(m).objects == 0


@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_delete_that_comes_while_the_push_is_being_submitted_is_not_undone_by_it(make_manager, how):
    """The store controller read-locks a batch, then submits it to the tiers. A DELETE (or a clear of
    everything) that came in between doomed the locked L1 objects and submitted its tier delete first:
    the push, submitted after it, counted as a newer write and landed, so the deleted prefix was back
    in the tier (and a later lookup's prefetch served it again)."""
    m = make_manager(TIER)
    ks = keys("p", 3)
    tier = m._tiers[0]
    submitted, result = threading.Event(), []
    submit_delete, submit_clear = tier.submit_delete, tier.submit_clear

    def delete_then_tell(*args):
        task = (submit_delete if how == "delete" else submit_clear)(*args)
        submitted.set()
        return task

    tier.submit_delete = delete_then_tell
    tier.submit_clear = delete_then_tell
    release = m._table.release_l2_hold
    hooked = []

    def between_lock_and_submit(held):
        # On the driver thread, right after the push read-locked the batch: the operator's delete comes now.
        if not hooked:
            hooked.append(True)
            work = (lambda: m.delete(ks)) if how == "delete" else (lambda: m.clear(ClearScope.ALL))
            threading.Thread(target=lambda: result.append(work()), daemon=True).start()
            # Unfixed, the delete reaches the tiers at once; fixed, it waits for this submission to end.
            submitted.wait(2.0)
        release(held)

    m._table.release_l2_hold = between_lock_and_submit
    store(m, ks, fill=1)
    wait_for("the delete to end", lambda: bool(result))
    wait_for("the push to end", lambda: m.snapshot().store.in_flight == 0 and l1(m).leases == 0)
    assert m.lookup(ks) == 0 and l1(m).objects == 0
    assert tier.contains_now(ks) == [False, False, False], "the push landed after the delete: the prefix is back in the tier"
    done = threading.Event()
    m.prefetch(ks, 0, SIZE, "", lambda p: done.set())
    assert done.wait(WAIT_S)
    assert m.lookup(ks) == 0, "a lookup's prefetch served the deleted prefix again"


def test_an_adapter_of_another_package_without_health_is_asked_for_its_usage():
    """``health()`` joined the adapter contract for /healthcheck; an out-of-tree adapter (an entry point)
    written before it must not make every probe fail with AttributeError."""
    from types import SimpleNamespace

    from kvdepot.storage.manager import _tier_health

    old = SimpleNamespace(usage=lambda: SimpleNamespace(healthy=False, last_error="down since 10:02"))
    assert _tier_health(old) == (False, "down since 10:02")
    new = SimpleNamespace(health=lambda: (True, ""), usage=lambda: pytest.fail("a tier with health() was asked for its usage"))
    assert _tier_health(new) == (True, "")
