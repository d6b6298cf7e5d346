"""The admin API's newer endpoints on a real server: ``GET /``, the ``POST /clear-cache`` alias,
``GET /events/recent``, and ``/status``'s tenants."""

from __future__ import annotations

import httpx
from support.servers import CHUNK, LAYOUT, RawPeer, encode_body, make_kv, make_tokens, raw_header, wait_until

import kvdepot
from kvdepot.errors import ErrorCode
from kvdepot.protocol import messages as m


def _recent(server, **params) -> list[dict]:
    r = httpx.get(f"{server.http}/events/recent", params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["events"]


def _last_seq(server) -> int:
    events = _recent(server, n=1)
    return events[-1]["seq"] if events else 0


def test_root_names_the_server(server):
    r = httpx.get(f"{server.http}/", timeout=10)
    assert r.status_code == 200
    assert r.json()["name"] == "kvdepot" and r.json()["version"] == kvdepot.__version__


def test_clear_cache_is_the_same_operation_as_cache_clear_and_as_guarded(server, seed):
    with server.client() as c:
        t = make_tokens(3 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 3 * CHUNK
        assert httpx.post(f"{server.http}/clear-cache", content=b"x", headers={"Content-Type": "text/plain"}, timeout=10).status_code == 415
        assert httpx.post(f"{server.http}/clear-cache", json={}, headers={"Origin": "http://evil.example"}, timeout=10).status_code == 403
        assert c.lookup(t) == 3 * CHUNK, "a refused request cleared the cache"
        r = httpx.post(f"{server.http}/clear-cache", json={}, timeout=10)
        assert r.status_code == 200 and r.json()["removed"] >= 3
        assert c.lookup(t) == 0
        assert httpx.post(f"{server.http}/clear-cache", json={"scope": "everything"}, timeout=10).status_code == 422


def test_recent_events_tell_stores_removals_error_replies_and_warnings_newest_last(server, seed):
    start = _last_seq(server)
    with server.client() as c:
        t = make_tokens(5 * CHUNK, seed)
        assert c.store(t, make_kv(LAYOUT, len(t), seed)) == 5 * CHUNK
        server.clear()
    with RawPeer(server.url) as peer:
        code, _, _ = peer.error_of([raw_header(m.PROTOCOL_VERSION + 1, 9, int(m.RequestType.PING)), encode_body(m.PingRequest())])
        assert code == ErrorCode.VERSION_MISMATCH
    assert httpx.post(f"{server.http}/cache/clear", json={}, headers={"Origin": "http://evil.example"}, timeout=10).status_code == 403

    # L1 changes and error replies reach the ring through the event bus, on its drain thread's next tick
    # (warnings are logged into it at once): wait for them, then check everything.
    events = wait_until(
        lambda: (ev := _recent(server, after=start, n=512))
        and {"l1_stored", "l1_removed", "error_reply"} <= {e["kind"] for e in ev}
        and any(e["kind"] == "error_reply" and e["code"] == "VERSION_MISMATCH" for e in ev)
        and ev,
        what="the store, the clear and the error reply in /events/recent",
    )
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "newest last, each once"
    stored = [e for e in events if e["kind"] == "l1_stored"]
    assert sum(e["objects"] for e in stored) == 5 and sum(e["bytes"] for e in stored) == 5 * LAYOUT.chunk_bytes(CHUNK)
    removed = [e for e in events if e["kind"] == "l1_removed"]
    assert {e["because"] for e in removed} == {"cleared"} and sum(e["objects"] for e in removed) >= 5
    assert [e["kind"] for e in events].index("l1_stored") < [e["kind"] for e in events].index("l1_removed")
    replies = [e for e in events if e["kind"] == "error_reply"]
    assert replies and replies[-1]["code"] == "VERSION_MISMATCH" and replies[-1]["count"] >= 1
    warnings = [e["message"] for e in events if e["kind"] == "warning"]
    assert any("admin API refused POST /cache/clear" in w for w in warnings), warnings
    assert any("VERSION_MISMATCH" in w for w in warnings), warnings

    only = _recent(server, after=start, kind=["warning", "error_reply"])
    assert only and {e["kind"] for e in only} == {"warning", "error_reply"}
    assert _recent(server, after=start, n=2) == events[-2:]
    for bad in ({"n": 0}, {"n": 513}, {"after": -1}, {"n": "many"}):
        assert httpx.get(f"{server.http}/events/recent", params=bad, timeout=10).status_code == 422, bad


def test_status_lists_tenants_with_their_quotas(make_server, seed):
    srv = make_server("--eviction-policy", "isolated_lru")
    assert srv.status()["tenants"] == []
    assert httpx.put(f"{srv.http}/quota/blue", json={"quota_bytes": 1 << 20}, timeout=10).status_code == 200
    with srv.client() as c:
        for i, (salt, chunks) in enumerate([("blue", 3), (None, 2), ("green", 4)]):
            t = make_tokens(chunks * CHUNK, seed + i)
            assert c.store(t, make_kv(LAYOUT, len(t), seed + i), cache_salt=salt) == chunks * CHUNK
    chunk = LAYOUT.chunk_bytes(CHUNK)
    tenants = srv.wait_status(lambda st: len(st["tenants"]) == 3)["tenants"]
    assert tenants == [
        {"cache_salt": "green", "objects": 4, "used_bytes": 4 * chunk, "quota_bytes": None},
        {"cache_salt": "blue", "objects": 3, "used_bytes": 3 * chunk, "quota_bytes": 1 << 20},
        {"cache_salt": "__default__", "objects": 2, "used_bytes": 2 * chunk, "quota_bytes": None},
    ]
    # The quota endpoints (the eviction policy's own count) say the same.
    for row in tenants:
        q = httpx.get(f"{srv.http}/quota/{row['cache_salt']}", timeout=10).json()
        assert (q["used_bytes"], q["quota_bytes"]) == (row["used_bytes"], row["quota_bytes"])
    srv.clear()
    assert srv.wait_status(lambda st: len(st["tenants"]) == 1)["tenants"] == [
        {"cache_salt": "blue", "objects": 0, "used_bytes": 0, "quota_bytes": 1 << 20}
    ]


def test_status_lists_tenants_with_the_event_bus_off(make_server, seed):
    """``--event-queue-size 0`` turns the bus off, and the tenant tally was fed only through it: /status
    (and the dashboard, ``kvdepot status`` and the per-tenant metrics) said every tenant held nothing
    while L1 held its objects and ``/quota`` counted them against its quota."""
    srv = make_server("--eviction-policy", "isolated_lru", "--event-queue-size", "0")
    chunk = LAYOUT.chunk_bytes(CHUNK)
    assert httpx.put(f"{srv.http}/quota/blue", json={"quota_bytes": 8 * chunk}, timeout=10).status_code == 200
    with srv.client() as c:
        for i, (salt, chunks) in enumerate([("blue", 3), (None, 2)]):
            t = make_tokens(chunks * CHUNK, seed + i)
            assert c.store(t, make_kv(LAYOUT, len(t), seed + i), cache_salt=salt) == chunks * CHUNK
    assert srv.status()["l1"]["objects"] == 5
    assert httpx.get(f"{srv.http}/quota/blue", timeout=10).json()["used_bytes"] == 3 * chunk
    assert srv.status()["tenants"] == [
        {"cache_salt": "blue", "objects": 3, "used_bytes": 3 * chunk, "quota_bytes": 8 * chunk},
        {"cache_salt": "__default__", "objects": 2, "used_bytes": 2 * chunk, "quota_bytes": None},
    ]
    assert srv.metric("kvdepot_tenant_used_bytes", cache_salt="blue") == 3 * chunk
    srv.clear()
    assert srv.status()["tenants"] == [{"cache_salt": "blue", "objects": 0, "used_bytes": 0, "quota_bytes": 8 * chunk}]
