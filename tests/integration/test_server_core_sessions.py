"""A refused store is no turn of its agent session: a store whose every chunk is refused (here its salt's
quota is below one chunk) stores nothing, so it neither opens the session it names nor renews it. A
store that is let in (even in part) is a turn, as before.

The stores are sent as bare requests first, then through the client's own store(), whose inline path
looks first at what is there already: that look must not be the turn (a lookup naming a session is one,
whatever it finds)."""

from __future__ import annotations

import httpx
import pytest

from kvdepot.protocol import messages as m

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens


def sessions(srv) -> dict[str, dict]:
    r = httpx.get(f"{srv.http}/cache/sessions", timeout=10)
    assert r.status_code == 200, r.text
    return {s["name"]: s for s in r.json()["sessions"]}


def store(c, transport: str, hashes: list, salt: str, session: str) -> list[int]:
    """One bare store of ``hashes`` (shm: PREPARE then COMMIT; inline: one frame of zeros a chunk)."""
    if transport == "shm":
        reply = c.link.request(m.PrepareStoreRequest(context_id=0, keys=hashes, cache_salt=salt, agent_session=session))
        if reply.lease_id:
            c.link.finish(m.CommitStoreRequest(context_id=c.context_id, lease_id=reply.lease_id))
        return reply.statuses
    rows, size = LAYOUT.kv_factor * LAYOUT.num_layers, LAYOUT.chunk_bytes(CHUNK)
    body = m.StoreInlineRequest(context_id=0, keys=hashes, cache_salt=salt, rows_per_frame=rows, agent_session=session)
    return c.link.request(body, [bytes(size) for _ in hashes]).statuses


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_store_refused_by_its_quota_does_not_touch_its_agent_session(make_server, transport, seed):
    srv = make_server("--eviction-policy", "isolated_lru")
    r = httpx.put(f"{srv.http}/quota/q", json={"quota_bytes": 1}, timeout=10)  # below one chunk: every store of q is refused
    assert r.status_code == 200, r.text
    with srv.client(transport=transport) as c:
        hashes = c.hashes(make_tokens(3 * CHUNK, seed))
        assert store(c, transport, hashes, "q", "refused") == [int(m.SlotStatus.OVER_QUOTA)] * 3
        assert "refused" not in sessions(srv), "a store that stored nothing opened its agent session"
        assert store(c, transport, hashes, "", "kept") == [int(m.SlotStatus.ALLOCATED)] * 3
        assert sessions(srv)["kept"]["keys"] == 3


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_client_store_refused_by_its_quota_does_not_touch_its_agent_session(make_server, transport, seed):
    srv = make_server("--eviction-policy", "isolated_lru")
    r = httpx.put(f"{srv.http}/quota/q", json={"quota_bytes": 1}, timeout=10)
    assert r.status_code == 200, r.text
    tokens = make_tokens(3 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client(transport=transport) as c:
        assert c.store(tokens, kv, cache_salt="q", agent_session="refused") == 0
        assert "refused" not in sessions(srv), "a store() that stored nothing opened its agent session"
        assert c.store(tokens, kv, agent_session="kept") == len(tokens)
        assert sessions(srv)["kept"]["keys"] == 3
        # A store of what is all there already is still a turn (as on shm: its chunks all EXISTS).
        assert c.store(tokens, kv, agent_session="again") == len(tokens)
        assert sessions(srv)["again"]["keys"] == 3
