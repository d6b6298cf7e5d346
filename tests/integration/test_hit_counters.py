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
