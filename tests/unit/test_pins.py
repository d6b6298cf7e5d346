"""The lifecycle protections (storage/pins.py): the pin and agent-session state machines with a fake
clock, their illegal transitions, and the object table honouring them (no eviction of any kind, quota
still counted)."""

from __future__ import annotations

import pytest

from kvdepot.errors import IllegalTransition
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.eviction import make_policy
from kvdepot.storage.l1 import ObjectTable
from kvdepot.storage.pins import PinRefused, PinState, Protections, SessionState, UnknownAgentSession, UnknownPin
from kvdepot.types import ClientId, ObjectKey, SlotStatus

SLOT = 64
OWNER = ClientId(b"owner")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(i: int, ns: bytes = b"N") -> ObjectKey:
    return ObjectKey(ns * 16 + i.to_bytes(32, "big"))


def keys(*ids: int, ns: bytes = b"N") -> list[ObjectKey]:
    return [key(i, ns) for i in ids]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def prot(clock) -> Protections:
    return Protections(session_ttl_s=30.0, clock=clock)


# --- pins -------------------------------------------------------------------------------------------


def test_hard_pin_protects_until_unpinned_and_never_expires(prot, clock):
    info = prot.pin("", [(key(1), 10), (key(2), 10)])
    assert (info.state, info.pinned, info.bytes, info.expires_in_s) == (PinState.HARD, 2, 20, None)
    clock.now += 10**6
    assert prot.expire() == (0, 0)
    assert prot.is_protected(key(1)) and prot.is_protected(key(2))
    assert prot.unpin(info.id).state is PinState.RELEASED
    assert not prot.is_protected(key(1)) and not prot.is_protected(key(2))
    assert prot.pins() == []


def test_soft_pin_expires_at_its_deadline_and_can_be_extended_first(prot, clock):
    info = prot.pin("s", [(key(1), 10)], ttl_s=5.0)
    assert info.state is PinState.SOFT and info.expires_in_s == 5.0
    clock.now += 4.0
    assert prot.extend(info.id, 5.0).expires_in_s == 5.0  # now + 5
    clock.now += 4.0
    assert prot.expire() == (0, 0) and prot.is_protected(key(1))
    clock.now += 1.0
    assert prot.expire() == (1, 0)
    assert not prot.is_protected(key(1))
    assert prot.pinned_bytes("s") == 0


def test_illegal_pin_transitions_raise_and_change_nothing(prot, clock):
    hard = prot.pin("", [(key(1), 10)])
    with pytest.raises(IllegalTransition, match="hard"):
        prot.extend(hard.id, 10.0)
    soft = prot.pin("", [(key(2), 10)], ttl_s=1.0)
    clock.now += 2.0
    prot.expire()
    for verb in (prot.unpin, lambda i: prot.extend(i, 5.0)):
        with pytest.raises(IllegalTransition, match="expired"):
            verb(soft.id)
    prot.unpin(hard.id)
    with pytest.raises(IllegalTransition, match="released"):
        prot.unpin(hard.id)
    with pytest.raises(UnknownPin):
        prot.unpin(999)
    with pytest.raises(IllegalTransition):
        prot.pin("", [(key(3), 10)], ttl_s=0.0)
    with pytest.raises(IllegalTransition):
        prot.pin("", [(key(3), 10)], ttl_s=-1.0)
    assert prot.pins() == [] and not any(prot.is_protected(k) for k in keys(1, 2, 3))


def test_two_pins_of_one_key_protect_it_until_both_end(prot):
    a = prot.pin("s", [(key(1), 10)])
    b = prot.pin("s", [(key(1), 10), (key(2), 10)])
    assert prot.pinned_bytes("s") == 20  # distinct keys, not pins
    prot.unpin(a.id)
    assert prot.is_protected(key(1)) and prot.pinned_bytes("s") == 20
    prot.unpin(b.id)
    assert not prot.is_protected(key(1)) and prot.pinned_bytes("s") == 0


def test_pinned_bytes_may_not_exceed_the_salt_quota(clock):
    quotas = {"t": 25}
    prot = Protections(quota_of=quotas.get, clock=clock)
    prot.pin("t", [(key(1), 10), (key(2), 10)])
    with pytest.raises(PinRefused, match="quota"):
        prot.pin("t", [(key(3), 10)])
    assert not prot.is_protected(key(3))
    prot.pin("t", [(key(1), 10)])  # already pinned: no new bytes
    prot.pin("other", [(key(3), 10)])  # no quota
    assert prot.pinned_bytes("t") == 20


# --- agent sessions -----------------------------------------------------------------------------------


def test_a_turn_moves_the_protection_to_the_new_prefix(prot):
    prot.touch("s", "conv", keys(1, 2))
    assert prot.is_protected(key(1)) and prot.is_protected(key(2))
    prot.touch("s", "conv", keys(1, 2, 3, 4))  # the next turn extends the conversation
    assert all(prot.is_protected(k) for k in keys(1, 2, 3, 4))
    prot.touch("s", "conv", keys(1))  # a lookup of part of it does not shrink it
    assert all(prot.is_protected(k) for k in keys(1, 2, 3, 4))
    prot.touch("s", "conv", keys(1, 5))  # an edited conversation: the old tail is let go
    assert [prot.is_protected(k) for k in keys(1, 2, 3, 4, 5)] == [True, False, False, False, True]


def test_namespaces_keep_their_own_prefix_under_one_session(prot):
    prot.touch("s", "conv", keys(1, 2, ns=b"A"))
    prot.touch("s", "conv", keys(7, ns=b"B"))  # another rank of the same engine
    assert prot.is_protected(key(2, b"A")) and prot.is_protected(key(7, b"B"))
    assert prot.sessions()[0].keys == 3


def test_each_turn_renews_and_a_silent_session_expires(prot, clock):
    prot.touch("s", "conv", keys(1))
    clock.now += 25.0
    prot.touch("s", "conv", keys(1, 2))
    clock.now += 25.0
    assert prot.expire() == (0, 0) and prot.is_protected(key(1))
    clock.now += 5.0
    assert prot.expire() == (0, 1)
    assert not prot.is_protected(key(1)) and not prot.is_protected(key(2))
    assert prot.session_state("s", "conv") is SessionState.EXPIRED
    prot.touch("s", "conv", keys(3))  # a later turn opens a new session under the name
    assert prot.session_state("s", "conv") is SessionState.OPEN and prot.is_protected(key(3))


def test_illegal_session_transitions_raise_and_change_nothing(prot, clock):
    with pytest.raises(UnknownAgentSession):
        prot.renew("s", "never")
    with pytest.raises(UnknownAgentSession):
        prot.close("s", "never")
    prot.touch("s", "conv", keys(1))
    assert prot.close("s", "conv").state is SessionState.CLOSED
    assert not prot.is_protected(key(1))
    with pytest.raises(IllegalTransition, match="closed"):
        prot.close("s", "conv")
    with pytest.raises(IllegalTransition, match="closed"):
        prot.renew("s", "conv")
    prot.touch("s", "short", keys(2), ttl_s=1.0)
    clock.now += 1.0
    prot.expire()
    with pytest.raises(IllegalTransition, match="expired"):
        prot.renew("s", "short")
    with pytest.raises(IllegalTransition):
        prot.touch("s", "", keys(1))
    with pytest.raises(IllegalTransition):
        prot.touch("s", "x", keys(1), ttl_s=0.0)
    assert prot.sessions() == [] and not prot.is_protected(key(2))


def test_a_salt_is_part_of_the_session_identity(prot):
    prot.touch("a", "conv", keys(1))
    prot.touch("b", "conv", keys(2))
    prot.close("a", "conv")
    assert not prot.is_protected(key(1)) and prot.is_protected(key(2))


# --- the object table honours them ---------------------------------------------------------------------


def table(prot: Protections, slots: int = 4, policy: str = "lru") -> ObjectTable:
    return ObjectTable(ExtentAllocator(slots * SLOT, alignment=SLOT), make_policy(policy), protected=prot.is_protected, pinned=prot.is_pinned)


def store(t: ObjectTable, ids, salt: str = "") -> None:
    res = t.reserve_write(keys(*ids), SLOT, OWNER, salt)
    assert all(s == SlotStatus.ALLOCATED for s in res.statuses), res.statuses
    t.commit_write(res.lease_id, OWNER)


def test_protected_objects_survive_make_room_watermark_and_discard(prot):
    t = table(prot)
    store(t, [1, 2])
    t.with_ready_prefix(keys(1, 2, 9), lambda found: prot.pin("", [(k, size) for k, size, _ in found]))
    store(t, [3, 4])
    store(t, [5, 6])  # make room: only 3 and 4 may go
    assert t.lookup(keys(1, 2)) == 2 and t.lookup(keys(3)) == 0
    assert t.evict_to(0) == 2  # the watermark path: 5 and 6 go, 1 and 2 stay
    assert t.lookup(keys(1, 2)) == 2
    assert t.discard(keys(1, 2)) == 0
    res = t.reserve_write(keys(7, 8, 10), SLOT, OWNER)
    assert res.statuses == [SlotStatus.ALLOCATED, SlotStatus.ALLOCATED, SlotStatus.NO_SPACE]
    t.abort_write(res.lease_id, OWNER)
    t.check_invariants()


def test_pinned_bytes_count_against_the_quota_and_the_others_go(prot):
    t = table(prot, slots=8, policy="isolated_lru")
    store(t, [1, 2, 3, 4], salt="t")
    t.with_ready_prefix(keys(1, 2), lambda found: prot.pin("t", [(k, size) for k, size, _ in found]))
    t.policy.set_quota("t", 3 * SLOT)
    assert t.enforce_quotas() == 1  # 4 chunks against a quota of 3: one unpinned one goes
    assert t.lookup(keys(1, 2)) == 2
    t.policy.set_quota("t", 1 * SLOT)  # below what is pinned: every unpinned one goes, the pinned stay
    t.enforce_quotas()
    assert t.lookup(keys(1, 2)) == 2 and t.policy.used("t") == 2 * SLOT
    t.check_invariants()


def test_a_tenant_makes_room_in_its_quota_from_its_own_objects_never_from_the_others(prot):
    """A batch larger than its tenant's quota used to be reserved whole, evicting other tenants' objects
    to make room (then trimmed back to the quota): one small tenant could flush everyone's cache."""
    t = table(prot, slots=10, policy="isolated_lru")
    store(t, range(100, 110), salt="b")  # L1 full of tenant b
    t.policy.set_quota("a", 2 * SLOT)
    res = t.reserve_write(keys(1, 2, 3, 4, 5), SLOT, OWNER, "a")
    AL, OQ = SlotStatus.ALLOCATED, SlotStatus.OVER_QUOTA
    assert res.statuses == [AL, AL, OQ, OQ, OQ]
    t.commit_write(res.lease_id, OWNER)
    assert t.policy.used("b") == 8 * SLOT and t.policy.used("a") == 2 * SLOT  # b lost two objects, not five
    store(t, [6, 7], salt="a")  # at its quota: its own oldest make room
    assert t.lookup(keys(1)) == 0 and t.lookup(keys(2)) == 0 and t.lookup(keys(6, 7)) == 2
    assert t.policy.used("b") == 8 * SLOT and t.policy.used("a") == 2 * SLOT
    t.check_invariants()


def test_a_quota_counts_what_its_tenant_is_still_writing(prot):
    """Concurrent batches of one tenant were each checked against what it held READY: each fit, and
    together they overran its quota until the trim (evicting other tenants' objects meanwhile)."""
    t = table(prot, slots=10, policy="isolated_lru")
    t.policy.set_quota("a", 3 * SLOT)
    AL, OQ = SlotStatus.ALLOCATED, SlotStatus.OVER_QUOTA
    first = t.reserve_write(keys(1, 2), SLOT, OWNER, "a")
    second = t.reserve_write(keys(3, 4), SLOT, ClientId(b"other engine"), "a")  # before the first commits
    assert first.statuses == [AL, AL] and second.statuses == [AL, OQ]
    t.check_invariants()
    t.commit_write(first.lease_id, OWNER)
    t.abort_write(second.lease_id, ClientId(b"other engine"))
    t.check_invariants()
    res = t.reserve_write(keys(5), SLOT, OWNER, "a")  # the aborted write's bytes are counted no more
    assert res.statuses == [AL]
    t.commit_write(res.lease_id, OWNER)
    res = t.reserve_write(keys(6), SLOT, OWNER, "a")  # at its quota: its own oldest makes room
    assert res.statuses == [AL] and t.get(key(2)) is None  # (a batch's tail is its oldest)
    t.commit_write(res.lease_id, OWNER)
    assert t.policy.used("a") == 3 * SLOT
    t.check_invariants()


def test_agent_sessions_keep_a_tenant_within_its_quota_not_beyond_it(prot):
    """Agent sessions protected keys without limit, and eviction, the quota trim and make-room all
    spared them: a tenant could hold L1 past its quota for as long as it kept its sessions going."""
    t = table(prot, slots=10, policy="isolated_lru")
    prot.touch("a", "conversation", keys(1, 2, 3, 4))
    t.policy.set_quota("a", 4 * SLOT)
    store(t, [1, 2, 3, 4], salt="a")
    res = t.reserve_write(keys(5), SLOT, OWNER, "a")  # its own are all its session's: no room in its quota
    assert res.statuses == [SlotStatus.OVER_QUOTA]
    t.policy.set_quota("a", 2 * SLOT)  # lowered: the session does not hold it past it
    assert t.enforce_quotas() == 2
    assert t.policy.used("a") == 2 * SLOT
    t.check_invariants()


def test_remove_deletes_pinned_objects_and_dooms_locked_ones(prot):
    t = table(prot)
    store(t, [1, 2, 3])
    prot.pin("", [(key(1), SLOT)])
    lock = t.acquire_read(keys(3), OWNER)
    assert t.remove(keys(1, 2, 3, 9)) == (2, 1)
    assert t.lookup(keys(1)) == 0 and t.lookup(keys(3)) == 0  # the locked one is invisible already
    assert t.get(key(3)) is not None  # ...but its bytes stay until its reader is done
    t.release_read(lock.lease_id, OWNER)
    assert t.get(key(3)) is None
    t.check_invariants()


def test_an_eviction_scan_moves_pinned_keys_out_of_the_way_of_the_next(prot):
    t = table(prot)
    for i in (1, 2, 3, 4):
        store(t, [i])
    t.with_ready_prefix(keys(1, 2), lambda found: prot.pin("", [(k, size) for k, size, _ in found]))
    assert list(t.policy.candidates()) == keys(1, 2, 3, 4)  # oldest first
    store(t, [5])  # makes room: walks past 1 and 2, evicts 3, and moves 1 and 2 to the recent end
    assert list(t.policy.candidates()) == keys(4, 1, 2, 5)
    t.check_invariants()
