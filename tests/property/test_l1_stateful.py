"""ObjectTable under random operations from three clients, checked step by step against a model.

The model knows exactly which keys are READY, WRITING (and under which lease), doomed by ``clear``, and
read-locked by which lease. Eviction is the one thing it does not predict: after a store or ``evict_to``
it asks the table which READY keys went, and checks that none of them was locked.

It also models quarantine: each lease has a toucher, each owner's process is alive or not (a rule
flips it), and a lease ended by force while its toucher may still run keeps its extents (write) or its
pins (read) until it is finished or its owner's process is gone. The allocator's usage must always
equal the live objects plus the quarantined write extents: space a running toucher can reach is never
handed out again.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvdepot.errors import LeaseExpired, UnknownLease
from kvdepot.types import SlotStatus
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.eviction import make_policy
from kvdepot.storage.l1 import NO_LEASE, EventKind, ObjectState, ObjectTable, Toucher
from kvdepot.types import ClientId, ObjectKey

SLOT = 32
TTL = 10.0
N_KEYS = 6
OWNERS = [ClientId(b"a"), ClientId(b"b"), ClientId(b"c")]
AL, EX, BU, NS = SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY, SlotStatus.NO_SPACE


def k(i: int) -> ObjectKey:
    return ObjectKey(bytes(16) + bytes([i]) * 32)


KEYS = [k(i) for i in range(N_KEYS)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
owners = st.sampled_from(OWNERS)
ttls = st.sampled_from([None, 1.0, 3.0])
write_touchers = st.sampled_from([Toucher.CLIENT, Toucher.CLIENT, Toucher.SERVER])
read_touchers = st.sampled_from([Toucher.NOBODY, Toucher.CLIENT, Toucher.SERVER])


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class MLease:
    owner: ClientId
    keys: list  # list[ObjectKey | None]
    deadline: float
    toucher: Toucher = Toucher.CLIENT
    held: int = 0  # quarantined write: bytes still allocated


class L1Machine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "lru", "noop"]), slots=st.integers(min_value=2, max_value=5))
    def setup(self, policy, slots):
        self.clock = Clock()
        self.policy = policy
        self.alive: set[ClientId] = set()  # owners whose process may still touch the arena
        self.table = ObjectTable(
            ExtentAllocator(slots * SLOT, alignment=SLOT),
            make_policy(policy),
            lease_ttl_s=TTL,
            clock=self.clock,
            holder_alive=lambda owner: owner in self.alive,
        )
        self.notified: list[list[ObjectKey]] = []  # keys of each batch that published something
        self.live: dict[ObjectKey, int] = {}  # key -> generation: stored and not yet removed, per the events
        self.table.subscribe(self.on_events)
        self.ready: set[ObjectKey] = set()  # READY and visible
        self.doomed: set[ObjectKey] = set()  # cleared while locked or being written
        self.size: dict[ObjectKey, int] = {}  # every object in the table -> its size
        self.writes: dict[int, MLease] = {}
        self.reads: dict[int, MLease] = {}
        self.ended: set[int] = set()  # forcibly ended: LeaseExpired from now on
        self.finished: set[int] = set()  # ended normally: UnknownLease from now on
        self.qwrites: dict[int, MLease] = {}  # quarantined writes (their extents held)
        self.qreads: dict[int, MLease] = {}  # quarantined reads (their pins held)

    def on_events(self, events) -> None:
        stored = [e.key for e in events if e.kind is EventKind.STORED]
        if stored:
            self.notified.append(stored)
        for e in events:
            if e.kind is EventKind.STORED:
                assert e.key not in self.live, "stored twice without a removal between"
                self.live[e.key] = e.generation
            else:
                assert self.live.pop(e.key, None) == e.generation, "a removal of an object never stored"

    # --- model helpers ----------------------------------------------------------------------------

    def readers(self, key: ObjectKey) -> int:
        return sum(lease.keys.count(key) for lease in [*self.reads.values(), *self.qreads.values()])

    def writer_of(self, key: ObjectKey) -> int | None:
        for lid, lease in self.writes.items():
            if key in lease.keys:
                return lid
        return None

    def leading_ready(self, keys) -> list[ObjectKey]:
        out = []
        for key in keys:
            if key not in self.ready:
                break
            out.append(key)
        return out

    def drop_object(self, key: ObjectKey) -> None:
        self.ready.discard(key)
        self.doomed.discard(key)
        del self.size[key]

    def unlock(self, key: ObjectKey) -> None:
        """Called after the lease holding ``key`` has forgotten it."""
        if key in self.doomed and self.readers(key) == 0:
            self.drop_object(key)

    def end_lease(self, lid: int) -> None:
        """Forced end: TTL or owner gone. Quarantined when its toucher may still run."""
        lease = self.writes.get(lid) or self.reads[lid]
        quarantine = lease.toucher is Toucher.SERVER or (lease.toucher is Toucher.CLIENT and lease.owner in self.alive)
        if lid in self.writes:
            del self.writes[lid]
            for key in lease.keys:
                if quarantine:
                    lease.held += self.size[key]
                self.drop_object(key)
            if quarantine:
                lease.keys = []
                self.qwrites[lid] = lease
        else:
            del self.reads[lid]
            if quarantine:
                self.qreads[lid] = lease  # the pins stay
            else:
                for key in lease.keys:
                    if key is not None:
                        self.unlock(key)
        self.ended.add(lid)

    def let_go(self, lid: int) -> int:
        """A quarantine ends (finished late, or its toucher is gone); returns the pins dropped."""
        if lid in self.qwrites:
            del self.qwrites[lid]
            return 0
        lease = self.qreads.pop(lid)
        keys = [key for key in lease.keys if key is not None]
        lease.keys = []
        for key in keys:
            self.unlock(key)
        return len(keys)

    def reconcile_evictions(self, before_ready: set[ObjectKey]) -> set[ObjectKey]:
        evicted = set()
        for key in before_ready:
            obj = self.table.get(key)
            if obj is None or obj.state is ObjectState.WRITING:
                evicted.add(key)
        for key in evicted:
            assert self.readers(key) == 0, f"locked key {key[-1]} was evicted"
            self.drop_object(key)
        return evicted

    def snapshot(self):
        return self.table.stats(), [self.table.get(key) for key in KEYS]

    # --- writes -----------------------------------------------------------------------------------

    @rule(
        owner=owners,
        keys=key_lists,
        units=st.sampled_from([1, 1, 1, 2]),
        ttl=ttls,
        then=st.sampled_from(["commit", "commit", "commit", "keep", "abort"]),
        toucher=write_touchers,
    )
    def store(self, owner, keys, units, ttl, then, toucher):
        """Reserve, then (usually) commit at once, as a client does."""
        lid = self.reserve(owner, keys, units, ttl, toucher)
        if lid != NO_LEASE and then != "keep":
            self.finish(lid, owner, abort=then == "abort")

    # Rules are drawn uniformly: a second store rule keeps L1 full enough for eviction to matter.
    @rule(owner=owners, keys=key_lists, ttl=ttls)
    def store_and_commit(self, owner, keys, ttl):
        lid = self.reserve(owner, keys, 1, ttl)
        if lid != NO_LEASE:
            self.finish(lid, owner, abort=False)

    def reserve(self, owner, keys, units, ttl, toucher=Toucher.CLIENT) -> int:
        size = units * SLOT
        ready_before = set(self.ready)
        writing_before = {key for lease in self.writes.values() for key in lease.keys}
        doomed_before = set(self.doomed)
        r = self.table.reserve_write(keys, size, owner, ttl_s=ttl, toucher=toucher)
        assert len(r.statuses) == len(r.offsets) == len(keys)
        evicted = self.reconcile_evictions(ready_before)

        seen_no_space = False
        allocated: list[ObjectKey] = []
        for key, status, offset in zip(keys, r.statuses, r.offsets):
            assert (offset >= 0) == (status is AL)
            if key in allocated:
                assert status is BU, "a key reserved earlier in the same batch is BUSY"
            elif key in doomed_before:
                assert status is BU, "a key cleared while still read is BUSY until it goes"
            elif key in writing_before:
                assert status is BU
            elif key in ready_before and key not in evicted:
                assert status is EX
            if status is EX:
                assert key in ready_before
            if status is AL:
                assert not seen_no_space, "ALLOCATED after a NO_SPACE"
                assert key not in writing_before and key not in doomed_before
                assert key not in ready_before or key in evicted
                obj = self.table.get(key)
                assert (obj.state, obj.offset, obj.size, obj.writer) == (ObjectState.WRITING, offset, size, r.lease_id)
                allocated.append(key)
            if status is NS:
                seen_no_space = True
                if key not in doomed_before:
                    assert self.table.get(key) is None
        if allocated:
            assert r.lease_id != NO_LEASE
            assert r.lease_id not in self.writes and r.lease_id not in self.reads
            self.writes[r.lease_id] = MLease(owner, allocated, self.clock.now + (TTL if ttl is None else ttl), toucher)
            for key in allocated:
                self.size[key] = size
        else:
            assert r.lease_id == NO_LEASE
        return r.lease_id

    @precondition(lambda self: self.writes or self.ended or self.finished)
    @rule(data=st.data(), wrong_owner=st.sampled_from([False, False, True]), abort=st.booleans())
    def finish_write(self, data, wrong_owner, abort):
        lid = data.draw(st.sampled_from(sorted(self.writes) + sorted(self.ended | self.finished)), label="lease")
        lease = self.writes.get(lid)
        owner = lease.owner if lease is not None else data.draw(owners)
        if lease is not None and wrong_owner:
            owner = next(o for o in OWNERS if o != lease.owner)
        self.finish(lid, owner, abort)

    def finish(self, lid, owner, abort):
        lease = self.writes.get(lid)
        call = self.table.abort_write if abort else self.table.commit_write
        held = self.qwrites.get(lid)
        if held is not None and owner == held.owner:
            # The late finisher of a quarantined write: its space goes back, nothing is published.
            n_notified = len(self.notified)
            with pytest.raises(LeaseExpired):
                call(lid, owner)
            assert len(self.notified) == n_notified
            self.let_go(lid)
            return
        if lease is None or owner != lease.owner:
            expected_error = LeaseExpired if lease is None and lid in self.ended else UnknownLease
            before = self.snapshot()
            with pytest.raises(expected_error):
                call(lid, owner)
            assert self.snapshot() == before, "a refused transition changed state"
            return
        n_notified = len(self.notified)
        n = call(lid, owner)
        del self.writes[lid]
        self.finished.add(lid)
        visible = [key for key in lease.keys if key not in self.doomed]
        if abort:
            assert n == len(lease.keys)
            assert len(self.notified) == n_notified
            for key in lease.keys:
                self.drop_object(key)
        else:
            assert n == len(visible)
            assert self.notified[n_notified:] == ([visible] if visible else [])  # nothing published: no call
            for key in lease.keys:
                if key in self.doomed:
                    self.drop_object(key)
                else:
                    self.ready.add(key)

    # --- reads ------------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def lookup(self, keys):
        assert self.table.lookup(keys) == len(self.leading_ready(keys))

    @rule(owner=owners, keys=key_lists, ttl=ttls, toucher=read_touchers)
    def acquire(self, owner, keys, ttl, toucher):
        expected = self.leading_ready(keys)
        lock = self.table.acquire_read(keys, owner, ttl_s=ttl, toucher=toucher)
        if not expected:
            assert (lock.lease_id, lock.offsets) == (NO_LEASE, [])
            return
        assert lock.lease_id != NO_LEASE and lock.lease_id not in self.writes and lock.lease_id not in self.reads
        assert lock.offsets == [self.table.get(key).offset for key in expected]
        assert lock.size == self.size[expected[0]]
        self.reads[lock.lease_id] = MLease(owner, list(expected), self.clock.now + (TTL if ttl is None else ttl), toucher)

    @precondition(lambda self: self.reads)
    @rule(
        data=st.data(),
        wrong_owner=st.sampled_from([False, False, True]),
        start=st.integers(min_value=0, max_value=4),
        end=st.sampled_from([None, -1, 0, 1, 2, 3, 5]),
    )
    def release(self, data, wrong_owner, start, end):
        lid = data.draw(st.sampled_from(sorted(self.reads)), label="read lease")
        lease = self.reads[lid]
        if wrong_owner:
            owner = next(o for o in OWNERS if o != lease.owner)
            before = self.snapshot()
            with pytest.raises(UnknownLease):
                self.table.release_read(lid, owner, start, end)
            assert self.snapshot() == before
            return
        stop = len(lease.keys) if end is None or end < 0 else min(end, len(lease.keys))
        expected = []
        for i in range(start, stop):
            if lease.keys[i] is not None:
                expected.append(lease.keys[i])
                lease.keys[i] = None
        assert self.table.release_read(lid, lease.owner, start, end) == len(expected)
        if all(key is None for key in lease.keys):
            del self.reads[lid]
            self.finished.add(lid)
        for key in expected:
            self.unlock(key)

    @precondition(lambda self: self.finished or self.ended)
    @rule(data=st.data())
    def release_a_finished_lease(self, data):
        lid = data.draw(st.sampled_from(sorted(self.finished | self.ended)), label="old lease")
        owner = data.draw(owners)
        held = self.qreads.get(lid)
        if held is not None and owner == held.owner:
            # A quarantined read kept its pins, so finishing it is a sound read: it succeeds.
            expected = self.let_go(lid)
            assert self.table.release_read(lid, owner) == expected
            return
        before = self.snapshot()
        with pytest.raises(LeaseExpired if lid in self.ended else UnknownLease):
            self.table.release_read(lid, owner)
        assert self.snapshot() == before

    # --- lease life and capacity ------------------------------------------------------------------

    @rule(what=st.sampled_from(["tick", "tick", "owner gone", "evict_to", "clear", "alive", "recheck"]), data=st.data())
    def disrupt(self, what, data):
        """Leases ending, clients leaving, processes starting or stopping, eviction, clear: drawn as one rule
        so they stay rarer than stores."""
        if what == "alive":
            self.alive ^= {data.draw(owners, label="owner")}
        elif what == "recheck":
            gone = [lid for lid, lease in {**self.qwrites, **self.qreads}.items() if lease.toucher is Toucher.CLIENT and lease.owner not in self.alive]
            assert self.table.recheck_quarantine() == len(gone)
            for lid in gone:
                self.let_go(lid)
        elif what == "tick":
            self.tick_and_expire(data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.5, 11.0]), label="dt"))
        elif what == "owner gone":
            self.owner_gone(data.draw(owners, label="owner"))
        elif what == "evict_to":
            self.evict_to(data.draw(st.integers(min_value=0, max_value=5), label="target slots"))
        else:
            self.clear()

    def tick_and_expire(self, dt):
        self.clock.now += dt
        due = sorted(lid for lid, lease in {**self.writes, **self.reads}.items() if lease.deadline <= self.clock.now)
        assert self.table.expire() == len(due)
        for lid in due:
            self.end_lease(lid)

    def owner_gone(self, owner):
        mine = [lid for lid, lease in {**self.writes, **self.reads}.items() if lease.owner == owner]
        assert self.table.release_owner(owner) == len(mine)
        for lid in mine:
            self.end_lease(lid)
        # What is left of the owner's is in quarantine: it counts, so the server keeps watching the owner.
        assert self.table.leases_of(owner) == sum(1 for q in (*self.qwrites.values(), *self.qreads.values()) if q.owner == owner)

    def evict_to(self, target_slots):
        target = target_slots * SLOT
        ready_before = set(self.ready)
        n = self.table.evict_to(target)
        evicted = self.reconcile_evictions(ready_before)
        assert n == len(evicted)
        if self.policy == "noop":
            assert n == 0
        elif self.table.stats().used_bytes > target:
            # it stopped early only because nothing evictable was left
            assert all(self.readers(key) > 0 for key in self.ready)

    def clear(self):
        unlocked = {key for key in self.ready if self.readers(key) == 0}
        assert self.table.clear() == len(unlocked)
        for key in unlocked:
            self.drop_object(key)
        self.doomed |= self.ready  # the locked READY ones
        self.ready.clear()
        self.doomed |= {key for lease in self.writes.values() for key in lease.keys}

    # --- invariants -------------------------------------------------------------------------------

    @invariant()
    def table_matches_model(self):
        if not hasattr(self, "table"):
            return
        self.table.check_invariants()
        s = self.table.stats()
        assert s.used_bytes <= s.capacity_bytes
        held = sum(lease.held for lease in self.qwrites.values())
        assert s.used_bytes == sum(self.size.values()) + held  # sizes are whole slots: no rounding
        assert s.objects == len(self.size)
        assert s.leases == len(self.writes) + len(self.reads)
        assert s.quarantined_leases == len(self.qwrites) + len(self.qreads)
        for key in KEYS:
            obj = self.table.get(key)
            writer = self.writer_of(key)
            if key not in self.size:
                assert obj is None, f"key {key[-1]} should be absent"
                continue
            assert obj is not None, f"key {key[-1]} was lost"
            assert obj.size == self.size[key]
            assert obj.doomed == (key in self.doomed)
            assert obj.readers == self.readers(key)
            if writer is not None:
                assert obj.state is ObjectState.WRITING and obj.writer == writer
            else:
                assert obj.state is ObjectState.READY
                assert (key in self.ready) != (key in self.doomed)
        # The events tell exactly which READY objects exist (a doomed one is still there until it goes).
        ready_in_table = {key for key in KEYS if (o := self.table.get(key)) is not None and o.state is ObjectState.READY}
        assert set(self.live) == ready_in_table
        for key, gen in self.live.items():
            assert self.table.get(key).generation == gen
        for lease in [*self.reads.values(), *self.qreads.values()]:  # every locked key is present and READY
            for key in lease.keys:
                if key is not None:
                    assert self.table.get(key).state is ObjectState.READY


L1Machine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestObjectTable = L1Machine.TestCase
