"""Tenants (``cache_salt``) cannot learn anything about each other by LOOKUP.

A salt is part of every object's identity (the namespace digest of model, rank, layout and salt), so a
prefix another tenant stored is, to this tenant, a key that is not there: the server must answer it
exactly as a prefix nobody ever stored, byte for byte, and by the same code path. The path is checked
through what it leaves behind (every counter of ``/metrics`` moves alike for both lookups), not by
timing, which a test on a shared machine cannot measure honestly.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.servers import CHUNK, LAYOUT, RawPeer, assert_bytes_equal, make_kv, make_tokens

from kvdepot.protocol import codec
from kvdepot.protocol import messages as m

A, B = "tenant-a", "tenant-b"


# Other connections closing (tenant A's goodbye, the start-up probes) are seen by the server's loop
# whenever it gets to them, not because of a lookup: not part of a lookup's path. The event bus's own
# counters move with what the drain thread has handed out by the time of the scrape, and with a context's
# first use of a salt (it tells KV events what the namespace means), whoever holds what.
ASYNC = {"kvdepot_disconnects_total", "kvdepot_events_published_total", "kvdepot_events_dropped_total"}


def counters(server) -> dict[tuple, float]:
    """Every counter sample of the server's /metrics, by (name, labels), but ``ASYNC``'s."""
    import httpx

    text = httpx.get(f"{server.http}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.type != "counter":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.name not in ASYNC:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after) if after.get(k, 0.0) != before.get(k, 0.0)}


@pytest.mark.parametrize("session", [False, True], ids=["plain-lookup", "locking-session-lookup"])
def test_a_lookup_of_another_salts_prefix_is_answered_as_a_never_stored_one(make_server, seed, session):
    srv = make_server()
    prefix = make_tokens(4 * CHUNK, seed)
    never = make_tokens(4 * CHUNK, seed + 1)
    with srv.client(heartbeat=False) as a:
        assert a.store(prefix, make_kv(LAYOUT, len(prefix), seed), cache_salt=A) == 4 * CHUNK
        assert a.lookup(prefix, cache_salt=A) == 4 * CHUNK  # it is there, for its own tenant
        stored_keys, never_keys = a.hashes(prefix), a.hashes(never)

    with RawPeer(srv.url) as b:  # tenant B, same model and layout, speaking the wire by hand
        b.register()

        def lookup(keys: list[bytes], sid: str) -> tuple[m.ReplyHeader, bytes, dict]:
            before = counters(srv)
            header, frames = b.request(
                m.LookupRequest(context_id=b.context_id, keys=keys, cache_salt=B, session_id=sid if session else "", lock=session)
            )
            return header, frames[1:], delta(before, counters(srv))

        foreign_header, foreign_frames, foreign_moved = lookup(stored_keys, "s-foreign")
        never_header, never_frames, never_moved = lookup(never_keys, "s-never")

    # The same reply, byte for byte (only the request id in the header differs).
    assert foreign_frames == never_frames
    assert (foreign_header.status, foreign_header.version) == (never_header.status, never_header.version) == (0, foreign_header.version)
    reply = codec.decode_reply_body(m.RequestType.LOOKUP, foreign_header, foreign_frames[0])
    assert reply.hits == 0 and not reply.locked and reply.in_l1 == 0
    # The same path: every counter moved alike (a LOOKUP, its asked and missed tokens), nothing else.
    assert foreign_moved == never_moved
    assert foreign_moved[("kvdepot_requests_total", (("type", "LOOKUP"),))] == 1
    assert any(name == "kvdepot_missed_tokens_total" and v == 4 * CHUNK for (name, _), v in foreign_moved.items()), foreign_moved
    assert not any(name == "kvdepot_hit_tokens_total" for name, _ in foreign_moved), foreign_moved
    assert srv.leases() == 0, "a foreign-salt lookup locked something"


def test_each_salt_reads_only_its_own_copy(make_server, seed):
    srv = make_server()
    prefix = make_tokens(3 * CHUNK, seed)
    kv_a, kv_b = make_kv(LAYOUT, len(prefix), seed), make_kv(LAYOUT, len(prefix), seed + 7)
    with srv.client() as c:
        assert c.store(prefix, kv_a, cache_salt=A) == 3 * CHUNK
        assert c.retrieve(prefix, cache_salt=B).shape[2] == 0, "tenant B read tenant A's KV"
        assert c.lookup(prefix) == 0, "the salt-less tenant saw tenant A's prefix"
        objects = srv.status()["l1"]["objects"]
        assert c.store(prefix, kv_b, cache_salt=B) == 3 * CHUNK  # stored afresh, not "already there"
        assert srv.status()["l1"]["objects"] == objects + 3
        assert_bytes_equal(c.retrieve(prefix, cache_salt=A), kv_a)
        assert_bytes_equal(c.retrieve(prefix, cache_salt=B), kv_b)
