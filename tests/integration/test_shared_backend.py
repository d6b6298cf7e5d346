"""Several kvdepot servers over one L2 backend: one Valkey (or Valkey Cluster) prefix, one S3 bucket and
prefix, as a fleet of one server per node runs them (README, "Several servers over one tier").

What one server stores, another finds and serves byte-exact. What one deletes or clears is a clean miss
for every server whose L1 does not hold it (a server's L1 is its own: a copy there serves on, bytes
intact, until that server deletes or clears it too). Two servers storing one object at once leave one
whole object. Every server reports the backend's own figures for the tier. Real server processes, real
valkey-server and SeaweedFS.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from support.tiers import (
    assert_prefix_bytes,
    assert_served_whole,
    make_prompt,
    s3_spec,
    start_tier_server,
    store_full,
    tier_of,
    valkey_spec,
    wait_store_idle,
)

KINDS = ["valkey", "valkey_cluster", "s3"]


def shared_spec(kind: str, request: pytest.FixtureRequest) -> str:
    """One tier spec (one prefix) that every server of the test is started with."""
    if kind == "valkey":
        return valkey_spec(request.getfixturevalue("valkey_server").url, name="t")
    if kind == "valkey_cluster":
        return valkey_spec(request.getfixturevalue("valkey_cluster").url, name="t")
    return s3_spec(request.getfixturevalue("s3_server").endpoint, name="t")


def assert_clean_miss(c, p) -> None:
    assert c.lookup(p.tokens) == 0
    assert c.retrieve(p.tokens).shape[2] == 0


def delete_prefix(srv, p, scope: str = "all") -> dict:
    r = httpx.request("DELETE", f"{srv.http}/cache/prefix", json={"token_ids": [int(t) for t in p.tokens], "scope": scope}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("kind", KINDS)
def test_servers_over_one_tier_find_each_others_objects_and_miss_what_another_removed(kind, request, make_server, seed):
    spec = shared_spec(kind, request)
    a = start_tier_server(make_server, spec, name="a")
    b = start_tier_server(make_server, spec, name="b")
    p, q, r = (make_prompt(n, seed + i) for i, n in enumerate([4, 3, 2]))
    with a.client() as ca, b.client() as cb:
        store_full(ca, p)
        store_full(ca, q)
        wait_store_idle(a)

        # B finds what A stored: its lookup counts it, its retrieve returns A's bytes.
        assert_served_whole(cb, p)
        assert_served_whole(cb, q)
        assert tier_of(b.status(), "t")["loaded"] == 7

        # A deletes p everywhere it can: the shared tier and its own L1. B's L1 copy is B's own: it
        # still serves, A's bytes exactly, until B lets it go; then p is a clean miss at B.
        assert delete_prefix(a, p)["tiers_removed"] == {"t": 4}
        assert_served_whole(cb, p)
        delete_prefix(b, p, scope="l1")
        assert_clean_miss(cb, p)

        # A clears the tier: q is gone for B as well once B's L1 no longer holds it.
        assert httpx.post(f"{a.http}/cache/clear", json={"scope": "tiers"}, timeout=60).json()["tiers_removed"] == {"t": 3}
        b.clear()
        assert_clean_miss(cb, q)

        # Both store r at once: one whole object per chunk, which both serve.
        go = threading.Barrier(2)

        def store_at(c) -> None:
            go.wait()
            store_full(c, r)

        other = threading.Thread(target=store_at, args=(ca,))
        other.start()
        store_at(cb)
        other.join()
        wait_store_idle(a)
        wait_store_idle(b)
        a.clear()
        b.clear()
        for c in (ca, cb):
            assert_served_whole(c, r)

    for srv in (a, b):
        t = tier_of(srv.status(), "t")
        assert (t["healthy"], t["objects"], t["corrupt"], t["failures"]) == (True, 2, 0, 0), (srv.log_path, t)


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_that_has_not_used_the_tier_yet_reports_what_it_holds(kind, request, make_server, seed):
    """/status and the metrics show the backend's figures from the start: a server that only joined (or
    was restarted) and has had no request yet reported an S3 tier with ``create_bucket`` as empty."""
    spec = shared_spec(kind, request)
    a = start_tier_server(make_server, spec, name="a")
    with a.client() as ca:
        store_full(ca, make_prompt(4, seed))
    assert tier_of(wait_store_idle(a), "t")["objects"] == 4
    b = start_tier_server(make_server, spec, name="b")
    t = tier_of(b.status(), "t")
    assert (t["healthy"], t["objects"]) == (True, 4), t
    assert t["used_bytes"] > 0, t
    assert b.metric("kvdepot_l2_objects", tier="t") == 4
