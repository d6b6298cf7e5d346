"""Two Valkey tiers on one server whose prefixes are ``p`` and ``p1a``: each one's names are its own.
The old single-server names were ``<prefix><key hex>``, so a clear of ``p`` (SCAN ``p*``) took
``p1a<hex>`` for one of its objects (``1a<hex>`` is hex) and deleted the other tier's. A real
valkey-server of the test's own (``own_valkey``), so the short prefixes meet nobody else's keys."""

from __future__ import annotations

import os

import pytest
import valkey

from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter

from support.adapter_tasks import load, run, store
from support.backends import ValkeyServer, valkey_config

MiB = 1 << 20
SIZES = (100, 5000, 2 * MiB + 7)  # inline, inline, in parts (max_value_mib=1)


@pytest.fixture
def tiers(own_valkey: ValkeyServer):
    """{prefix: started adapter} for ``p`` and ``p1a`` on one server."""
    made = {prefix: ValkeyAdapter(prefix, valkey_config(own_valkey.url, prefix=prefix, max_value_mib=1)) for prefix in ("p", "p1a")}
    for adapter in made.values():
        adapter.start()
    yield made
    for adapter in made.values():
        adapter.close()


def _fill(adapter: ValkeyAdapter) -> dict[bytes, bytes]:
    objects = {os.urandom(48): os.urandom(n) for n in SIZES}
    for key, value in objects.items():
        assert store(adapter, key, value).value == [True]
    return objects


def _loaded(adapter: ValkeyAdapter, objects: dict[bytes, bytes]) -> int:
    """How many of ``objects`` load back byte-exact."""
    hits = 0
    for key, value in objects.items():
        result, got = load(adapter, key, len(value))
        hits += result.value == [True] and got == value
    return hits


@pytest.mark.parametrize("cleared", ["p", "p1a"])
def test_a_valkey_clear_leaves_a_tier_whose_prefix_extends_its_own_whole(tiers, cleared) -> None:
    kept = "p1a" if cleared == "p" else "p"
    objects = {prefix: _fill(adapter) for prefix, adapter in tiers.items()}
    r = run(tiers[cleared], tiers[cleared].submit_clear())
    assert r.ok and r.value == len(SIZES), r
    assert _loaded(tiers[kept], objects[kept]) == len(SIZES), f"clearing {cleared!r} deleted objects of {kept!r}"
    assert tiers[kept].usage().objects == len(SIZES)
    assert _loaded(tiers[cleared], objects[cleared]) == 0
    assert tiers[cleared].usage().objects == 0


def test_two_prefixes_name_disjoint_keys(tiers, own_valkey: ValkeyServer) -> None:
    """Every key on the server belongs to exactly one tier: none of ``p1a``'s names is one ``p`` could
    have written (a brace follows the prefix, and hex has none)."""
    for adapter in tiers.values():
        _fill(adapter)
    raw = valkey.Valkey.from_url(own_valkey.url)
    try:
        names = list(raw.scan_iter(match="*"))
    finally:
        raw.close()
    p_names = set(tiers["p"]._our_objects()) | {b"p#objects"}
    p1a_names = set(tiers["p1a"]._our_objects()) | {b"p1a#objects"}
    assert not p_names & p1a_names
    assert set(names) == p_names | p1a_names
    assert len(p_names) == len(p1a_names) == len(SIZES) + 3 + 1  # manifests, 3 parts, the counter
