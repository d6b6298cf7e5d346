"""The server's context registry: its indexes agree with its contexts through adds and removals, and a
registration's checks and a client's goodbye look at that model's or that client's contexts only (one
client registering thousands made every registration scan them all, on the loop that serves everyone)."""

from __future__ import annotations

from kvdepot.keys import NamespaceSpec
from kvdepot.layout import KVLayout
from kvdepot.server import state
from kvdepot.server.state import ContextRegistry
from kvdepot.types import ClientId

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16)


def spec(model: str = "m", rank: int = 0, chunk: int = 256) -> NamespaceSpec:
    return NamespaceSpec(model, 2, rank, LAYOUT.fingerprint(), chunk)


def test_conflicts_owners_and_goodbyes_follow_adds_and_removals():
    reg = ContextRegistry()
    a, b = ClientId(b"a" * 16), ClientId(b"b" * 16)
    first = reg.add(a, LAYOUT, spec(), "chain-v1")
    reg.add(a, LAYOUT, spec(rank=1), "chain-v1")
    other = reg.add(b, LAYOUT, spec(), "")  # unnamed scheme: shares with any
    assert reg.owned_by(a) == 2 and reg.owned_by(b) == 1 and len(reg) == 3
    assert reg.cannot_share_with(spec(), "chain-v1") is None
    assert reg.cannot_share_with(spec(), "") is None
    ctx, differ = reg.cannot_share_with(spec(chunk=128), "chain-v1")
    assert ctx in (first, other) and differ == {"chunk_size": "256"}
    ctx, differ = reg.cannot_share_with(spec(), "chain-v2")
    assert ctx is first and differ == {"hash_scheme": "chain-v1"}
    assert reg.cannot_share_with(spec(model="n", chunk=128), "x") is None  # another model: nothing to share
    assert reg.remove(first.id, a) is first
    assert reg.cannot_share_with(spec(), "chain-v2") is None  # the other one left names no scheme
    gone = reg.remove_owner(a)
    assert [c.spec.rank for c in gone] == [1] and reg.owned_by(a) == 0
    assert reg.remove_owner(b) == [other] and len(reg) == 0
    assert reg.cannot_share_with(spec(chunk=128), "chain-v1") is None
    assert reg._by_owner == {} and reg._by_group == {}, "an emptied index keeps entries"


def test_a_registration_looks_at_its_models_terms_not_at_every_context(monkeypatch):
    reg = ContextRegistry()
    owners = [ClientId(i.to_bytes(16, "little")) for i in range(2000)]
    for i, owner in enumerate(owners):
        reg.add(owner, LAYOUT, spec(rank=i % 2), "chain-v1")
    looked = []
    real_terms = state.Context.terms
    monkeypatch.setattr(state.Context, "terms", lambda self: looked.append(self) or real_terms(self))
    assert reg.cannot_share_with(spec(), "chain-v1") is None
    assert reg.cannot_share_with(spec(chunk=128), "chain-v1") is not None
    assert reg.owned_by(owners[7]) == 1
    assert len(looked) == 0, f"{len(looked)} contexts looked at for one registration"
    assert len(reg.remove_owner(owners[7])) == 1
    assert len(looked) <= 1  # the goodbye reads its own context's terms, nobody else's
