"""The small state machines outside the object table: a server session, an L2 prefetch job, a tier's
health. Each legal transition is exercised; each illegal one raises IllegalTransition and changes
nothing. (The object table's own state machine: test_l1.py and the stateful property test.)"""

from __future__ import annotations

import pytest

from kvdepot.errors import IllegalTransition
from kvdepot.server.sessions import NO_LEASE, SessionState, SessionTable
from kvdepot.storage.controllers.prefetch import PrefetchJob, PrefetchState
from kvdepot.storage.l2.health import HealthState, TierHealth
from kvdepot.types import ContextId, LeaseId, ObjectKey

KEYS = [ObjectKey(bytes([i]) * 48) for i in range(6)]
K = (ContextId(1), "req-1")


def fixed_lock(lease: int, n: int):
    return lambda keys: (LeaseId(lease), min(n, len(keys)))


# --- sessions -------------------------------------------------------------------------------------------


def test_a_locking_lookup_is_locked_until_a_retrieve_takes_the_lease():
    t = SessionTable()
    session, old = t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    assert old == NO_LEASE and t.state(K) is SessionState.LOCKED and t.lease(K) == 7
    assert t.answer(K).hits == 3 and t.state(K) is SessionState.LOCKED  # answered, still locked
    assert t.hand_over(K, KEYS[:3], 1) == 7 and t.state(K) is SessionState.HANDED
    assert t.lease(K) == NO_LEASE and t.hand_over(K, KEYS[:3], 0) == NO_LEASE  # handed once
    assert t.end(K) == NO_LEASE and t.state(K) is None


def test_a_retrieve_of_other_chunks_does_not_take_the_lease():
    t = SessionTable()
    t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    assert t.hand_over(K, KEYS[3:6], 0) == NO_LEASE  # other keys
    assert t.hand_over(K, KEYS[:3], 3) == NO_LEASE  # past the locked ones
    assert t.state(K) is SessionState.LOCKED


def test_a_prefetch_ends_locked_or_known():
    t = SessionTable()
    s, _ = t.open(K, LeaseId(7), KEYS[:1], 1, lock=True, prefetch_keys=KEYS)
    assert t.state(K) is SessionState.PREFETCHING and t.answer(K).hits is None
    assert t.hand_over(K, KEYS, 0) == NO_LEASE  # not before the count is known
    assert t.prefetched(K, s, 4, fixed_lock(9, 4)) == 7  # the first lock, for the caller to release
    assert t.state(K) is SessionState.LOCKED and t.lease(K) == 9 and t.answer(K).hits == 4

    k2 = (ContextId(1), "req-2")
    s2, _ = t.open(k2, NO_LEASE, [], 0, lock=False, prefetch_keys=KEYS)
    assert t.prefetched(k2, s2, 2, fixed_lock(99, 2)) == NO_LEASE
    assert t.state(k2) is SessionState.KNOWN
    assert t.answer(k2).hits == 2 and t.state(k2) is None  # a lock-free session ends once answered


def test_a_prefetch_that_ends_after_its_session_changes_nothing():
    t = SessionTable()
    first, _ = t.open(K, LeaseId(7), KEYS[:1], 1, lock=True, prefetch_keys=KEYS)
    _, old = t.open(K, LeaseId(8), KEYS[:2], 2, lock=True, prefetch_keys=None)  # a new lookup, same id
    assert old == 7
    assert t.prefetched(K, first, 5, fixed_lock(9, 5)) is None  # replaced: nothing to do
    assert t.state(K) is SessionState.LOCKED and t.lease(K) == 8


@pytest.mark.parametrize("state", ["locked", "known"])
def test_prefetched_from_any_state_but_prefetching_is_illegal(state):
    t = SessionTable()
    if state == "locked":
        s, _ = t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    else:
        s, _ = t.open(K, NO_LEASE, [], 0, lock=False, prefetch_keys=KEYS)
        t.prefetched(K, s, 1, fixed_lock(1, 1))
    before = (t.state(K), t.lease(K))
    with pytest.raises(IllegalTransition):
        t.prefetched(K, s, 5, fixed_lock(9, 5))
    assert (t.state(K), t.lease(K)) == before


def test_ending_a_context_ends_its_sessions_only():
    t = SessionTable()
    t.open((ContextId(1), "a"), LeaseId(1), KEYS[:1], 1, lock=True, prefetch_keys=None)
    t.open((ContextId(1), "b"), LeaseId(2), KEYS[:1], 1, lock=True, prefetch_keys=None)
    t.open((ContextId(2), "a"), LeaseId(3), KEYS[:1], 1, lock=True, prefetch_keys=None)
    assert sorted(t.end_context(ContextId(1))) == [1, 2]
    assert len(t) == 1 and t.lease((ContextId(2), "a")) == 3


# --- prefetch jobs --------------------------------------------------------------------------------------


def job() -> PrefetchJob:
    return PrefetchJob(list(KEYS), 1, 64, "", lambda n: None)


def test_a_prefetch_job_walks_the_tiers():
    j = job()
    j.next_tier()  # tier 0 had none
    assert (j.state, j.tier) == (PrefetchState.LOOKUP, 1)
    j.start_load(LeaseId(5), KEYS[1:3], 2)
    assert j.state is PrefetchState.LOAD
    assert j.supplied(2, complete=True) is True  # all it had: ask the next tier for the rest
    assert (j.state, j.tier, j.start, j.loaded) == (PrefetchState.LOOKUP, 2, 3, 2)
    assert j.supplied(1, complete=False) is False  # a chunk failed: the prefix ends here
    assert j.finish() == 3 and j.state is PrefetchState.DONE


@pytest.mark.parametrize(
    "move",
    [
        lambda j: j.next_tier(),
        lambda j: j.start_load(LeaseId(1), KEYS[:1], 1),
        lambda j: j.supplied(1, True),
        lambda j: j.finish(),
    ],
    ids=["next_tier", "start_load", "supplied", "finish"],
)
def test_nothing_moves_a_finished_job(move):
    j = job()
    j.finish()
    with pytest.raises(IllegalTransition):
        move(j)
    assert (j.state, j.tier, j.start, j.loaded) == (PrefetchState.DONE, 0, 1, 0)


@pytest.mark.parametrize(
    "move", [lambda j: j.next_tier(), lambda j: j.start_load(LeaseId(2), KEYS[:1], 1)], ids=["next_tier", "start_load"]
)
def test_a_loading_job_can_only_be_supplied_or_finished(move):
    j = job()
    j.start_load(LeaseId(5), KEYS[1:3], 2)
    with pytest.raises(IllegalTransition):
        move(j)
    assert (j.state, j.lease, j.tier) == (PrefetchState.LOAD, 5, 0)


# --- tier health ----------------------------------------------------------------------------------------


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_health_transition():
    clock = Clock()
    h = TierHealth(2.0, clock=clock)
    assert h.state is HealthState.UP and h.admit() and h.admit()
    assert h.succeeded() is False  # UP --succeeded--> UP
    assert h.failed("ConnectionError: down") is True  # UP --failed--> DOWN (worth a warning)
    assert h.state is HealthState.DOWN and not h.healthy and h.last_error == "ConnectionError: down"
    assert not h.admit()  # fail fast within the interval
    assert h.failed("again") is False and h.last_error == "again"  # DOWN --failed--> DOWN
    clock.now += 2.0
    assert h.admit() and h.state is HealthState.PROBING  # one probe
    assert not h.admit()  # the others still fail fast
    clock.now += 2.0
    assert h.admit()  # a hung probe does not block forever: another after the next interval
    assert h.failed("probe failed") is False and h.state is HealthState.DOWN  # PROBING --failed--> DOWN
    clock.now += 2.0
    assert h.admit()
    assert h.succeeded() is True and h.state is HealthState.UP  # PROBING --succeeded--> UP
    h.failed("x")
    assert h.succeeded() is True and h.admit()  # DOWN --succeeded--> UP (a task started earlier came back fine)
