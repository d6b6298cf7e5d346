"""Every small state machine outside the object table, tried exhaustively: a server session, an L2
prefetch job, a client's liveness record, a vLLM request's phase and locks, the prefaulter, and the
circuit breaker. For each machine a table says which states each transition may leave; every
(transition, state) pair the table forbids is tried and must raise IllegalTransition and change nothing;
every pair it allows is tried and must land where the drawing says. (The object table's own state
machine: test_l1.py and the stateful property test.)"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest

from kvdepot.breaker import BreakerState, CircuitBreaker
from kvdepot.connectors.vllm.request_state import Locks, Phase, RequestState
from kvdepot.errors import IllegalTransition
from kvdepot.protocol.messages import ClientInfo
from kvdepot.server.liveness import ClientRecord, ClientState, Revocation
from kvdepot.server.sessions import Session, SessionState, SessionTable
from kvdepot.shm import Prefaulter, PrefaultState, SharedArena
from kvdepot.storage.controllers.prefetch import PrefetchJob, PrefetchState
from kvdepot.types import NO_LEASE, ClientId, ContextId, LeaseId, ObjectKey

KEYS = [ObjectKey(bytes([i]) * 48) for i in range(6)]
K = (ContextId(1), "req-1")


def snapshot(obj) -> dict:
    """Every field of a dataclass (deep-copied), to prove a refused transition changed nothing."""
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def check_machine(make, states, transitions, state_of):
    """``make(state)`` builds a machine in ``state``; ``transitions`` maps a name to (call, allowed
    states, expected state after it, or None when it depends on the arguments). Tries every pair."""
    tried = 0
    for (name, (call, allowed, after)), state in itertools.product(transitions.items(), states):
        machine = make(state)
        if state in allowed:
            call(machine)
            if after is not None:
                assert state_of(machine) is after, f"{name} from {state}: {state_of(machine)}, not {after}"
        else:
            before = snapshot(machine)
            with pytest.raises(IllegalTransition):
                call(machine)
            assert snapshot(machine) == before, f"a refused {name} from {state} changed the machine"
        tried += 1
    assert tried == len(transitions) * len(states)


# --- sessions -------------------------------------------------------------------------------------------


def session_in(state: SessionState) -> Session:
    lease = NO_LEASE if state is SessionState.ENDED else LeaseId(7)
    hits = None if state is SessionState.PREFETCHING else 2
    return Session(state, lease, KEYS[:2], hits, lock=True, all_keys=list(KEYS) if state is SessionState.PREFETCHING else None)


def test_every_session_transition_from_every_state():
    S = SessionState
    live = {S.PREFETCHING, S.LOCKED, S.KNOWN}
    check_machine(
        session_in,
        list(S),
        {
            "lock_prefetched": (lambda s: s.lock_prefetched(LeaseId(9), KEYS[:4]), {S.PREFETCHING}, S.LOCKED),
            "know": (lambda s: s.know(3), {S.PREFETCHING}, S.KNOWN),
            "hand_over": (lambda s: s.hand_over(), {S.LOCKED}, S.ENDED),
            "answered": (lambda s: s.answered(), {S.KNOWN}, S.ENDED),
            "end": (lambda s: s.end(), live, S.ENDED),
        },
        lambda s: s.state,
    )


def test_a_session_hands_over_its_lease_once():
    s = session_in(SessionState.LOCKED)
    assert s.hand_over() == 7 and s.lease_id == NO_LEASE
    with pytest.raises(IllegalTransition):
        s.hand_over()


def test_a_locking_lookup_is_locked_until_a_retrieve_takes_the_lease():
    t = SessionTable()
    session, old = t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    assert old == NO_LEASE and t.state(K) is SessionState.LOCKED and t.lease(K) == 7
    assert t.answer(K).hits == 3 and t.state(K) is SessionState.LOCKED  # answered, still locked
    assert t.hand_over(K, KEYS[:3], 1) == 7
    assert session.state is SessionState.ENDED and t.state(K) is None  # the lease is the retrieve's now
    assert t.lease(K) == NO_LEASE and t.hand_over(K, KEYS[:3], 0) == NO_LEASE  # handed once
    assert t.end(K) == NO_LEASE


def test_a_retrieve_of_other_chunks_does_not_take_the_lease():
    t = SessionTable()
    t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    assert t.hand_over(K, KEYS[3:6], 0) == NO_LEASE  # other keys
    assert t.hand_over(K, KEYS[:3], 3) == NO_LEASE  # past the locked ones
    assert t.state(K) is SessionState.LOCKED and t.lease(K) == 7


def test_a_prefetch_ends_locked_or_known():
    t = SessionTable()
    s, _ = t.open(K, LeaseId(7), KEYS[:1], 1, lock=True, prefetch_keys=KEYS)
    assert t.state(K) is SessionState.PREFETCHING and t.answer(K).hits is None
    assert t.hand_over(K, KEYS, 0) == NO_LEASE  # not before the count is known
    assert t.prefetched(K, s, 4, lambda keys: (LeaseId(9), len(keys))) == 7  # the first lock, for the caller
    assert t.state(K) is SessionState.LOCKED and t.lease(K) == 9 and t.answer(K).hits == 4

    k2 = (ContextId(1), "req-2")
    s2, _ = t.open(k2, NO_LEASE, [], 0, lock=False, prefetch_keys=KEYS)
    assert t.prefetched(k2, s2, 2, lambda keys: pytest.fail("a lock-free session locks nothing")) == NO_LEASE
    assert t.state(k2) is SessionState.KNOWN
    assert t.answer(k2).hits == 2 and t.state(k2) is None and s2.state is SessionState.ENDED


def test_a_prefetch_that_locks_fewer_chunks_than_it_loaded_says_so():
    t = SessionTable()
    s, _ = t.open(K, NO_LEASE, [], 0, lock=True, prefetch_keys=KEYS)
    t.prefetched(K, s, 5, lambda keys: (LeaseId(3), 2))  # three went between the load and the lock
    assert s.hits == 2 and s.keys == KEYS[:2] and t.answer(K).hits == 2


def test_a_prefetch_that_ends_after_its_session_changes_nothing():
    t = SessionTable()
    first, _ = t.open(K, LeaseId(7), KEYS[:1], 1, lock=True, prefetch_keys=KEYS)
    _, old = t.open(K, LeaseId(8), KEYS[:2], 2, lock=True, prefetch_keys=None)  # a new lookup, same id
    assert old == 7 and first.state is SessionState.ENDED
    assert t.prefetched(K, first, 5, lambda keys: pytest.fail("must not lock")) is None  # replaced: nothing to do
    assert t.state(K) is SessionState.LOCKED and t.lease(K) == 8


def test_a_table_refuses_to_lock_a_session_that_is_no_longer_prefetching():
    t = SessionTable()
    s, _ = t.open(K, LeaseId(7), KEYS[:3], 3, lock=True, prefetch_keys=None)
    with pytest.raises(IllegalTransition):
        t.prefetched(K, s, 5, lambda keys: pytest.fail("an illegal transition must take no lease"))
    assert (t.state(K), t.lease(K)) == (SessionState.LOCKED, 7)


def test_ending_a_context_ends_its_sessions_only():
    t = SessionTable()
    t.open((ContextId(1), "a"), LeaseId(1), KEYS[:1], 1, lock=True, prefetch_keys=None)
    t.open((ContextId(1), "b"), LeaseId(2), KEYS[:1], 1, lock=True, prefetch_keys=None)
    t.open((ContextId(2), "a"), LeaseId(3), KEYS[:1], 1, lock=True, prefetch_keys=None)
    assert sorted(t.end_context(ContextId(1))) == [1, 2]
    assert len(t) == 1 and t.lease((ContextId(2), "a")) == 3


def test_sessions_nobody_ends_expire_and_live_ones_stay():
    now = [0.0]
    t = SessionTable(clock=lambda: now[0])
    alive = {LeaseId(1)}
    t.open((ContextId(1), "held"), LeaseId(1), KEYS[:1], 1, lock=True, prefetch_keys=None)  # its lease lives
    t.open((ContextId(1), "dead"), LeaseId(2), KEYS[:1], 1, lock=True, prefetch_keys=None)  # its lease expired
    s, _ = t.open((ContextId(1), "known"), NO_LEASE, [], 0, lock=False, prefetch_keys=KEYS)
    t.prefetched((ContextId(1), "known"), s, 2, lambda keys: (NO_LEASE, 0))  # KNOWN, never asked
    t.open((ContextId(2), "loading"), LeaseId(3), KEYS[:1], 1, lock=True, prefetch_keys=KEYS)
    assert t.expire(60, 600, alive.__contains__) == [(ContextId(1), LeaseId(2))]  # only the dead lease's, at once
    assert t.hand_over((ContextId(1), "dead"), KEYS[:1], 0) == NO_LEASE  # a retrieve locks afresh
    now[0] = 61.0
    assert t.expire(60, 600, alive.__contains__) == [(ContextId(1), NO_LEASE)]  # the KNOWN one, idle a TTL
    now[0] = 659.0
    assert t.expire(60, 600, alive.__contains__) == []  # a prefetch has its own bound first
    now[0] = 661.0
    assert t.expire(60, 600, alive.__contains__) == [(ContextId(2), LeaseId(3))]
    assert len(t) == 1 and t.lease((ContextId(1), "held")) == 1  # renewed: it stays however old


# --- prefetch jobs --------------------------------------------------------------------------------------


def job_in(state: PrefetchState) -> PrefetchJob:
    j = PrefetchJob(list(KEYS), 1, 64, "", lambda n: None)
    if state is PrefetchState.LOAD:
        j.start_load(LeaseId(5), KEYS[1:3], 2, 2)
    elif state is PrefetchState.DONE:
        j.finish()
    return j


def test_every_prefetch_job_transition_from_every_state():
    P = PrefetchState
    check_machine(
        job_in,
        list(P),
        {
            "next_tier": (lambda j: j.next_tier(), {P.LOOKUP}, P.LOOKUP),
            "start_load": (lambda j: j.start_load(LeaseId(2), KEYS[1:2], 1, 1), {P.LOOKUP}, P.LOAD),
            "supplied": (lambda j: j.supplied(1, complete=True), {P.LOOKUP, P.LOAD}, P.LOOKUP),
            "finish": (lambda j: j.finish(), {P.LOOKUP, P.LOAD}, P.DONE),
        },
        lambda j: j.state,
    )


def test_a_prefetch_job_walks_the_tiers():
    j = job_in(PrefetchState.LOOKUP)
    j.next_tier()  # tier 0 had none
    assert (j.state, j.tier) == (PrefetchState.LOOKUP, 1)
    j.start_load(LeaseId(5), KEYS[1:3], 2, 2)
    assert j.supplied(2, complete=True) is True  # all it had: ask the next tier for the rest
    assert (j.state, j.tier, j.start, j.loaded) == (PrefetchState.LOOKUP, 2, 3, 2)
    assert j.supplied(1, complete=False) is False  # a chunk failed: the prefix ends here
    assert j.finish() == 3 and j.state is PrefetchState.DONE


# --- client liveness ------------------------------------------------------------------------------------


def record_in(state: ClientState) -> ClientRecord:
    rec = ClientRecord(ClientId(b"c" * 16), 0.0, info=ClientInfo(pid=1))
    if state is ClientState.REVOKED:
        rec.revoke(Revocation("silent", 0.0))
    return rec


def test_every_liveness_transition_from_every_state():
    C = ClientState
    check_machine(
        record_in,
        list(C),
        {
            "revoke": (lambda r: r.revoke(Revocation("silent again", 1.0)), {C.ACTIVE}, C.REVOKED),
            "resume": (lambda r: r.resume(), {C.REVOKED}, C.ACTIVE),
        },
        lambda r: r.state,
    )


# --- a vLLM request in the scheduler --------------------------------------------------------------------


def request_in(phase: Phase = Phase.NEW, locks: Locks = Locks.NONE) -> RequestState:
    st = RequestState("r1", "the vLLM request", "", True)
    st.phase, st.locks = phase, locks
    if locks is Locks.PLANNED:
        st.pending_load = "a planned load"  # type: ignore[assignment]
    return st


def test_every_phase_transition_from_every_phase():
    P = Phase
    check_machine(
        request_in,
        list(P),
        {
            "begin_lookup": (lambda st: st.begin_lookup(), {P.NEW}, P.LOOKING),
            "looked": (lambda st: st.looked(2), {P.NEW, P.LOOKING}, P.LOOKED),
            "admit": (lambda st: st.admit(), {P.NEW, P.LOOKED}, P.ADMITTED),
            "preempt": (lambda st: st.preempt(), {P.LOOKING, P.LOOKED, P.ADMITTED}, P.NEW),
        },
        lambda st: st.phase,
    )


def test_every_locks_transition_from_every_state():
    L = Locks
    check_machine(
        lambda locks: request_in(Phase.ADMITTED, locks),
        list(L),
        {
            "open_session": (lambda st: st.open_session(), {L.NONE}, L.HELD),
            "plan_load": (lambda st: st.plan_load(object()), {L.HELD}, L.PLANNED),  # type: ignore[arg-type]
            "hand_to_workers": (lambda st: st.hand_to_workers(), {L.PLANNED}, L.LOADING),
            "loaded": (lambda st: st.loaded(), {L.LOADING}, L.HELD),
            "close_session": (lambda st: st.close_session(), {L.HELD, L.PLANNED, L.LOADING}, L.NONE),
        },
        lambda st: st.locks,
    )


@pytest.mark.parametrize("locks", [Locks.HELD, Locks.PLANNED, Locks.LOADING])
def test_a_request_is_never_preempted_while_the_server_holds_its_locks(locks):
    st = request_in(Phase.ADMITTED, locks)
    before = snapshot(st)
    with pytest.raises(IllegalTransition):
        st.preempt()
    assert snapshot(st) == before


def test_a_planned_load_goes_to_the_workers_once():
    st = request_in(Phase.ADMITTED, Locks.HELD)
    op = object()
    st.plan_load(op)  # type: ignore[arg-type]
    assert st.hand_to_workers() is op and st.pending_load is None
    with pytest.raises(IllegalTransition):
        st.hand_to_workers()


# --- the prefaulter -------------------------------------------------------------------------------------


def test_a_prefaulter_runs_once(tmp_path):
    arena = SharedArena.create(1 << 20, shm_dir=str(tmp_path))
    try:
        p = Prefaulter(arena, step_bytes=1 << 18)
        assert p.state is PrefaultState.IDLE
        p.start()
        assert p.wait(10) and p.state in (PrefaultState.DONE, PrefaultState.UNSUPPORTED)
        end = p.state
        with pytest.raises(IllegalTransition):
            p.start()
        assert p.state is end
    finally:
        arena.close()


# --- the circuit breaker --------------------------------------------------------------------------------


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker_in(state: BreakerState, clock: Clock) -> CircuitBreaker:
    b = CircuitBreaker(2.0, clock=clock)
    if state is not BreakerState.UP:
        b.failed("down")
    if state is BreakerState.PROBING:
        clock.now += 2.0
        assert b.admit()
    return b


# (state, event) -> (what the event returns, the state after); every pair is legal (breaker.py).
BREAKER_TABLE = {
    (BreakerState.UP, "admit"): (True, BreakerState.UP),
    (BreakerState.UP, "failed"): (True, BreakerState.DOWN),  # True: it was up (worth a warning)
    (BreakerState.UP, "succeeded"): (False, BreakerState.UP),
    (BreakerState.DOWN, "admit"): (False, BreakerState.DOWN),  # within the retry interval: fail fast
    (BreakerState.DOWN, "failed"): (False, BreakerState.DOWN),
    (BreakerState.DOWN, "succeeded"): (True, BreakerState.UP),  # a call started earlier came back fine
    (BreakerState.PROBING, "admit"): (False, BreakerState.PROBING),  # one probe at a time
    (BreakerState.PROBING, "failed"): (False, BreakerState.DOWN),
    (BreakerState.PROBING, "succeeded"): (True, BreakerState.UP),
}


@pytest.mark.parametrize("state, event", list(BREAKER_TABLE), ids=lambda v: getattr(v, "value", v))
def test_every_breaker_event_in_every_state(state, event):
    clock = Clock()
    b = breaker_in(state, clock)
    result = b.admit() if event == "admit" else b.failed("x") if event == "failed" else b.succeeded()
    assert (result, b.state) == BREAKER_TABLE[(state, event)]
    assert len(BREAKER_TABLE) == len(BreakerState) * 3


def test_a_down_breaker_lets_one_probe_through_per_interval():
    clock = Clock()
    b = breaker_in(BreakerState.DOWN, clock)
    assert not b.admit() and b.last_error == "down"
    clock.now += 2.0
    assert b.admit() and b.state is BreakerState.PROBING and not b.admit()
    clock.now += 2.0
    assert b.admit()  # a hung probe does not block forever: another after the next interval
    assert b.succeeded() and b.up and b.admit() and b.admit()
