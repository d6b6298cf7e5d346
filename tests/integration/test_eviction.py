"""Filling L1 several times over (ARCHITECTURE.md §5): usage never exceeds capacity, the newest prompts
survive bit-exact under LRU, and a noop policy refuses new stores instead of dropping old data."""

from __future__ import annotations

import pytest

from kvdepot import KVLayout

from support.servers import CHUNK, assert_bytes_equal, make_kv, make_tokens, wait_until

BIG = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64)  # 4 KiB a token, 64 KiB a chunk
L1_GB = "0.015625"  # 16 MiB = 256 chunks of 64 KiB


@pytest.mark.parametrize("policy, transport", [("lru", "shm"), ("lru", "inline"), ("isolated_lru", "shm")])
def test_lru_fill_five_times_over(make_server, policy, transport, seed):
    srv = make_server("--l1-size-gb", L1_GB, "--eviction-policy", policy)
    cap = srv.status()["l1"]["capacity_bytes"]
    assert cap == 16 << 20
    chunk_bytes = BIG.chunk_bytes(CHUNK)
    chunks_per_prompt = 32  # 2 MiB a prompt: 8 prompts fill L1
    n_prompts = 5 * cap // (chunks_per_prompt * chunk_bytes)
    assert n_prompts == 40
    prompts = []
    with srv.client(layout=BIG, transport=transport) as c:
        for i in range(n_prompts):
            tokens = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + i)
            kv = make_kv(BIG, len(tokens), seed * 1000 + i)
            prompts.append((tokens, kv))
            assert c.store(tokens, kv) == chunks_per_prompt * CHUNK, f"prompt {i} was not fully stored"
            l1 = srv.status()["l1"]
            assert l1["capacity_bytes"] == cap
            assert l1["used_bytes"] <= cap, f"after prompt {i}: used {l1['used_bytes']} > capacity {cap}"
            assert l1["used_bytes"] == l1["objects"] * chunk_bytes
            assert_bytes_equal(c.retrieve(tokens), kv)  # the newest prompt is always there

        # The background controller brings usage under the high watermark (0.95 by default).
        wait_until(lambda: srv.status()["l1"]["used_bytes"] <= 0.95 * cap, what="usage under the high watermark")
        # An inline retrieve's lock ends once ZeroMQ has let go of the frames it sent, which the server's
        # loop sees a moment after the client has them (64 KiB frames are sent without a copy).
        wait_until(lambda: srv.status()["leases"] == 0, 10, what="the last retrieve's locks to end")
        status = srv.status()
        assert status["l1"]["evicted_objects"] >= (n_prompts * chunks_per_prompt) - cap // chunk_bytes
        assert status["leases"] == 0
        # The newest three prompts (6 MiB, well under the low watermark) are intact.
        for tokens, kv in prompts[-3:]:
            assert c.lookup(tokens) == chunks_per_prompt * CHUNK
            assert_bytes_equal(c.retrieve(tokens), kv)
        # The oldest cannot all still be there: L1 holds 8 prompts at most, and LRU evicted the first.
        assert c.lookup(prompts[0][0]) == 0
        stored = sum(c.lookup(t) for t, _ in prompts) // CHUNK
        assert stored <= cap // chunk_bytes


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_noop_policy_refuses_new_stores_and_keeps_old_data(make_server, transport, seed):
    srv = make_server("--l1-size-gb", L1_GB, "--eviction-policy", "noop")
    cap = srv.status()["l1"]["capacity_bytes"]
    chunk_bytes = BIG.chunk_bytes(CHUNK)
    assert cap // chunk_bytes == 256
    chunks_per_prompt = 24  # 10 prompts = 240 chunks; the 11th fits 16 chunks; the 12th none
    prompts = []
    with srv.client(layout=BIG, transport=transport) as c:
        for i in range(10):
            tokens = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + i)
            kv = make_kv(BIG, len(tokens), seed * 1000 + i)
            prompts.append((tokens, kv))
            assert c.store(tokens, kv) == chunks_per_prompt * CHUNK
        tokens = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + 10)
        kv = make_kv(BIG, len(tokens), seed * 1000 + 10)
        assert c.store(tokens, kv) == 16 * CHUNK, "the 11th prompt fits exactly 16 chunks"
        assert c.lookup(tokens) == 16 * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv[:, :, : 16 * CHUNK])

        l1 = srv.status()["l1"]
        assert l1["used_bytes"] == cap
        assert l1["objects"] == 256

        for j in range(11, 14):  # a full L1 refuses, again and again
            t = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + j)
            assert c.store(t, make_kv(BIG, len(t), j)) == 0
            assert c.lookup(t) == 0
        with c.prepare_store(make_tokens(4 * CHUNK, seed + 99)) as slots:
            if transport == "shm":  # nothing reserved: no slot to write (inline stages, then learns)
                assert [s is None for s in slots] == [True] * 4
                assert [s.name for s in slots.statuses] == ["NO_SPACE"] * 4
        assert [s.name for s in slots.statuses] == ["NO_SPACE"] * 4

        status = srv.status()
        assert status["l1"]["evicted_objects"] == 0
        assert status["l1"]["used_bytes"] == cap
        assert status["leases"] == 0
        for tokens_i, kv_i in prompts:  # nothing old was dropped
            assert c.lookup(tokens_i) == chunks_per_prompt * CHUNK
            assert_bytes_equal(c.retrieve(tokens_i), kv_i)

        # Clearing makes room again. (An inline retrieve's locks end once ZeroMQ has let go of the
        # frames it sent, which may come a moment after the client has them: a clear before that
        # leaves the locked objects doomed, not yet removed.)
        wait_until(lambda: srv.status()["leases"] == 0, 10, what="the last retrieve's locks to end")
        assert srv.clear()["removed"] == 256
        t = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + 20)
        kv = make_kv(BIG, len(t), 20)
        assert c.store(t, kv) == chunks_per_prompt * CHUNK
        assert_bytes_equal(c.retrieve(t), kv)


def test_locked_objects_are_never_evicted_or_overwritten(make_server, seed):
    srv = make_server("--l1-size-gb", L1_GB)
    chunks_per_prompt = 32
    tokens = make_tokens(chunks_per_prompt * CHUNK, seed)
    kv = make_kv(BIG, len(tokens), seed)
    session_tokens = make_tokens(16 * CHUNK, seed + 1)
    session_kv = make_kv(BIG, len(session_tokens), seed + 1)
    with srv.client(layout=BIG) as reader, srv.client(srv.ipc_url, layout=BIG, transport="inline") as flood:
        assert reader.store(tokens, kv) == len(tokens)
        assert reader.store(session_tokens, session_kv) == len(session_tokens)
        assert reader.lookup_chunks(reader.hashes(session_tokens), session_id="keep") == 16
        with reader.prepare_retrieve(tokens) as views:  # zero-copy views straight into the arena
            assert len(views) == chunks_per_prompt
            for i in range(24):  # 48 MiB through a 16 MiB L1 with 3 MiB of it locked
                t = make_tokens(chunks_per_prompt * CHUNK, seed * 1000 + i)
                assert flood.store(t, make_kv(BIG, len(t), i)) == len(t)
                assert srv.status()["l1"]["used_bytes"] <= 16 << 20
            for i, v in enumerate(views):  # not a byte of the locked slots was reused
                assert_bytes_equal(v, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        assert srv.status()["l1"]["evicted_objects"] > 0
        with reader.prepare_retrieve(session_tokens, session_id="keep") as views:
            assert len(views) == 16
            for i, v in enumerate(views):
                assert_bytes_equal(v, session_kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        reader.end_session("keep")
        assert srv.status()["leases"] == 0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_store_never_evicts_the_prefix_it_extends(make_server, transport, seed):
    """Extending a stored prompt by more than L1 can take: the reservation may evict anything except the
    chunks it reports as already stored, so the count store() returns is exactly what lookup() finds."""
    # Watermarks at 1.0: no background eviction, only the synchronous kind this test is about.
    srv = make_server("--l1-size-gb", L1_GB, "--high-watermark", "1", "--low-watermark", "1")
    cap_chunks = (16 << 20) // BIG.chunk_bytes(CHUNK)
    assert cap_chunks == 256
    prompt = make_tokens((64 + 200) * CHUNK, seed)
    kv = make_kv(BIG, len(prompt), seed)
    filler = make_tokens(192 * CHUNK, seed + 1)
    with srv.client(layout=BIG, transport=transport) as c:
        assert c.store(prompt[: 64 * CHUNK], kv[:, :, : 64 * CHUNK]) == 64 * CHUNK
        assert c.store(filler, make_kv(BIG, len(filler), seed + 1)) == 192 * CHUNK
        assert srv.status()["l1"]["objects"] == cap_chunks  # full
        n = c.store(prompt, kv)
        assert n == c.lookup(prompt), "store() reported chunks that lookup() cannot find"
        # The 192 filler chunks make room for 192 new ones; the last 8 find no space.
        assert n == cap_chunks * CHUNK
        assert_bytes_equal(c.retrieve(prompt), kv[:, :, :n])
        assert srv.status()["l1"]["used_bytes"] <= 16 << 20
