"""Store → lookup → retrieve against a real server: transports, endpoints, zero-copy API, prefixes,
dtypes, and isolation between salts, models, ranks and layouts (ARCHITECTURE.md §2, §4, §7)."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot import KVLayout
from kvdepot.types import SlotStatus

from support.servers import CHUNK, LAYOUT, assert_bytes_equal, make_kv, make_tokens


def _url(server, endpoint: str) -> str:
    return server.url if endpoint == "tcp" else server.ipc_url


# --- transports ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
def test_auto_transport_picks_shm_on_the_same_host(server, endpoint):
    with server.client(_url(server, endpoint)) as c:
        assert c.transport == "shm"
        assert c.chunk_size == CHUNK
        assert c.chunk_bytes == LAYOUT.chunk_bytes(CHUNK)
        assert c.ping() is True


@pytest.mark.parametrize("endpoint", ["tcp", "ipc"])
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_store_lookup_retrieve_bit_exact(server, endpoint, transport, seed):
    n_chunks = 5
    tokens = make_tokens(n_chunks * CHUNK + 7, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client(_url(server, endpoint), transport=transport) as c:
        assert c.transport == transport
        assert c.lookup(tokens) == 0
        assert c.store(tokens, kv) == n_chunks * CHUNK
        assert c.lookup(tokens) == n_chunks * CHUNK
        got = c.retrieve(tokens)
        assert_bytes_equal(got, kv[:, :, : n_chunks * CHUNK])
        # Storing again is idempotent and reports the same coverage.
        assert c.store(tokens, kv) == n_chunks * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv[:, :, : n_chunks * CHUNK])


@pytest.mark.parametrize("store_transport, read_transport", [("shm", "inline"), ("inline", "shm")])
def test_bytes_written_by_one_transport_read_by_the_other(server, store_transport, read_transport, seed):
    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client(transport=store_transport) as w, server.client(server.ipc_url, transport=read_transport) as r:
        assert w.store(tokens, kv) == 4 * CHUNK
        assert r.lookup(tokens) == 4 * CHUNK
        assert_bytes_equal(r.retrieve(tokens), kv)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_store_from_a_non_contiguous_kv(server, transport, seed):
    tokens = make_tokens(3 * CHUNK, seed)
    big = make_kv(KVLayout(num_layers=2, num_kv_heads=4, head_dim=32), len(tokens), seed)
    kv = big[:, :, :, ::2, :]  # [2, 2, T, 2, 32], strided over heads
    assert not kv.flags.c_contiguous
    with server.client(transport=transport) as c:
        assert c.store(tokens, kv) == 3 * CHUNK
        assert_bytes_equal(c.retrieve(tokens), np.ascontiguousarray(kv))


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_retrieve_into_contiguous_out(server, transport, seed):
    tokens = make_tokens(3 * CHUNK + 5, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client(transport=transport) as c:
        assert c.store(tokens, kv) == 3 * CHUNK
        out = np.full(LAYOUT.chunk_shape(4 * CHUNK), 7, dtype=LAYOUT.storage_dtype)
        got = c.retrieve(tokens, out=out)
        assert got.shape == LAYOUT.chunk_shape(3 * CHUNK)
        assert np.shares_memory(got, out), "retrieve(out=...) must fill the caller's array"
        assert_bytes_equal(out[:, :, : 3 * CHUNK], kv[:, :, : 3 * CHUNK])
        assert (out[:, :, 3 * CHUNK :] == 7).all(), "tokens past the hit must be left alone"


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_retrieve_into_non_contiguous_out(server, transport, seed):
    tokens = make_tokens(3 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    backing = np.full((2, 2, 4 * CHUNK, 2, 64), 5, dtype=LAYOUT.storage_dtype)
    out = backing[:, :, :, :, 16:48]  # [2, 2, 64, 2, 32], not contiguous
    assert not out.flags.c_contiguous
    with server.client(transport=transport) as c:
        assert c.store(tokens, kv) == 3 * CHUNK
        got = c.retrieve(tokens, out=out)
        assert got.shape == LAYOUT.chunk_shape(3 * CHUNK)
        assert np.shares_memory(got, backing)
        assert_bytes_equal(out[:, :, : 3 * CHUNK], kv)
        # Nothing outside the requested window of the backing buffer was written.
        assert (backing[..., :16] == 5).all() and (backing[..., 48:] == 5).all()
        assert (backing[:, :, 3 * CHUNK :] == 5).all()


# --- zero-copy API ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_prepare_store_and_prepare_retrieve(server, transport, seed):
    tokens = make_tokens(6 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client(transport=transport) as c:
        with c.prepare_store(tokens[: 4 * CHUNK]) as slots:
            assert len(slots) == 4
            assert slots.statuses == [SlotStatus.ALLOCATED] * 4
            for i, slot in enumerate(slots):
                assert slot is not None and slot.shape == LAYOUT.chunk_shape(CHUNK) and slot.flags.writeable
                slot[...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup(tokens) == 4 * CHUNK

        # Extending the prompt: the first four chunks are already stored -> None.
        with c.prepare_store(tokens) as slots:
            assert len(slots) == 6
            assert slots[:4] == [None] * 4
            assert slots.statuses[:4] == [SlotStatus.EXISTS] * 4
            assert slots.statuses[4:] == [SlotStatus.ALLOCATED] * 2
            for i in (4, 5):
                slots[i][...] = kv[:, :, i * CHUNK : (i + 1) * CHUNK]
        assert c.lookup(tokens) == 6 * CHUNK

        with c.prepare_retrieve(tokens) as views:
            assert len(views) == 6
            for i, view in enumerate(views):
                assert view.shape == LAYOUT.chunk_shape(CHUNK)
                assert not view.flags.writeable
                assert_bytes_equal(view, kv[:, :, i * CHUNK : (i + 1) * CHUNK])
        # Hashes are accepted in place of tokens.
        with c.prepare_retrieve(c.hashes(tokens), start=2) as views:
            assert len(views) == 4
            assert_bytes_equal(views[0], kv[:, :, 2 * CHUNK : 3 * CHUNK])
    assert server.leases() == 0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_exception_inside_prepare_store_stores_nothing_and_frees_space(server, transport, seed):
    tokens = make_tokens(5 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    before = server.status()
    with server.client(transport=transport) as c:
        with pytest.raises(RuntimeError, match="engine failed"):
            with c.prepare_store(tokens) as slots:
                assert len(slots) == 5
                if transport == "shm":  # the slots are reserved arena space right now
                    during = server.status()
                    assert during["leases"] == before["leases"] + 1
                    assert during["l1"]["writing"] == 5
                    assert during["l1"]["used_bytes"] == before["l1"]["used_bytes"] + 5 * c.chunk_bytes
                    assert c.lookup(tokens) == 0  # WRITING objects are invisible
                slots[0][...] = kv[:, :, :CHUNK]
                raise RuntimeError("engine failed")
        after = server.status()
        assert c.lookup(tokens) == 0
        assert after["leases"] == before["leases"]
        assert after["l1"]["used_bytes"] == before["l1"]["used_bytes"]
        assert after["l1"]["objects"] == before["l1"]["objects"]
        # The very same chunks can be stored afterwards.
        assert c.store(tokens, kv) == 5 * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_partial_last_chunk_is_not_stored(server, transport, seed):
    tokens = make_tokens(3 * CHUNK + CHUNK - 1, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with server.client(transport=transport) as c:
        assert c.store(tokens, kv) == 3 * CHUNK
        assert c.lookup(tokens) == 3 * CHUNK
        assert c.lookup(tokens[: 2 * CHUNK + 9]) == 2 * CHUNK
        assert c.lookup(tokens[: CHUNK - 1]) == 0
        got = c.retrieve(tokens)
        assert got.shape[2] == 3 * CHUNK
        assert_bytes_equal(got, kv[:, :, : 3 * CHUNK])
        # Appending the missing token does not conjure the fourth chunk.
        longer = np.append(tokens, 1)
        assert c.lookup(longer) == 3 * CHUNK
        # A prompt shorter than a chunk stores nothing.
        short = make_tokens(CHUNK - 3, seed + 1)
        assert c.store(short, make_kv(LAYOUT, len(short), seed)) == 0
        assert c.lookup(short) == 0
        assert c.retrieve(short).shape == LAYOUT.chunk_shape(0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float32", "int8"])
@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_other_dtypes_round_trip_bytes(server, dtype, transport, seed):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=dtype)
    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(layout, len(tokens), seed)
    raw = layout.storage_dtype.name != dtype  # bf16/fp8 bits held as unsigned ints: say so
    with server.client(transport=transport, layout=layout) as c:
        assert c.chunk_bytes == layout.chunk_bytes(CHUNK)
        assert c.store(tokens, kv, raw=raw) == 4 * CHUNK
        got = c.retrieve(tokens)
        assert got.dtype.itemsize == layout.itemsize
        assert_bytes_equal(got, kv)


def test_mla_layout_round_trips(server, seed):
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, dtype="bfloat16", use_mla=True)
    tokens = make_tokens(2 * CHUNK, seed)
    kv = make_kv(layout, len(tokens), seed)
    assert kv.shape[0] == 1
    with server.client(layout=layout) as c:
        assert c.store(tokens, kv, raw=True) == 2 * CHUNK  # bf16 bits as uint16
        assert_bytes_equal(c.retrieve(tokens), kv)


# --- prefixes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_diverging_token_after_chunk_k_gives_k_chunks(server, transport, seed):
    n_chunks = 8
    base = make_tokens(n_chunks * CHUNK + 5, seed)
    kv = make_kv(LAYOUT, len(base), seed)
    rng = np.random.default_rng(seed)
    with server.client(transport=transport) as c:
        assert c.store(base, kv) == n_chunks * CHUNK
        for k in (0, 1, 2, 5, 7):
            variant = base.copy()
            pos = k * CHUNK + int(rng.integers(0, CHUNK))
            variant[pos] = (variant[pos] + 1) % 50_000
            assert c.lookup(variant) == k * CHUNK, f"diverging at token {pos}"
            got = c.retrieve(variant)
            assert got.shape[2] == k * CHUNK
            assert_bytes_equal(got, kv[:, :, : k * CHUNK])
        # Diverging only in the partial tail changes nothing.
        variant = base.copy()
        variant[-1] = (variant[-1] + 1) % 50_000
        assert c.lookup(variant) == n_chunks * CHUNK
        # A prefix of the stored prompt hits exactly its complete chunks.
        for cut in (CHUNK, 3 * CHUNK + 4, n_chunks * CHUNK):
            assert c.lookup(base[:cut]) == (cut // CHUNK) * CHUNK


# --- isolation ----------------------------------------------------------------------------------------


def test_cache_salts_never_see_each_other(server, seed):
    tokens = make_tokens(3 * CHUNK, seed)
    kv_a = make_kv(LAYOUT, len(tokens), seed)
    kv_b = make_kv(LAYOUT, len(tokens), seed + 1)
    with server.client() as c, server.client(transport="inline") as ci:
        assert c.store(tokens, kv_a, cache_salt="alice") == 3 * CHUNK
        for cl in (c, ci):
            assert cl.lookup(tokens) == 0
            assert cl.lookup(tokens, cache_salt="") == 0
            assert cl.lookup(tokens, cache_salt="bob") == 0
            assert cl.lookup(tokens, cache_salt="alice") == 3 * CHUNK
            assert cl.retrieve(tokens, cache_salt="bob").shape[2] == 0
        assert c.store(tokens, kv_b, cache_salt="bob") == 3 * CHUNK
        for cl in (c, ci):
            assert_bytes_equal(cl.retrieve(tokens, cache_salt="alice"), kv_a)
            assert_bytes_equal(cl.retrieve(tokens, cache_salt="bob"), kv_b)
            assert cl.retrieve(tokens).shape[2] == 0


@pytest.mark.parametrize(
    "other",
    [
        dict(model="another-model"),
        dict(rank=1, world_size=2),
        dict(rank=0, world_size=2),
        dict(layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")),  # same bytes a chunk
        dict(layout=KVLayout(num_layers=4, num_kv_heads=1, head_dim=32)),  # same bytes a chunk
        dict(layout=KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, use_mla=True)),  # same bytes a chunk
        dict(chunk_size=2 * CHUNK),
    ],
    ids=["model", "rank", "world_size", "dtype", "shape", "mla", "chunk_size"],
)
def test_other_model_rank_layout_never_see_objects(server, other, seed):
    """Another model, rank, layout or chunk size never sees the owner's objects. While the owner is
    connected, a client of the same model and rank that could never share with it (another layout or
    chunk size) is refused at registration, naming both sides' values (the compatibility handshake);
    once the owner is gone, it registers and still sees nothing of the owner's."""
    from kvdepot.errors import ErrorCode, KVDepotError

    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    refused_while_live = "model" not in other and "world_size" not in other
    with server.client() as owner:
        assert owner.store(tokens, kv) == 4 * CHUNK
        hashes = owner.hashes(tokens)
        with server.client() as same:  # positive control: an identical context sees it
            assert same.lookup(tokens) == 4 * CHUNK
        if refused_while_live:
            with pytest.raises(KVDepotError) as refused:
                server.client(**other)
            assert refused.value.code is ErrorCode.INCOMPATIBLE
            term, mine = ("chunk_size", str(2 * CHUNK)) if "chunk_size" in other else ("layout", other["layout"].fingerprint())
            theirs = str(CHUNK) if term == "chunk_size" else LAYOUT.fingerprint()
            assert f"{term}: this client {mine}, the live one {theirs}" in refused.value.message
    with server.client(**other) as stranger:
            assert stranger.lookup(tokens) == 0
            assert stranger.lookup_chunks(hashes) == 0  # the very same chunk hashes
            assert stranger.retrieve(tokens).shape[2] == 0
            with stranger.prepare_retrieve(tokens) as views:
                assert views == []
            # The stranger stores its own bytes under the same tokens; the owner still reads its own.
            skv = make_kv(stranger.layout, len(tokens), seed + 7)
            raw = stranger.layout.storage_dtype.name != stranger.layout.dtype
            assert stranger.store(tokens, skv, raw=raw) == len(stranger.hashes(tokens)) * stranger.chunk_size
            assert_bytes_equal(stranger.retrieve(tokens), skv[:, :, : stranger.lookup(tokens)])
    with server.client() as owner:
        assert_bytes_equal(owner.retrieve(tokens), kv)


# --- hash algorithms ----------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm, digest", [("blake3", 32), ("xxh3_128", 16)])
def test_other_hash_algorithms(make_server, algorithm, digest, seed):
    from kvdepot.errors import ErrorCode, KVDepotError
    from kvdepot.hashing import chunk_hashes

    srv = make_server("--hash-algorithm", algorithm)
    tokens = make_tokens(4 * CHUNK, seed)
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client() as c, srv.client(srv.ipc_url, transport="inline") as ci:
        assert c.hash_algorithm.value == algorithm
        hashes = c.hashes(tokens)
        assert hashes == chunk_hashes(tokens, CHUNK, algorithm)
        assert all(len(h) == digest for h in hashes)
        assert c.store(tokens, kv) == 4 * CHUNK
        assert_bytes_equal(ci.retrieve(tokens), kv)
        # sha256-sized keys are the wrong length here (or, for blake3, simply other keys).
        sha = chunk_hashes(tokens, CHUNK, "sha256")
        if digest != 32:
            with pytest.raises(KVDepotError) as exc_info:
                c.lookup_chunks(sha)
            assert exc_info.value.code == ErrorCode.BAD_REQUEST
        else:
            assert c.lookup_chunks(sha) == 0
