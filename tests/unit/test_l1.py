"""ObjectTable (L1 state machine + leases) and the eviction policies, with a fake clock.

Every test builds a real table over a small ExtentAllocator whose slots are ``SLOT`` bytes and asserts
exact statuses, offsets, lease outcomes and eviction order.
"""

from __future__ import annotations

import pytest

from kvdepot.errors import IllegalTransition, LeaseExpired, LeaseRevoked, UnknownLease
from kvdepot.types import SlotStatus
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.eviction import LRUPolicy, NoopPolicy, make_policy
from kvdepot.storage.l1 import NO_LEASE, EventKind, ObjectEvent, ObjectState, ObjectTable, RemovedBecause, Toucher
from kvdepot.types import ClientId, LeaseId, ObjectKey

SLOT = 64
TTL = 10.0
AL, EX, BU, NS = SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY, SlotStatus.NO_SPACE
A, B, C = ClientId(b"client-a"), ClientId(b"client-b"), ClientId(b"client-c")


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def k(i: int) -> ObjectKey:
    return ObjectKey(b"N" * 16 + i.to_bytes(32, "big"))


def ks(*ids: int) -> list[ObjectKey]:
    return [k(i) for i in ids]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def alive() -> set:
    """Owners whose process may still touch the arena (empty: a forced end frees at once)."""
    return set()


@pytest.fixture
def make_table(clock, alive):
    def make(slots: int = 4, policy: str = "lru") -> ObjectTable:
        return ObjectTable(
            ExtentAllocator(slots * SLOT, alignment=SLOT),
            make_policy(policy),
            lease_ttl_s=TTL,
            clock=clock,
            holder_alive=alive.__contains__,
        )

    return make


def store_one_by_one(table: ObjectTable, ids, owner=A) -> None:
    """Store each key in its own batch, so their LRU order is the order given."""
    for i in ids:
        store(table, [i], owner)


def store(table: ObjectTable, ids, owner=A) -> list[SlotStatus]:
    """Reserve and commit ``ids``; returns the statuses."""
    r = table.reserve_write(ks(*ids), SLOT, owner)
    table.commit_write(r.lease_id, owner)
    table.check_invariants()
    return r.statuses


def present(table: ObjectTable, ids) -> list[int]:
    return [i for i in ids if table.get(k(i)) is not None]


# --- reserve_write ------------------------------------------------------------------------------------


def test_reserve_write_allocates_packed_offsets_under_one_lease(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1, 2, 3), SLOT, A)
    assert r.lease_id == LeaseId(1)
    assert r.statuses == [AL, AL, AL]
    assert r.offsets == [0, SLOT, 2 * SLOT]
    assert t.leases_of(A) == 1
    obj = t.get(k(2))
    assert (obj.state, obj.offset, obj.size, obj.writer, obj.readers) == (ObjectState.WRITING, SLOT, SLOT, r.lease_id, 0)
    t.check_invariants()


def test_lease_ids_start_where_the_table_is_told_and_never_at_no_lease():
    t = ObjectTable(ExtentAllocator(4 * SLOT, alignment=SLOT), make_policy("lru"), first_lease_id=10**12)
    assert [t.reserve_write(ks(i), SLOT, A).lease_id for i in (1, 2)] == [10**12, 10**12 + 1]
    with pytest.raises(ValueError, match="NO_LEASE"):
        ObjectTable(ExtentAllocator(4 * SLOT, alignment=SLOT), make_policy("lru"), first_lease_id=0)


def test_reserve_write_statuses_allocated_exists_busy_no_space(make_table):
    t = make_table(4)
    assert store(t, [1]) == [AL]
    t.acquire_read(ks(1), C)  # pinned, so the NO_SPACE below cannot be cured by evicting it
    pending = t.reserve_write(ks(2), SLOT, B)  # k2 WRITING by B
    r = t.reserve_write(ks(1, 2, 3, 4, 5, 6), SLOT, A)
    assert r.statuses == [EX, BU, AL, AL, NS, NS]
    assert r.offsets == [-1, -1, 2 * SLOT, 3 * SLOT, -1, -1]
    assert t.get(k(2)).writer == pending.lease_id  # B's reservation untouched
    assert t.get(k(5)) is None and t.get(k(6)) is None
    t.check_invariants()


def test_after_the_first_no_space_every_later_key_is_no_space(make_table):
    # all space is read-locked, so nothing can be evicted; EXISTS/BUSY keys after the gap stay NO_SPACE
    t = make_table(2)
    store(t, [1, 2])
    t.acquire_read(ks(1, 2), B)
    r = t.reserve_write(ks(3, 1, 4), SLOT, A)
    assert r.statuses == [NS, EX, NS]  # an existing key still reports EXISTS
    assert r.lease_id == NO_LEASE
    assert t.leases_of(A) == 0
    t.check_invariants()


def test_size_that_does_not_fit_beside_locked_objects_is_no_space(make_table):
    t = make_table(3)
    store(t, [1])
    t.acquire_read(ks(1), B)
    r = t.reserve_write(ks(7, 8), 3 * SLOT, A)  # 2 slots free, 3 needed, and k1 is pinned
    assert (r.statuses, r.offsets, r.lease_id) == ([NS, NS], [-1, -1], NO_LEASE)
    assert present(t, [1]) == [1]


def test_duplicate_key_in_one_batch_is_busy_the_second_time(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1, 1), SLOT, A)
    assert r.statuses == [AL, BU]
    assert t.commit_write(r.lease_id, A) == 1
    t.check_invariants()


def test_batch_with_nothing_allocated_gets_no_lease(make_table):
    t = make_table(4)
    store(t, [1])
    r = t.reserve_write(ks(1), SLOT, A)
    assert (r.lease_id, r.statuses, r.offsets) == (NO_LEASE, [EX], [-1])
    assert t.leases_of(A) == 0
    assert t.commit_write(NO_LEASE, A) == 0
    assert t.abort_write(NO_LEASE, A) == 0


# --- commit / abort ---------------------------------------------------------------------------------


def test_writing_objects_are_invisible_until_commit(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1, 2), SLOT, A)
    assert t.lookup(ks(1, 2)) == 0
    lock = t.acquire_read(ks(1, 2), B)
    assert (lock.lease_id, lock.offsets) == (NO_LEASE, [])
    assert t.commit_write(r.lease_id, A) == 2
    assert t.lookup(ks(1, 2)) == 2
    assert t.get(k(1)).state is ObjectState.READY and t.get(k(1)).writer == NO_LEASE
    assert t.leases_of(A) == 0
    t.check_invariants()


def test_commit_twice_raises_unknown_lease(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1), SLOT, A)
    t.commit_write(r.lease_id, A)
    with pytest.raises(UnknownLease):
        t.commit_write(r.lease_id, A)


def test_abort_frees_the_space(make_table):
    t = make_table(2)
    r = t.reserve_write(ks(1, 2), SLOT, A)
    assert t.stats().used_bytes == 2 * SLOT
    assert t.abort_write(r.lease_id, A) == 2
    assert t.get(k(1)) is None and t.get(k(2)) is None
    s = t.stats()
    assert (s.used_bytes, s.objects, s.leases) == (0, 0, 0)
    assert t.reserve_write(ks(3, 4), SLOT, A).statuses == [AL, AL]
    t.check_invariants()


def test_commit_by_another_owner_raises_and_changes_nothing(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1, 2), SLOT, A)
    before = (t.stats(), t.get(k(1)), t.get(k(2)))
    with pytest.raises(UnknownLease):
        t.commit_write(r.lease_id, B)
    with pytest.raises(UnknownLease):
        t.abort_write(r.lease_id, B)
    assert (t.stats(), t.get(k(1)), t.get(k(2))) == before
    assert t.lookup(ks(1)) == 0
    assert t.commit_write(r.lease_id, A) == 2  # the real owner still can
    t.check_invariants()


def test_commit_of_unknown_lease_raises_unknown_lease(make_table):
    t = make_table(4)
    with pytest.raises(UnknownLease):
        t.commit_write(LeaseId(999), A)


def test_commit_of_a_read_lease_is_an_illegal_transition(make_table):
    t = make_table(4)
    store(t, [1])
    lock = t.acquire_read(ks(1), A)
    with pytest.raises(IllegalTransition):
        t.commit_write(lock.lease_id, A)
    store_lease = t.reserve_write(ks(2), SLOT, A).lease_id
    with pytest.raises(IllegalTransition):
        t.release_read(store_lease, A)
    assert t.get(k(1)).readers == 1  # nothing changed
    assert t.get(k(2)).writer == store_lease
    t.check_invariants()


def test_commit_of_an_expired_lease_raises_lease_expired(make_table, clock):
    t = make_table(4)
    r = t.reserve_write(ks(1), SLOT, A)
    clock.now += TTL
    assert t.expire() == 1
    with pytest.raises(LeaseExpired):
        t.commit_write(r.lease_id, A)
    with pytest.raises(LeaseExpired):
        t.abort_write(r.lease_id, A)
    assert t.get(k(1)) is None


def test_lease_is_not_expired_before_its_deadline(make_table, clock):
    t = make_table(4)
    r = t.reserve_write(ks(1), SLOT, A)
    clock.now += TTL - 0.001
    assert t.expire() == 0
    assert t.commit_write(r.lease_id, A) == 1


def test_subscribers_get_stored_and_removed_events_with_generations(make_table):
    t = make_table(4)
    batches: list[list[ObjectEvent]] = []
    t.subscribe(batches.append)
    store(t, [1])
    r = t.reserve_write(ks(1, 2, 3), SLOT, A)  # k1 EXISTS: only k2, k3 are committed by this lease
    t.commit_write(r.lease_id, A)
    stored = [[(e.kind, e.key, e.writer) for e in b] for b in batches]
    assert stored == [[(EventKind.STORED, k(1), A)], [(EventKind.STORED, k(2), A), (EventKind.STORED, k(3), A)]]
    gens = {e.key: e.generation for b in batches for e in b}
    assert len(set(gens.values())) == 3 and gens[k(1)] < gens[k(2)] < gens[k(3)]
    n = len(batches)
    t.abort_write(t.reserve_write(ks(9), SLOT, A).lease_id, A)
    assert len(batches) == n  # an abort tells no one: nothing was ever visible
    lock = t.acquire_read(ks(2), B)
    assert t.clear() == 2  # k1, k3; k2 is doomed until its reader lets go
    removed = [(e.key, e.generation, e.because) for e in batches[-1]]
    assert sorted(removed) == sorted([(k(1), gens[k(1)], RemovedBecause.CLEARED), (k(3), gens[k(3)], RemovedBecause.CLEARED)])
    t.release_read(lock.lease_id, B)
    assert [(e.kind, e.key, e.because) for e in batches[-1]] == [(EventKind.REMOVED, k(2), RemovedBecause.CLEARED)]
    store(t, [2])  # the same key again: a new object, a new generation
    assert batches[-1][0].key == k(2) and batches[-1][0].generation > gens[k(2)]


def test_an_object_deleted_while_read_is_removed_as_deleted_when_its_reader_lets_go(make_table):
    """DELETE /cache/prefix of a prefix an engine is reading dooms its objects; when the read ends they
    go as what they are, deleted: kvdepot_l1_removed_objects_total{reason} and /events/recent said
    "cleared", an L1 clear nobody made, and the deletes were never counted."""
    t = make_table(4)
    batches: list[list[ObjectEvent]] = []
    t.subscribe(batches.append)
    store(t, [1, 2])
    lock = t.acquire_read(ks(1, 2), B)
    assert t.remove(ks(1, 2)) == (0, 2)
    t.release_read(lock.lease_id, B)
    assert [(e.kind, e.key, e.because) for e in batches[-1]] == [
        (EventKind.REMOVED, k(1), RemovedBecause.DELETED), (EventKind.REMOVED, k(2), RemovedBecause.DELETED)
    ]
    t.check_invariants()


def test_a_failing_subscriber_does_not_stop_the_others(make_table):
    t = make_table(2)
    got = []
    t.subscribe(lambda events: 1 / 0)
    t.subscribe(got.extend)
    store(t, [1])
    assert [e.key for e in got] == [k(1)]


def test_finish_write_publishes_only_the_given_keys(make_table):
    t = make_table(4)
    r = t.reserve_write(ks(1, 2, 3), SLOT, A)
    assert t.finish_write(r.lease_id, A, {k(1), k(3)}) == 2
    assert t.get(k(2)) is None  # dropped: its space is free again
    assert t.lookup(ks(1)) == 1 and t.lookup(ks(3)) == 1
    t.check_invariants()


def test_acquire_read_each_locks_every_ready_key_not_only_a_prefix(make_table):
    t = make_table(4)
    store(t, [1, 3])
    lease, objs = t.acquire_read_each(ks(1, 2, 3), A)
    assert [key for key, _, _ in objs] == ks(1, 3)
    assert t.get(k(1)).readers == 1 and t.get(k(3)).readers == 1
    assert t.discard(ks(1, 3)) == 0  # locked objects are not discarded
    t.release_read(lease, A)
    assert t.discard(ks(1, 3)) == 2
    t.check_invariants()


# --- reads ------------------------------------------------------------------------------------------


def test_lookup_counts_the_leading_ready_run(make_table):
    t = make_table(4)
    store(t, [1, 2, 4])
    assert t.lookup(ks(1, 2, 3, 4)) == 2
    assert t.lookup(ks(3, 1)) == 0
    assert t.lookup([]) == 0
    assert t.stats().leases == 0  # lookup takes no lock


def test_acquire_read_locks_only_the_leading_ready_run(make_table):
    t = make_table(6)
    store(t, [1, 2, 4])
    t.reserve_write(ks(5), SLOT, B)
    lock = t.acquire_read(ks(1, 2, 3, 4, 5), A)
    assert lock.lease_id != NO_LEASE
    assert lock.offsets == [0, SLOT]
    assert lock.size == SLOT
    assert [t.get(k(i)).readers for i in (1, 2, 4)] == [1, 1, 0]
    assert t.read_lease_offsets(lock.lease_id, A) == [0, SLOT]
    assert t.read_lease_offsets(lock.lease_id, A, start=1) == [SLOT]
    lock2 = t.acquire_read(ks(2), B)
    assert t.get(k(2)).readers == 2
    assert t.stats().read_locked == 2
    t.release_read(lock2.lease_id, B)
    t.check_invariants()


def test_release_read_by_another_owner_raises_and_changes_nothing(make_table):
    t = make_table(4)
    store(t, [1])
    lock = t.acquire_read(ks(1), A)
    with pytest.raises(UnknownLease):
        t.release_read(lock.lease_id, B)
    with pytest.raises(UnknownLease):
        t.read_lease_offsets(lock.lease_id, B)
    assert t.get(k(1)).readers == 1
    assert t.release_read(lock.lease_id, A) == 1
    assert t.get(k(1)).readers == 0
    with pytest.raises(UnknownLease):
        t.release_read(lock.lease_id, A)


def test_release_read_in_parts_ends_the_lease_when_nothing_is_left(make_table):
    t = make_table(4)
    store(t, [1, 2, 3, 4])
    lock = t.acquire_read(ks(1, 2, 3, 4), A)
    assert t.release_read(lock.lease_id, A, start=1, end=3) == 2
    assert [t.get(k(i)).readers for i in (1, 2, 3, 4)] == [1, 0, 0, 1]
    assert t.read_lease_offsets(lock.lease_id, A) == [0]  # stops at the first released key
    assert t.read_lease_offsets(lock.lease_id, A, start=3) == [3 * SLOT]
    assert t.release_read(lock.lease_id, A, start=1, end=3) == 0  # already released: no double unlock
    assert t.leases_of(A) == 1
    assert t.release_read(lock.lease_id, A, start=3) == 1
    assert t.leases_of(A) == 1
    assert t.release_read(lock.lease_id, A, start=0, end=1) == 1
    assert t.leases_of(A) == 0
    assert t.stats().leases == 0
    with pytest.raises(UnknownLease):
        t.release_read(lock.lease_id, A)
    t.check_invariants()


def test_release_read_end_past_the_lease_and_negative_end_mean_to_the_end(make_table):
    t = make_table(4)
    store(t, [1, 2, 3])
    lock = t.acquire_read(ks(1, 2, 3), A)
    assert t.release_read(lock.lease_id, A, start=2, end=99) == 1
    assert t.release_read(lock.lease_id, A, start=0, end=-1) == 2
    assert t.stats().leases == 0


def test_release_read_of_no_lease_is_zero(make_table):
    t = make_table(4)
    assert t.release_read(NO_LEASE, A) == 0


# --- eviction ---------------------------------------------------------------------------------------


def test_lru_evicts_oldest_committed_first(make_table):
    t = make_table(3)
    store_one_by_one(t, [1, 2, 3])
    assert store(t, [4]) == [AL]
    assert present(t, [1, 2, 3, 4]) == [2, 3, 4]
    assert store(t, [5, 6]) == [AL, AL]
    assert present(t, range(1, 7)) == [4, 5, 6]
    assert t.stats().evicted_objects == 3


def test_lookup_counts_as_access_for_lru(make_table):
    t = make_table(3)
    store_one_by_one(t, [1, 2, 3])
    assert t.lookup(ks(1)) == 1  # 1 becomes most recent: order is 2, 3, 1
    store(t, [4])
    assert present(t, [1, 2, 3, 4]) == [1, 3, 4]
    t.release_read(t.acquire_read(ks(3), B).lease_id, B)  # reads count too (order now 1, 4, 3)
    store(t, [5])
    assert present(t, [1, 3, 4, 5]) == [3, 4, 5]


def test_exists_in_reserve_counts_as_access(make_table):
    t = make_table(3)
    store_one_by_one(t, [1, 2, 3])
    assert store(t, [1]) == [EX]  # order now 2, 3, 1
    store(t, [4])
    assert present(t, [1, 2, 3, 4]) == [1, 3, 4]


def test_locked_objects_are_never_evicted(make_table):
    t = make_table(3)
    store_one_by_one(t, [1, 2, 3])
    lock = t.acquire_read(ks(1, 2), B)
    assert store(t, [4]) == [AL]
    assert present(t, [1, 2, 3, 4]) == [1, 2, 4]
    assert store(t, [5]) == [AL]  # only 4 is unlocked and ready
    assert present(t, [1, 2, 4, 5]) == [1, 2, 5]
    r = t.reserve_write(ks(6, 7), SLOT, A)  # 5 goes for 6; then only locked/writing objects are left
    assert r.statuses == [AL, NS]
    assert present(t, [1, 2, 5, 6]) == [1, 2, 6]
    t.release_read(lock.lease_id, B)
    t.commit_write(r.lease_id, A)
    assert store(t, [7]) == [AL]
    # The lock touched 2 then 1 (tail first), so 2 is older than 1 and goes first.
    assert present(t, [1, 2, 6, 7]) == [1, 6, 7]
    t.check_invariants()


def test_writing_objects_are_never_evicted(make_table):
    t = make_table(2)
    r = t.reserve_write(ks(1, 2), SLOT, A)
    assert t.reserve_write(ks(3), SLOT, B).statuses == [NS]
    assert t.evict_to(0) == 0
    assert t.commit_write(r.lease_id, A) == 2


def test_a_batch_is_evicted_tail_first(make_table):
    """A prompt's chunks are stored together; eviction must take the tail before the head, since a head
    alone is still a prefix hit and a tail alone never is."""
    t = make_table(4)
    store(t, [1, 2, 3, 4])  # chunk 1 is the head
    assert t.evict_to(2 * SLOT) == 2
    assert present(t, [1, 2, 3, 4]) == [1, 2]
    assert t.lookup(ks(1, 2, 3, 4)) == 2


def test_a_lookup_keeps_the_head_most_recent(make_table):
    t = make_table(4)
    store_one_by_one(t, [1, 2])  # LRU: 1, 2
    assert t.lookup(ks(1, 2)) == 2  # touched tail first, head last: 2, 1
    assert t.evict_to(SLOT) == 1
    assert present(t, [1, 2]) == [1]


def test_evict_to_evicts_in_lru_order_down_to_the_target(make_table):
    t = make_table(4)
    store_one_by_one(t, [1, 2, 3, 4])
    t.lookup(ks(2))  # order 1, 3, 4, 2
    assert t.evict_to(2 * SLOT) == 2
    assert present(t, [1, 2, 3, 4]) == [2, 4]
    assert t.evict_to(2 * SLOT) == 0
    assert t.evict_to(0) == 2
    assert t.stats().used_bytes == 0
    assert t.stats().evicted_objects == 4


def test_noop_policy_never_evicts_and_stores_get_no_space(make_table):
    t = make_table(2, policy="noop")
    store(t, [1, 2])
    assert t.reserve_write(ks(3, 4), SLOT, A).statuses == [NS, NS]
    assert t.evict_to(0) == 0
    assert present(t, [1, 2]) == [1, 2]
    assert t.stats().evicted_objects == 0


def test_eviction_of_a_larger_size_frees_adjacent_space(make_table):
    t = make_table(4)
    store_one_by_one(t, [1, 2, 3, 4])
    r = t.reserve_write(ks(9), 2 * SLOT, A)  # needs two adjacent free slots: 1 and 2 are the oldest
    assert (r.statuses, r.offsets) == ([AL], [0])
    assert present(t, [1, 2, 3, 4]) == [3, 4]


def test_an_object_larger_than_l1_does_not_flush_the_cache(make_table):
    t = make_table(4)
    store(t, [1, 2, 3])
    assert t.reserve_write(ks(9), 5 * SLOT, A).statuses == [NS]
    assert present(t, [1, 2, 3]) == [1, 2, 3]


def test_a_batch_takes_its_slots_side_by_side_where_one_free_extent_holds_them(make_table):
    """One allocation for the batch's absent keys (ascending, in key order); a single key still takes
    the best-fitting hole, and a run piece a key did not use (a duplicate: BUSY) goes back at once."""
    t = make_table(8)
    store_one_by_one(t, [1, 2, 3])  # offsets 0, 64, 128
    assert t.discard(ks(2)) == 1  # a one-slot hole at 64; five slots free from 192
    r = t.reserve_write(ks(4, 5, 1, 6), SLOT, A)
    assert r.statuses == [AL, AL, EX, AL]
    assert r.offsets == [3 * SLOT, 4 * SLOT, -1, 5 * SLOT]  # not the hole: three side by side from the tail
    t.commit_write(r.lease_id, A)
    assert t.reserve_write(ks(7), SLOT, A).offsets == [SLOT]  # one key: best fit, the hole
    r = t.reserve_write(ks(8, 8), SLOT, A)
    assert (r.statuses, r.offsets) == ([AL, BU], [6 * SLOT, -1])
    assert t.used_bytes() == 7 * SLOT  # 1, 3, 4, 5, 6, 7, 8: the second piece went back
    t.check_invariants()


def test_reserve_write_never_evicts_a_key_it_reported_as_existing(make_table):
    t = make_table(2)
    store(t, [1])
    t.reserve_write(ks(9), SLOT, B)  # the other slot is being written: k1 is the only eviction candidate
    r = t.reserve_write(ks(1, 3), SLOT, A)
    assert r.statuses[0] is EX
    # EXISTS told the client not to write chunk 1; then chunk 3 must not be placed by evicting chunk 1
    assert t.get(k(1)) is not None, f"k1 was reported EXISTS but evicted for k3 (statuses {r.statuses})"


def test_policy_factory():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("noop"), NoopPolicy)
    with pytest.raises(ValueError):
        make_policy("fifo")


def test_lru_policy_order():
    p = LRUPolicy()
    for i in (1, 2, 3):
        p.on_ready(k(i))
    p.on_access(k(1))
    p.on_access(k(99))  # not tracked: ignored
    assert list(p.candidates()) == ks(2, 3, 1)
    p.on_remove(k(3))
    p.on_remove(k(99))
    assert list(p.candidates()) == ks(2, 1)
    p.on_ready(k(2))  # re-ready moves to the end
    assert list(p.candidates()) == ks(1, 2)


# --- lease life -------------------------------------------------------------------------------------


def test_expire_ends_write_leases_and_gives_the_space_back(make_table, clock):
    t = make_table(2)
    t.reserve_write(ks(1, 2), SLOT, A)
    clock.now += TTL
    assert t.expire() == 1
    s = t.stats()
    assert (s.used_bytes, s.objects, s.leases, s.expired_leases) == (0, 0, 0, 1)
    assert t.reserve_write(ks(3, 4), SLOT, B).statuses == [AL, AL]
    t.check_invariants()


def test_expire_ends_read_leases(make_table, clock):
    t = make_table(2)
    store(t, [1, 2])
    lock = t.acquire_read(ks(1, 2), B, ttl_s=5.0)
    clock.now += 5.0
    assert t.expire() == 1
    assert [t.get(k(1)).readers, t.get(k(2)).readers] == [0, 0]
    with pytest.raises(LeaseExpired):
        t.release_read(lock.lease_id, B)
    assert t.evict_to(0) == 2  # no longer pinned


def test_expire_uses_each_lease_ttl(make_table, clock):
    t = make_table(4)
    store(t, [1])
    short = t.acquire_read(ks(1), A, ttl_s=1.0)
    long = t.acquire_read(ks(1), A, ttl_s=100.0)
    w = t.reserve_write(ks(2), SLOT, B)  # default TTL
    assert t.expire(now=clock.now + 1.0) == 1
    assert t.expire(now=clock.now + TTL) == 1
    assert t.get(k(2)) is None
    assert t.get(k(1)).readers == 1
    assert t.release_read(long.lease_id, A) == 1
    with pytest.raises(LeaseExpired):
        t.release_read(short.lease_id, A)
    with pytest.raises(LeaseExpired):
        t.commit_write(w.lease_id, B)


def test_release_owner_ends_all_leases_of_one_owner_only(make_table):
    t = make_table(8)
    store(t, [1, 2])
    ra = t.acquire_read(ks(1, 2), A)
    rb = t.acquire_read(ks(1), B)
    wa = t.reserve_write(ks(3, 4), SLOT, A)
    wb = t.reserve_write(ks(5), SLOT, B)
    assert t.leases_of(A) == 2
    assert t.release_owner(A) == 2
    assert t.leases_of(A) == 0 and t.leases_of(B) == 2
    assert [t.get(k(1)).readers, t.get(k(2)).readers] == [1, 0]
    assert t.get(k(3)) is None and t.get(k(4)) is None
    assert t.get(k(5)).state is ObjectState.WRITING
    with pytest.raises(LeaseExpired):
        t.commit_write(wa.lease_id, A)
    with pytest.raises(LeaseExpired):
        t.release_read(ra.lease_id, A)
    assert t.commit_write(wb.lease_id, B) == 1
    assert t.release_read(rb.lease_id, B) == 1
    assert t.release_owner(C) == 0
    t.check_invariants()


# --- quarantine: space a running toucher can reach is never reused -----------------------------------


def test_expired_write_of_a_running_client_keeps_its_extents_until_it_finishes(make_table, clock, alive):
    t = make_table(2)
    alive.add(A)
    w = t.reserve_write(ks(1, 2), SLOT, A)  # CLIENT toucher: A maps these slots
    clock.now += TTL
    assert t.expire() == 1
    s = t.stats()
    assert (s.objects, s.leases, s.quarantined_leases, s.quarantined_bytes, s.used_bytes) == (0, 0, 1, 2 * SLOT, 2 * SLOT)
    # The keys are free for another writer, but not A's extents: L1 is full until A lets go.
    assert t.reserve_write(ks(1), SLOT, B).statuses == [NS]
    t.check_invariants()
    with pytest.raises(LeaseExpired, match=r"lease \d+ expired at .* \(TTL 10 s\)"):
        t.commit_write(w.lease_id, A)  # nothing is published ...
    assert t.lookup(ks(1, 2)) == 0
    s = t.stats()
    assert (s.quarantined_leases, s.used_bytes) == (0, 0)  # ... and the space is back
    assert t.reserve_write(ks(1, 2), SLOT, B).statuses == [AL, AL]
    t.check_invariants()


def test_revoked_writer_space_comes_back_when_its_process_is_gone(make_table, alive):
    t = make_table(2)
    alive.add(A)
    w = t.reserve_write(ks(1), SLOT, A)
    assert t.release_owner(A, "missed heartbeats") == 1
    [q] = t.quarantine()
    assert (q.owner, q.leases, q.bytes, q.why) == (A, 1, SLOT, "missed heartbeats")
    assert t.recheck_quarantine() == 0  # still running
    alive.discard(A)
    assert t.recheck_quarantine() == 1
    assert t.stats().used_bytes == 0 and t.quarantine() == []
    with pytest.raises(LeaseRevoked, match="was revoked at .* \\(missed heartbeats\\)"):
        t.commit_write(w.lease_id, A)
    t.check_invariants()


def test_quarantined_read_keeps_its_pins_so_finishing_it_is_a_sound_read(make_table, clock, alive):
    t = make_table(2)
    store(t, [1, 2])
    alive.add(B)
    lock = t.acquire_read(ks(1, 2), B, toucher=Toucher.CLIENT)
    clock.now += TTL
    assert t.expire() == 1
    assert t.clear() == 0  # still pinned: doomed, not freed
    assert t.evict_to(0) == 0
    assert [t.get(k(1)).readers, t.get(k(2)).readers] == [1, 1]
    assert t.release_read(lock.lease_id, B) == 2  # what B read never changed: the release succeeds
    assert t.stats().objects == 0  # doomed objects went with the last pin
    with pytest.raises(LeaseExpired):
        t.release_read(lock.lease_id, B)
    t.check_invariants()


def test_quarantined_bytes_count_each_pinned_object_once(make_table, clock, alive):
    """Paused engines reading a shared prefix (a system prompt every request starts with) hold several
    read leases on the same objects: quarantined, they hold back those objects' bytes once. Summed per
    lease, /status and kvdepot_l1_quarantined_bytes said several times that, more than the arena."""
    t = make_table(2)
    store(t, [1, 2])
    alive.update({B, C})
    for owner in (B, B, C):
        t.acquire_read(ks(1, 2), owner, toucher=Toucher.CLIENT)
    t.release_owner(B, "missed heartbeats", revoked=True)
    t.release_owner(C, "missed heartbeats", revoked=True)
    s = t.stats()
    assert s.quarantined_leases == 3
    assert s.quarantined_bytes == 2 * SLOT <= s.capacity_bytes
    assert sorted((q.leases, q.bytes) for q in t.quarantine()) == [(1, 2 * SLOT), (2, 2 * SLOT)]
    t.check_invariants()


def test_server_touched_leases_are_quarantined_whatever_the_owner(make_table, clock):
    t = make_table(2)
    w = t.reserve_write(ks(1), SLOT, A, toucher=Toucher.SERVER)  # e.g. an inline store still copying
    clock.now += TTL
    assert t.expire() == 1
    assert t.stats().quarantined_bytes == SLOT
    assert t.recheck_quarantine() == 0  # the server itself finishes it, never a process exit
    with pytest.raises(LeaseExpired):
        t.commit_write(w.lease_id, A)
    assert t.stats().used_bytes == 0


@pytest.mark.parametrize("expired", [False, True], ids=["active", "quarantined"])
def test_a_lease_the_server_is_copying_is_ended_by_the_server_only(make_table, clock, expired):
    """Lease ids are a counter: a client that names the lease of its own inline store (or block store,
    or inline retrieve) in a COMMIT or release used to free the slots while the server's copy still
    wrote or read them, and the next reservation, another client's, got them."""
    t = make_table(2)
    store(t, [9])
    w = t.reserve_write(ks(1), SLOT, A, toucher=Toucher.SERVER)  # an inline store still copying
    r = t.acquire_read(ks(9), A, toucher=Toucher.SERVER)  # an inline retrieve still sending
    if expired:
        clock.now += TTL
        assert t.expire() == 2 and t.stats().quarantined_leases == 2
    for finish in (lambda: t.commit_write(w.lease_id, A, by_client=True), lambda: t.abort_write(w.lease_id, A, by_client=True),
                   lambda: t.release_read(r.lease_id, A, by_client=True)):  # fmt: skip
        with pytest.raises(IllegalTransition, match="server's own copy"):
            finish()
    assert t.reserve_write(ks(2), SLOT, B).statuses == [NS]  # nothing was freed
    assert t.get(k(9)).readers == 1
    t.check_invariants()
    if expired:  # the server's own finish, once its copy is over
        with pytest.raises(LeaseExpired):
            t.commit_write(w.lease_id, A)
        t.release_read(r.lease_id, A)
        assert t.stats().quarantined_leases == 0
    else:
        assert t.commit_write(w.lease_id, A) == 1
        assert t.release_read(r.lease_id, A) == 1
    assert t.get(k(9)).readers == 0
    t.check_invariants()


def test_quarantined_leases_count_as_the_owners_leases(make_table, clock, alive):
    """While a client has space in quarantine the server must keep watching its process (only its exit
    ends the quarantine): an unregister that saw no leases used to forget it, and the next check freed
    space the client could still write."""
    t = make_table(2)
    alive.add(A)
    t.reserve_write(ks(1), SLOT, A)
    clock.now += TTL
    assert t.expire() == 1
    assert t.stats().leases == 0 and t.stats().quarantined_leases == 1
    assert t.leases_of(A) == 1 and t.leases_of(B) == 0


def test_lookup_locks_end_at_once_whoever_holds_them(make_table, clock, alive):
    t = make_table(2)
    store(t, [1])
    alive.add(B)
    lock = t.acquire_read(ks(1), B, toucher=Toucher.NOBODY)  # nobody was told an offset
    clock.now += TTL
    assert t.expire() == 1
    assert t.stats().quarantined_leases == 0 and t.get(k(1)).readers == 0
    with pytest.raises(LeaseExpired):
        t.release_read(lock.lease_id, B)


def test_renew_pushes_the_deadline_of_named_leases_and_sessions_only(make_table, clock):
    t = make_table(4)
    store(t, [1, 2])
    w = t.reserve_write(ks(3), SLOT, A)
    s1 = t.acquire_read(ks(1), A, session="req-1", toucher=Toucher.NOBODY)
    s2 = t.acquire_read(ks(2), A, session="req-2", toucher=Toucher.NOBODY)
    other = t.acquire_read(ks(1), B, session="req-1", toucher=Toucher.NOBODY)  # B's: not A's to renew
    clock.now += TTL - 1
    assert t.renew(A, lease_ids=[w.lease_id, LeaseId(999)], sessions=["req-1"]) == 2
    clock.now += 2
    assert t.expire() == 2  # req-2 and B's lease
    assert t.commit_write(w.lease_id, A) == 1
    assert t.release_read(s1.lease_id, A) == 1
    with pytest.raises(LeaseExpired):
        t.release_read(s2.lease_id, A)
    with pytest.raises(LeaseExpired):
        t.release_read(other.lease_id, B)


# --- clear ------------------------------------------------------------------------------------------


def test_clear_removes_unlocked_and_dooms_locked_objects(make_table):
    t = make_table(4)
    store(t, [1, 2, 3])
    lock = t.acquire_read(ks(1), B)
    w = t.reserve_write(ks(4), SLOT, A)
    assert t.clear() == 2  # 2 and 3
    assert present(t, [1, 2, 3, 4]) == [1, 4]
    assert t.get(k(1)).doomed and t.get(k(4)).doomed
    assert t.lookup(ks(1)) == 0  # doomed objects are invisible
    assert t.acquire_read(ks(1), C).lease_id == NO_LEASE
    assert t.stats().used_bytes == 2 * SLOT
    assert t.release_read(lock.lease_id, B) == 1  # the last reader: k1 goes now
    assert t.get(k(1)) is None
    assert t.commit_write(w.lease_id, A) == 0  # a doomed write is dropped, not published
    assert t.get(k(4)) is None
    s = t.stats()
    assert (s.used_bytes, s.objects, s.leases) == (0, 0, 0)
    t.check_invariants()


def test_doomed_object_with_two_readers_goes_with_the_last(make_table, clock):
    t = make_table(4)
    store(t, [1])
    l1 = t.acquire_read(ks(1), A)
    t.acquire_read(ks(1), B, ttl_s=1.0)
    t.clear()
    t.release_read(l1.lease_id, A)
    assert t.get(k(1)) is not None
    clock.now += 1.0
    assert t.expire() == 1
    assert t.get(k(1)) is None
    t.check_invariants()


# --- introspection ----------------------------------------------------------------------------------


def test_stats_and_repr(make_table):
    t = make_table(4)
    store(t, [1, 2])
    t.acquire_read(ks(1), A)
    t.reserve_write(ks(3), SLOT, A)
    s = t.stats()
    assert (s.capacity_bytes, s.used_bytes, s.objects, s.ready, s.writing, s.read_locked, s.leases) == (
        4 * SLOT, 3 * SLOT, 3, 2, 1, 1, 2
    )
    assert (s.largest_free_bytes, s.fragmentation) == (SLOT, 0.0)
    assert repr(t) == f"ObjectTable(objects=3, used={3 * SLOT}/{4 * SLOT}, leases=2, quarantined=0)"
    assert t.capacity == 4 * SLOT


def test_get_returns_a_snapshot(make_table):
    t = make_table(4)
    store(t, [1])
    snap = t.get(k(1))
    snap.readers = 7
    assert t.get(k(1)).readers == 0


@pytest.mark.parametrize("name", ["lru", "isolated_lru"])
def test_a_run_of_accesses_orders_keys_as_one_access_per_key_head_last(name):
    """``on_access_run`` (one call per lookup) must leave the same eviction order as touching the run's
    keys one by one, tail first: the prompt's head ends most recent. Untracked keys are ignored."""
    import random

    rng = random.Random(7)
    keys = [ObjectKey(bytes([i]) * 8) for i in range(20)]
    one, run = make_policy(name), make_policy(name)
    for p in (one, run):
        for k in keys:
            p.on_ready(k, "", 1)
    for _ in range(50):
        picked = rng.sample(keys, rng.randint(0, 8)) + [ObjectKey(b"untracked")]
        for k in reversed(picked):
            one.on_access(k)
        run.on_access_run(picked)
        assert list(one.candidates()) == list(run.candidates())
    run.on_access_run([keys[3], keys[5]])
    assert list(run.candidates())[-2:] == [keys[5], keys[3]]


def test_a_reserve_into_an_l1_full_of_held_objects_walks_the_table_once_not_per_chunk():
    """L2 hung (or a whole L1 behind): every object awaits its push. Each allocation of a reserve used
    to walk the whole eviction order twice (once for an unheld victim, once more taking held ones),
    under the table lock every client's request waits for: a 16-chunk PREPARE cost 32 x N checks."""
    n = 2000
    table = ObjectTable(ExtentAllocator(SLOT * n, SLOT), LRUPolicy())
    table.hold_for_l2(lambda owner: True)  # the push never takes anything
    for i in range(0, n, 500):
        r = table.reserve_write([ObjectKey(b"o" + (i + j).to_bytes(7, "big")) for j in range(500)], SLOT, A, toucher=Toucher.CLIENT)
        table.commit_write(r.lease_id, A)
    assert table.stats().awaiting_l2 == n
    checks = 0
    real = table._evictable_locked

    def counting(*a, **kw):
        nonlocal checks
        checks += 1
        return real(*a, **kw)

    table._evictable_locked = counting
    r = table.reserve_write([ObjectKey(b"n" + j.to_bytes(7, "big")) for j in range(16)], SLOT, A, toucher=Toucher.CLIENT)
    assert r.statuses == [AL] * 16
    assert table.stats().evicted_awaiting_l2 == 16  # the last resort, counted
    table.check_invariants()
    assert checks <= 2 * n + 16 * 40, f"{checks} candidate checks for a 16-chunk reserve over {n} objects"


class _Watched(bytes):
    """A key that counts how often anything hashes it (a dict or set lookup: someone looked at it)."""

    looked_at = 0

    def __hash__(self) -> int:
        _Watched.looked_at += 1
        return bytes.__hash__(self)


def test_a_tenant_at_its_quota_makes_room_from_its_own_keys_without_walking_the_others():
    """isolated_lru: a tenant at its quota makes room from its own oldest objects. Finding them walked
    the whole LRU order past every other tenant's older key, once per chunk, under the table's lock:
    a 100-chunk store of a tenant at its quota held every engine's LOOKUP for 4.4 s at 300k objects.
    The eviction controller's quota pass (run after every store) walked every key as well, with no
    tenant over its quota at all."""
    others = 2000
    table = ObjectTable(ExtentAllocator(SLOT * (others + 8), SLOT), make_policy("isolated_lru"))
    old = [ObjectKey(_Watched(b"o" + i.to_bytes(7, "big"))) for i in range(others)]
    for i in range(0, others, 500):  # the other tenant's objects: all older than the tenant's
        r = table.reserve_write(old[i : i + 500], SLOT, A, salt="other", toucher=Toucher.CLIENT)
        table.commit_write(r.lease_id, A)
    table.policy.set_quota("t", 4 * SLOT)
    mine = [ObjectKey(b"t" + i.to_bytes(7, "big")) for i in range(8)]
    store_keys = lambda keys: table.commit_write(table.reserve_write(keys, SLOT, B, salt="t", toucher=Toucher.CLIENT).lease_id, B)  # noqa: E731
    store_keys(mine[:4])
    _Watched.looked_at = 0
    for key in mine[4:]:  # each one at the quota: the tenant's oldest makes room
        store_keys([key])
    assert table.enforce_quotas() == 0
    assert [table.get(key) is not None for key in mine] == [False] * 4 + [True] * 4
    assert table.stats().objects == others + 4
    assert _Watched.looked_at == 0, f"another tenant's keys looked at {_Watched.looked_at} times to keep one tenant in its quota"
    table.check_invariants()  # (after: it looks at every key)
