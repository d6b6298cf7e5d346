"""Hits you can see: a real server counts engines' lookups, the tokens they asked for, found (in L1, or
per L2 tier that supplied them) and missed, and what they stored and read back, per model, in
``/status`` and ``/metrics``; a store's own check of what is stored already is no lookup."""

from __future__ import annotations

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens, wait_until
from support.tiers import fs_spec, wait_store_idle


def lookups(srv) -> dict:
    return srv.status()["lookups"]


def test_lookups_hits_and_misses_are_counted_per_model(make_server, seed):
    srv = make_server()
    tokens = make_tokens(4 * CHUNK, seed)
    other = make_tokens(3 * CHUNK, seed + 1)
    kv = make_kv(LAYOUT, len(tokens), seed)
    for transport in ("shm", "inline"):  # the inline store checks what is stored first: not a lookup
        with srv.client(model=f"m-{transport}", transport=transport) as c:
            assert c.store(tokens, kv) == 4 * CHUNK
            assert c.lookup(tokens) == 4 * CHUNK  # 4 chunks found
            assert c.lookup(other) == 0  # 3 missed
            assert c.retrieve(tokens).shape[2] == 4 * CHUNK
    doc = lookups(srv)
    for transport in ("shm", "inline"):
        assert doc["by_model"][f"m-{transport}"] == {
            "requests": 2,
            "requested_tokens": 7 * CHUNK,
            "hit_tokens": 4 * CHUNK,
            "missed_tokens": 3 * CHUNK,
            "hit_tokens_by_tier": {"l1": 4 * CHUNK},
        }
    assert (doc["requests"], doc["hit_tokens"], doc["missed_tokens"]) == (4, 8 * CHUNK, 6 * CHUNK)
    assert doc["hit_rate"] == round(8 / 14, 4) and doc["hit_tokens_by_tier"] == {"l1": 8 * CHUNK}
    st = srv.status()
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    assert st["stores"]["by_model"]["m-shm"] == {"chunks": 4, "bytes": 4 * chunk_bytes}
    assert st["stores"]["by_model"]["m-inline"] == {"chunks": 4, "bytes": 4 * chunk_bytes}
    assert st["retrieves"]["chunks"] == 8 and st["retrieves"]["bytes"] == 8 * chunk_bytes
    # the same numbers on /metrics
    assert srv.metric("kvdepot_hit_tokens_total", model="m-shm", tier="l1") == 4 * CHUNK
    assert srv.metric("kvdepot_missed_tokens_total", model="m-inline") == 3 * CHUNK
    assert srv.metric("kvdepot_lookups_total", model="m-inline") == 2
    assert srv.metric("kvdepot_stored_bytes_total", model="m-shm") == 4 * chunk_bytes


def test_hits_from_l2_are_counted_under_the_tier_that_supplied_them(make_server, tmp_path, seed):
    srv = make_server("--l2", fs_spec(tmp_path / "fs", name="disk"))
    tokens = make_tokens(3 * CHUNK, seed)
    with srv.client() as c:
        assert c.store(tokens[: 2 * CHUNK], make_kv(LAYOUT, 2 * CHUNK, seed)) == 2 * CHUNK
        wait_store_idle(srv, accounted=2)
        srv.clear()  # L1 only: the fs tier keeps both chunks
        session = c.session("r1")
        hits = session.lookup(c.hashes(tokens))  # 2 in the tier, 1 nowhere: a prefetch
        while hits is None:
            hits = session.status()
        assert hits == 2
        session.end()
    doc = wait_until(lambda: (d := lookups(srv))["missed_tokens"] and d, what="the prefetch to be counted")
    assert (doc["requests"], doc["requested_tokens"]) == (1, 3 * CHUNK)
    assert doc["hit_tokens_by_tier"] == {"disk": 2 * CHUNK}  # none was in L1 at the lookup
    assert (doc["hit_tokens"], doc["missed_tokens"]) == (2 * CHUNK, CHUNK)


def test_a_prefetch_credits_its_tier_only_with_the_chunks_it_loaded(make_server, tmp_path, seed):
    """A prompt whose chunks are partly in L1 past a gap (another request stored them): the prefetch loads
    the gap from the tier and finds the rest in L1. Those were L1 hits; they were counted as the tier's
    (so kvdepot_hit_tokens_total{tier} said the tier supplied more than it loaded)."""
    srv = make_server("--l2", fs_spec(tmp_path / "fs", name="disk"))
    tokens = make_tokens(5 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(transport="shm") as c:
        assert c.store(tokens, kv) == 5 * CHUNK
        wait_store_idle(srv, accounted=5)
        srv.clear()  # L1 only: the fs tier keeps all five
        hashes = c.hashes(tokens)
        for first, n in ((0, 2), (3, 1)):  # chunks 0, 1 and 3 back in L1; 2 and 4 in the tier only
            with c.prepare_store(hashes[first : first + n]) as slots:
                for i, slot in enumerate(slots):
                    slot[...] = kv[:, :, (first + i) * CHUNK : (first + i + 1) * CHUNK]
        session = c.session("r1")
        hits = session.lookup(hashes)
        while hits is None:
            hits = session.status()
        assert hits == 5
        session.end()
    doc = wait_until(lambda: (d := lookups(srv))["hit_tokens"] and d, what="the prefetch to be counted")
    assert srv.status()["l2_controllers"]["prefetch"]["chunks_loaded"] == 2
    assert doc["hit_tokens_by_tier"] == {"l1": 3 * CHUNK, "disk": 2 * CHUNK}
    assert (doc["hit_tokens"], doc["missed_tokens"]) == (5 * CHUNK, 0)
