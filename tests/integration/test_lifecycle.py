"""Lifecycle controls through a real server: pins (hard, soft, under a quota), agent-session leases that
keep a conversation's prefix across a gap that floods L1, warming a prefix from an fs tier, and deleting
a prefix from L1 and the tier. Floods push 3x L1's capacity through it, so everything unprotected goes;
deadlines are polled through the HTTP API, never timed."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from support.servers import CHUNK, assert_bytes_equal, make_kv, make_tokens, wait_until
from support.tiers import assert_served_whole, fs_spec, make_prompt, start_tier_server, store_full, tier_of, wait_store_idle

from kvdepot import KVLayout
from kvdepot.errors import BadRequest, IllegalTransition

BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64)  # 64 KiB a chunk of 16 tokens
L1_GB = "0.015625"  # 16 MiB = 256 chunks
CHUNK_BYTES = BIG.chunk_bytes(CHUNK)
FLOOD_PROMPTS, FLOOD_CHUNKS = 24, 32  # 768 chunks: three times L1


def call(srv, method: str, path: str, body: dict | None = None) -> httpx.Response:
    """The admin guard wants every mutating request to be JSON, even one without a body."""
    if method != "GET" and body is None:
        body = {}
    return httpx.request(method, f"{srv.http}{path}", json=body, timeout=60)


def ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def flood(srv, seed: int) -> None:
    """Store 3x L1's capacity of unrelated prompts from another client."""
    with srv.client(srv.ipc_url, layout=BIG, transport="inline") as f:
        for i in range(FLOOD_PROMPTS):
            t = make_tokens(FLOOD_CHUNKS * CHUNK, seed * 7919 + i)
            assert f.store(t, make_kv(BIG, len(t), i)) == len(t)
    assert srv.status()["l1"]["used_bytes"] <= 16 << 20


def prompt(n_chunks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    t = make_tokens(n_chunks * CHUNK, seed)
    return t, make_kv(BIG, len(t), seed)


def small_server(make_server, *args: str):
    return make_server("--l1-size-gb", L1_GB, *args)


# --- pins -------------------------------------------------------------------------------------------


def test_a_pinned_prefix_survives_a_flood_that_evicts_everything_else(make_server, seed):
    srv = small_server(make_server)
    (pt, pkv), (qt, qkv) = prompt(8, seed), prompt(8, seed + 1)
    with srv.client(layout=BIG) as c:
        assert c.store(pt, pkv) == len(pt) and c.store(qt, qkv) == len(qt)
        pin = ok(call(srv, "POST", "/cache/pin", {"token_ids": pt.tolist()}))
        assert (pin["requested"], pin["pinned"]) == (8, 8)
        assert pin["pins"][0]["state"] == "hard"
        absent = ok(call(srv, "POST", "/cache/pin", {"token_ids": make_tokens(4 * CHUNK, seed + 2).tolist()}))
        assert (absent["requested"], absent["pinned"]) == (4, 0)  # not in L1: nothing pinned, and it says so

        flood(srv, seed)
        assert srv.status()["l1"]["evicted_objects"] >= FLOOD_PROMPTS * FLOOD_CHUNKS - 256
        assert c.lookup(qt) == 0, "the unpinned prompt was not evicted: the flood proves nothing"
        assert c.lookup(pt) == len(pt)
        assert_bytes_equal(c.retrieve(pt), pkv)

        gone = ok(call(srv, "DELETE", f"/cache/pins/{pin['pins'][0]['id']}"))
        assert gone["state"] == "released"
        assert call(srv, "DELETE", f"/cache/pins/{pin['pins'][0]['id']}").status_code == 409  # released already
        flood(srv, seed + 1)
        assert c.lookup(pt) == 0, "an unpinned prefix is evicted like any other"


def test_a_soft_pin_ends_at_its_deadline(make_server, seed):
    srv = small_server(make_server)
    pt, pkv = prompt(8, seed)
    with srv.client(layout=BIG) as c:
        assert c.store(pt, pkv) == len(pt)
        hashes = [h.hex() for h in c.hashes(pt)]
        pin = ok(call(srv, "POST", "/cache/pin", {"chunk_hashes": hashes, "ttl_s": 1.0}))["pins"][0]
        assert pin["state"] == "soft" and 0 < pin["expires_in_s"] <= 1.0
        wait_until(lambda: not ok(call(srv, "GET", "/cache/pins"))["pins"], what="the soft pin to expire")
        assert call(srv, "POST", f"/cache/pins/{pin['id']}/extend", {"ttl_s": 5}).status_code == 409  # expired
        flood(srv, seed)
        assert c.lookup(pt) == 0


def test_pinned_bytes_count_against_the_salt_quota(make_server, seed):
    srv = small_server(make_server, "--eviction-policy", "isolated_lru")
    quota = 16 * CHUNK_BYTES
    r = httpx.put(f"{srv.http}/quota/t", json={"quota_bytes": quota}, timeout=10)
    assert r.status_code == 200, r.text
    pinned_t, pinned_kv = prompt(12, seed)
    with srv.client(layout=BIG) as c:
        assert c.store(pinned_t, pinned_kv, cache_salt="t") == len(pinned_t)
        assert ok(call(srv, "POST", "/cache/pin", {"token_ids": pinned_t.tolist(), "cache_salt": "t"}))["pinned"] == 12
        more_t, more_kv = prompt(8, seed + 1)
        # 12 pinned + 8 > 16: the store keeps what fits t's quota (its own pinned objects cannot make
        # room, and other tenants' are never taken for it), and refuses the rest.
        assert c.store(more_t, more_kv, cache_salt="t") == 4 * CHUNK
        r = call(srv, "POST", "/cache/pin", {"token_ids": more_t.tolist(), "cache_salt": "t"})
        assert r.status_code == 200 and (12 + r.json()["pinned"]) * CHUNK_BYTES <= quota, r.json()  # never past the quota
        ok(call(srv, "DELETE", f"/cache/pins/{r.json()['pins'][0]['id']}"))
        # Deterministically: with the quota below what t has pinned, no pin of t is taken, not even of nothing.
        ok(httpx.put(f"{srv.http}/quota/t", json={"quota_bytes": 8 * CHUNK_BYTES}, timeout=10))
        r = call(srv, "POST", "/cache/pin", {"token_ids": more_t.tolist(), "cache_salt": "t"})
        assert r.status_code == 409 and "quota" in r.json()["detail"], r.text
        ok(httpx.put(f"{srv.http}/quota/t", json={"quota_bytes": quota}, timeout=10))

        others = [prompt(8, seed + 10 + i) for i in range(4)]
        for t, kv in others:
            c.store(t, kv, cache_salt="t")
        wait_until(lambda: ok(call(srv, "GET", "/quota/t"))["used_bytes"] <= quota, what="salt t back under its quota")
        assert c.lookup(pinned_t, cache_salt="t") == len(pinned_t)
        unpinned = sum(c.lookup(t, cache_salt="t") for t, _ in [(more_t, more_kv), *others]) // CHUNK
        assert unpinned <= 16 - 12, f"{unpinned} unpinned chunks of t kept: the pinned 12 did not count against the quota"


def test_a_pin_of_a_deleted_prefix_neither_counts_against_the_quota_nor_pins_it_again(make_server, seed):
    """A pin kept the keys of a prefix an operator then deleted (or cleared): its bytes still counted
    against the tenant's quota, so the next pin was refused (409, "12 chunks pinned already") with
    nothing pinned in L1, /cache/pins still said it pinned them, and when an engine stored the prefix
    again the old hard pin held it against eviction for good, a deleted pin come back by itself."""
    srv = small_server(make_server, "--eviction-policy", "isolated_lru")
    quota = 16 * CHUNK_BYTES
    ok(httpx.put(f"{srv.http}/quota/t", json={"quota_bytes": quota}, timeout=10))
    (old_t, old_kv), (new_t, new_kv) = prompt(12, seed), prompt(12, seed + 1)
    with srv.client(layout=BIG) as c:
        assert c.store(old_t, old_kv, cache_salt="t") == len(old_t)
        assert ok(call(srv, "POST", "/cache/pin", {"token_ids": old_t.tolist(), "cache_salt": "t"}))["pinned"] == 12
        done = ok(call(srv, "DELETE", "/cache/prefix", {"token_ids": old_t.tolist(), "cache_salt": "t"}))
        assert done["l1_removed"] == 12 and c.lookup(old_t, cache_salt="t") == 0
        assert [p["pinned"] for p in ok(call(srv, "GET", "/cache/pins"))["pins"]] == [0], "a pin says it holds deleted objects"

        assert c.store(new_t, new_kv, cache_salt="t") == len(new_t)
        r = call(srv, "POST", "/cache/pin", {"token_ids": new_t.tolist(), "cache_salt": "t"})
        assert r.status_code == 200 and r.json()["pinned"] == 12, f"nothing is pinned in L1, yet: {r.text}"

        # Cleared, then stored again: the old pins do not hold the prefix any more.
        ok(call(srv, "POST", "/cache/clear", {"scope": "l1"}))
        assert c.store(old_t, old_kv, cache_salt="t") == len(old_t)
        flood(srv, seed)
        assert c.lookup(old_t, cache_salt="t") == 0, "a pin of a deleted, then cleared prefix still held it"


def test_a_pin_refused_for_one_rank_leaves_no_pin_of_another(make_server, seed):
    """A model served by two ranks is pinned once per rank; the second rank's pin refused (its salt's
    quota) answered 409, and left the first rank's hard pin, whose id nobody was told: it protected its
    prefix, against the tenant's quota, for good."""
    srv = make_server("--l1-size-gb", "0.015625", "--eviction-policy", "isolated_lru")
    t = make_tokens(6 * CHUNK, seed)
    with srv.client(layout=BIG, rank=0, world_size=2) as c0, srv.client(layout=BIG, rank=1, world_size=2) as c1:
        assert c0.store(t, make_kv(BIG, len(t), 0), cache_salt="t") == len(t)
        assert c1.store(t, make_kv(BIG, len(t), 1), cache_salt="t") == len(t)
        # Both ranks' lookups hold their prefixes (read locks), so the lowered quota evicts nothing yet.
        assert c0.lookup_chunks(c0.hashes(t), cache_salt="t", session_id="s0") == 6
        assert c1.lookup_chunks(c1.hashes(t), cache_salt="t", session_id="s1") == 6
        ok(httpx.put(f"{srv.http}/quota/t", json={"quota_bytes": 8 * CHUNK_BYTES}, timeout=10))
        r = call(srv, "POST", "/cache/pin", {"token_ids": t.tolist(), "cache_salt": "t"})  # rank 0's 6 fit, 12 do not
        assert r.status_code == 409, r.text
        pins = ok(call(srv, "GET", "/cache/pins"))["pins"]
        assert pins == [], f"a pin refused with 409 left a hard pin nobody was told of: {pins}"


def test_a_client_pins_unpins_and_closes_its_agent_session_over_rpc(make_server, seed):
    srv = small_server(make_server)
    (pt, pkv), (st, skv) = prompt(6, seed), prompt(6, seed + 1)
    with srv.client(layout=BIG) as c:
        assert c.store(pt, pkv) == len(pt)
        assert c.store(st, skv, agent_session="conv") == len(st)
        reply = c.pin(pt)
        assert (reply.pinned, reply.state, reply.expires_in_s) == (6, "hard", -1.0)
        assert c.pin(make_tokens(3 * CHUNK, seed + 5), ttl_s=30).pinned == 0  # nothing of it in L1
        flood(srv, seed)
        assert c.lookup(pt) == len(pt) and c.lookup(st) == len(st)
        assert c.unpin(reply.pin_id).state == "released"
        with pytest.raises(IllegalTransition, match="released"):
            c.unpin(reply.pin_id)
        c.close_agent_session("conv")
        with pytest.raises(IllegalTransition, match="closed"):
            c.close_agent_session("conv")
        flood(srv, seed + 1)
        assert c.lookup(pt) == 0 and c.lookup(st) == 0
        with pytest.raises(BadRequest):
            c.pin(pt, ttl_s=-1)


# --- agent-session leases ------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_an_agent_session_keeps_its_prefix_across_a_gap_that_floods_l1(make_server, transport, seed):
    srv = small_server(make_server)
    turn1_t, turn1_kv = prompt(8, seed)
    other_t, other_kv = prompt(8, seed + 1)
    with srv.client(layout=BIG, transport=transport) as c:
        assert c.store(turn1_t, turn1_kv, agent_session="conv") == len(turn1_t)
        assert c.store(other_t, other_kv) == len(other_t)
        session = ok(call(srv, "GET", "/cache/sessions"))["sessions"]
        assert [(s["name"], s["state"], s["keys"]) for s in session] == [("conv", "open", 8)]

        flood(srv, seed)  # the tool call's gap: L1 turns over three times
        assert c.lookup(other_t) == 0, "the prompt outside the session was not evicted: the flood proves nothing"
        # Turn 2: the conversation so far plus the tool's answer; its lookup renews the session.
        turn2_t = np.concatenate([turn1_t, make_tokens(6 * CHUNK, seed + 2)])
        turn2_kv = np.concatenate([turn1_kv, make_kv(BIG, 6 * CHUNK, seed + 2)], axis=2)
        assert c.lookup(turn2_t, agent_session="conv") == len(turn1_t), "the session's prefix is not a full hit"
        assert_bytes_equal(c.retrieve(turn1_t), turn1_kv)
        assert c.store(turn2_t, turn2_kv, agent_session="conv") == len(turn2_t)

        flood(srv, seed + 1)
        assert c.lookup(turn2_t) == len(turn2_t)  # the protection moved to the longer prefix
        assert_bytes_equal(c.retrieve(turn2_t), turn2_kv)
        assert ok(call(srv, "DELETE", "/cache/sessions", {"name": "conv"}))["state"] == "closed"
        flood(srv, seed + 2)
        assert c.lookup(turn2_t) == 0, "a closed session's prefix is evicted normally"


def test_an_expired_agent_session_prefix_is_evicted_normally(make_server, seed):
    srv = small_server(make_server, "--agent-session-ttl-s", "600")
    kept_t, kept_kv = prompt(8, seed)
    short_t, short_kv = prompt(8, seed + 1)
    with srv.client(layout=BIG) as c:
        assert c.store(kept_t, kept_kv, cache_salt="u", agent_session="long") == len(kept_t)
        assert c.store(short_t, short_kv, cache_salt="u") == len(short_t)
        opened = ok(call(srv, "POST", "/cache/sessions", {"cache_salt": "u", "name": "short", "ttl_s": 1.0,
                                                           "token_ids": short_t.tolist()}))  # fmt: skip
        assert (opened["state"], opened["keys"]) == ("open", 8)
        wait_until(lambda: [s["name"] for s in ok(call(srv, "GET", "/cache/sessions"))["sessions"]] == ["long"],
                   what="the short session to expire")  # fmt: skip
        r = call(srv, "POST", "/cache/sessions/renew", {"cache_salt": "u", "name": "short"})
        assert r.status_code == 409 and "expired" in r.json()["detail"]
        flood(srv, seed)
        assert c.lookup(short_t, cache_salt="u") == 0
        assert c.lookup(kept_t, cache_salt="u") == len(kept_t)
        assert call(srv, "DELETE", "/cache/sessions", {"cache_salt": "", "name": "long"}).status_code == 404  # salt is part of the name


# --- prefetch and delete --------------------------------------------------------------------------------


def test_prefetch_warms_a_prefix_from_the_fs_tier(make_server, tmp_path, seed):
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"))
    p = make_prompt(6, seed)
    with srv.client() as c:
        store_full(c, p)
        wait_until(lambda: tier_of(wait_store_idle(srv), "disk")["objects"] >= 6, what="the prompt in the fs tier")
        assert ok(call(srv, "POST", "/cache/clear", {"scope": "l1"}))["removed"] == 6
        assert srv.status()["l1"]["objects"] == 0
        warm = ok(call(srv, "POST", "/cache/prefetch", {"token_ids": p.tokens.tolist()}))
        assert (warm["requested"], warm["in_l1_before"], warm["in_l1"], warm["complete"]) == (6, 0, 6, True)
        assert srv.status()["l1"]["objects"] == 6
        reply = c.lookup_reply(c.hashes(p.tokens))  # no session: L1's answer alone
        assert (reply.hits, reply.in_l1) == (6, 6)
        assert_served_whole(c, p)


def test_delete_prefix_removes_it_from_l1_and_the_tier(make_server, tmp_path, seed):
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"))
    a, b = make_prompt(5, seed), make_prompt(3, seed + 1)
    with srv.client() as c:
        store_full(c, a)
        store_full(c, b)
        wait_until(lambda: tier_of(wait_store_idle(srv), "disk")["objects"] >= 8, what="both prompts in the fs tier")
        hashes = [h.hex() for h in c.hashes(a.tokens)]
        done = ok(call(srv, "DELETE", "/cache/prefix", {"chunk_hashes": hashes}))
        assert done == {"requested": 5, "l1_removed": 5, "l1_doomed": 0, "tiers_removed": {"disk": 5}}
        assert tier_of(srv.status(), "disk")["objects"] == 3
        assert c.lookup(a.tokens) == 0  # in neither L1 nor the tier
        assert_served_whole(c, b)

        # A reader holding b's bytes keeps them, unchanged, until it is done; nobody new finds them.
        with c.prepare_retrieve(b.tokens) as views:
            done = ok(call(srv, "DELETE", "/cache/prefix", {"token_ids": b.tokens.tolist(), "scope": "l1"}))
            assert (done["l1_removed"], done["l1_doomed"], done["tiers_removed"]) == (0, 3, {})
            assert srv.status()["l1"]["objects"] == 3
            for i, v in enumerate(views):
                assert_bytes_equal(v, b.kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, what="the doomed objects to go with their reader")
        assert tier_of(srv.status(), "disk")["objects"] == 3  # scope l1: the tier keeps them


def test_token_ids_never_name_the_objects_of_an_engine_that_hashes_its_own_way(make_server, seed):
    """vLLM's native offloading tier names a chunk by vLLM's own block key (hash_scheme
    vllm-offload-key-v1), not by kvdepot's token chain. The server hashed token_ids its own way for
    every namespace all the same: DELETE /cache/prefix by token ids answered 200 having deleted nothing
    (the prefix stayed servable), and a pin answered 200 pinning nothing, as if the prefix were not in L1."""
    from kvdepot.connectors.vllm_tier.identity import KEY_SCHEME, chunk_hash

    srv = small_server(make_server)
    t, kv = prompt(4, seed)
    with srv.client(layout=BIG, hash_scheme=KEY_SCHEME) as c:
        keys = [chunk_hash(f"vllm block key {seed} {i}".encode(), c.hash_algorithm.digest_size) for i in range(4)]
        with c.prepare_store(keys) as slots:
            for i, slot in enumerate(slots):
                slot[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup_chunks(keys) == 4
        r = call(srv, "DELETE", "/cache/prefix", {"token_ids": t.tolist()})
        assert r.status_code == 400 and "chunk_hashes" in r.json()["detail"], f"answered as if deleted: {r.text}"
        r = call(srv, "POST", "/cache/pin", {"token_ids": t.tolist()})
        assert r.status_code == 400, r.text
        assert c.lookup_chunks(keys) == 4
        done = ok(call(srv, "DELETE", "/cache/prefix", {"chunk_hashes": [k.hex() for k in keys]}))
        assert done["l1_removed"] == 4 and c.lookup_chunks(keys) == 0


def test_bad_lifecycle_requests_are_refused_clearly(make_server, seed):
    srv = small_server(make_server)
    assert call(srv, "POST", "/cache/pin", {"token_ids": [1, 2]}).status_code == 409  # no engine registered yet
    with srv.client(layout=BIG):
        for body, status, words in [
            ({"token_ids": [1], "chunk_hashes": []}, 400, "exactly one"),
            ({"chunk_hashes": ["zz"]}, 400, "not hex"),
            ({"chunk_hashes": ["ab" * 8]}, 400, "32 bytes"),
            ({"token_ids": [1], "model": "nope"}, 409, "nope"),
        ]:
            r = call(srv, "POST", "/cache/pin", body)
            assert r.status_code == status and words in r.json()["detail"], (body, r.text)
        assert call(srv, "POST", "/cache/pin", {"token_ids": [-1]}).status_code == 422
        assert call(srv, "POST", "/cache/pin", {"token_ids": [1], "ttl_s": 0}).status_code == 422
        assert call(srv, "DELETE", "/cache/pins/12345").status_code == 404
        assert call(srv, "POST", "/cache/sessions/renew", {"name": "none"}).status_code == 404
        r = httpx.post(f"{srv.http}/cache/prefetch", content=b"{}", headers={"Content-Type": "text/plain"}, timeout=10)
        assert r.status_code == 415  # the admin guard: mutating requests are JSON
    assert srv.alive()
