"""Hostile and malformed input over a raw DEALER socket (ARCHITECTURE.md §3): every request gets exactly
one typed error reply, and afterwards the server still answers PING and stored data is intact."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest

from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m

from support.servers import (
    CHUNK,
    LAYOUT,
    RawPeer,
    start_server,
    stop_server,
    assert_bytes_equal,
    encode_body,
    make_kv,
    make_tokens,
    raw_header,
    wait_until,
)

MiB = 1 << 20
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)  # 8 KiB
ROWS = LAYOUT.kv_factor * LAYOUT.num_layers  # 4 rows of 2 KiB


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # Raw peers are never declared gone here (client timeout far away), so any lease they leave behind
    # stays visible: only the server's own bookkeeping can bring the count back to zero.
    s = start_server(tmp_path_factory.mktemp("bad"), "bad-input", ["--max-frame-mib", "1", "--client-timeout-s", "600"])
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def baseline(srv):
    """A prompt stored before any bad input; it must survive every test."""
    tokens = make_tokens(6 * CHUNK, 424242)
    kv = make_kv(LAYOUT, len(tokens), 424242)
    with srv.client() as c:
        assert c.store(tokens, kv) == 6 * CHUNK
    return tokens, kv


@pytest.fixture(autouse=True)
def server_still_serves(srv, baseline):
    yield
    assert srv.alive(), "the server process died"
    with RawPeer(srv.url) as p:
        assert p.ping()
    with RawPeer(srv.ipc_url) as p:
        assert p.ping()
    tokens, kv = baseline
    with srv.client(srv.ipc_url) as c:
        assert c.lookup(tokens) == 6 * CHUNK
        assert_bytes_equal(c.retrieve(tokens), kv)
    wait_until(lambda: srv.status()["leases"] == 0, what="no leases left behind")


@pytest.fixture
def peer(srv):
    with RawPeer(srv.url) as p:
        yield p


def _rid(p: RawPeer) -> int:
    return p.next_id()


# --- framing ------------------------------------------------------------------------------------------


def test_a_single_frame_is_rejected(peer):
    code, rid, msg = peer.error_of([b"just one frame"])
    assert code == ErrorCode.BAD_REQUEST and rid == 0
    assert "header and body" in msg


@pytest.mark.parametrize(
    "header",
    [
        b"\xc1",  # never-used msgpack byte
        b"",
        b"\x93\x01\x02",  # array of 3 with 2 elements
        msgspec.msgpack.encode({"version": 1, "request_id": 1, "type": 1}),  # a map, not an array
        msgspec.msgpack.encode(["1", 2, 1]),  # wrong types
        msgspec.msgpack.encode([1]),  # too short
        msgspec.msgpack.encode([1, 2, 1, 0] + [0] * 300),  # longer than any header may be
        os.urandom(64),
    ],
    ids=["c1", "empty", "truncated", "map", "types", "short", "huge", "random"],
)
def test_an_undecodable_header_gets_bad_request(peer, header):
    code, rid, _ = peer.error_of([header, encode_body(m.PingRequest())])
    assert code == ErrorCode.BAD_REQUEST
    assert rid == 0


@pytest.mark.parametrize("version", [0, m.PROTOCOL_VERSION - 1, m.PROTOCOL_VERSION + 1, 999, -1])
def test_wrong_protocol_version_gets_version_mismatch(peer, version):
    rid = _rid(peer)
    code, got_rid, msg = peer.error_of([raw_header(version, rid, int(m.RequestType.PING)), encode_body(m.PingRequest())])
    assert code == ErrorCode.VERSION_MISMATCH
    assert got_rid == rid
    assert str(m.PROTOCOL_VERSION) in msg


@pytest.mark.parametrize("rtype", [0, max(m.RequestType) + 1, 999, -5, 2**40])
def test_unknown_request_type(peer, rtype):
    rid = _rid(peer)
    code, got_rid, _ = peer.error_of([raw_header(m.PROTOCOL_VERSION, rid, rtype), b"\x80"])
    assert code == ErrorCode.UNKNOWN_REQUEST_TYPE
    assert got_rid == rid


@pytest.mark.parametrize(
    "rtype, body",
    [
        (m.RequestType.PING, b"\xff\xff"),
        (m.RequestType.PING, msgspec.msgpack.encode({"unexpected": 1})),
        (m.RequestType.LOOKUP, msgspec.msgpack.encode({})),
        (m.RequestType.LOOKUP, msgspec.msgpack.encode({"context_id": "one", "keys": []})),
        (m.RequestType.LOOKUP, msgspec.msgpack.encode({"context_id": 1, "keys": "notalist"})),
        (m.RequestType.LOOKUP, msgspec.msgpack.encode([1, [b"x" * 32]])),
        (m.RequestType.REGISTER_CONTEXT, msgspec.msgpack.encode({"protocol_version": 1})),
        (m.RequestType.STORE_INLINE, b""),
        (m.RequestType.COMMIT_STORE, msgspec.msgpack.encode({"context_id": 1, "lease_id": 1.5})),
    ],
    ids=["garbage", "unknown-field", "missing-fields", "wrong-type", "keys-not-list", "array", "register", "empty", "float"],
)
def test_malformed_body_gets_bad_request(peer, rtype, body):
    rid = _rid(peer)
    code, got_rid, msg = peer.error_of([raw_header(m.PROTOCOL_VERSION, rid, int(rtype)), body])
    assert code == ErrorCode.BAD_REQUEST
    assert got_rid == rid
    assert rtype.name in msg


def test_body_over_the_body_limit(peer):
    rid = _rid(peer)
    body = msgspec.msgpack.encode({"pad": b"x" * (codec.MAX_BODY_BYTES + 1)})
    code, got_rid, _ = peer.error_of([raw_header(m.PROTOCOL_VERSION, rid, int(m.RequestType.PING)), body])
    assert code == ErrorCode.MESSAGE_TOO_LARGE
    assert got_rid == rid


# --- contexts -----------------------------------------------------------------------------------------


def test_unknown_context(peer):
    h = [b"\x00" * 32]
    for body in (
        m.LookupRequest(context_id=987654, keys=h),
        m.PrepareStoreRequest(context_id=987654, keys=h),
        m.PrepareRetrieveRequest(context_id=987654, keys=h),
        m.RetrieveInlineRequest(context_id=987654, keys=h),
        m.CommitStoreRequest(context_id=987654, lease_id=1),
        m.EndSessionRequest(context_id=0, session_id="x"),
        m.QueryPrefetchStatusRequest(context_id=-1, session_id="x"),
        m.UnregisterContextRequest(context_id=987654),
    ):
        with pytest.raises(KVDepotError) as exc_info:
            peer.call(body)
        assert exc_info.value.code == ErrorCode.UNKNOWN_CONTEXT, type(body).__name__


def test_another_clients_context_is_unknown(srv):
    with RawPeer(srv.url) as a, RawPeer(srv.ipc_url) as b:
        ctx = a.register().context_id
        h = [b"\x01" * 32]
        with pytest.raises(KVDepotError) as exc_info:
            b.call(m.LookupRequest(context_id=ctx, keys=h))
        assert exc_info.value.code == ErrorCode.UNKNOWN_CONTEXT
        with pytest.raises(KVDepotError) as exc_info:
            b.call(m.UnregisterContextRequest(context_id=ctx))
        assert exc_info.value.code == ErrorCode.UNKNOWN_CONTEXT
        # b cannot commit a's lease either, and a's lease is unharmed.
        res = a.call(m.PrepareStoreRequest(context_id=ctx, keys=h))
        b.register()
        with pytest.raises(KVDepotError) as exc_info:
            b.call(m.CommitStoreRequest(context_id=b.context_id, lease_id=res.lease_id))
        assert exc_info.value.code == ErrorCode.UNKNOWN_LEASE
        assert a.call(m.CommitStoreRequest(context_id=ctx, lease_id=res.lease_id, abort=True)).committed == 0
        assert a.call(m.UnregisterContextRequest(context_id=ctx)).ok
        with pytest.raises(KVDepotError) as exc_info:  # gone after unregistering
            a.call(m.LookupRequest(context_id=ctx, keys=h))
        assert exc_info.value.code == ErrorCode.UNKNOWN_CONTEXT


@pytest.mark.parametrize(
    "change, code",
    [
        (dict(protocol_version=0), ErrorCode.VERSION_MISMATCH),
        (dict(protocol_version=m.PROTOCOL_VERSION + 1), ErrorCode.VERSION_MISMATCH),
        (dict(model=""), ErrorCode.BAD_REQUEST),
        (dict(rank=2, world_size=2), ErrorCode.BAD_REQUEST),
        (dict(rank=-1), ErrorCode.BAD_REQUEST),
        (dict(world_size=0), ErrorCode.BAD_REQUEST),
        (dict(chunk_size=-16), ErrorCode.BAD_REQUEST),
        (dict(chunk_size=1 << 21), ErrorCode.BAD_REQUEST),
        (dict(layout=m.LayoutSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float13")), ErrorCode.BAD_REQUEST),
        (dict(layout=m.LayoutSpec(num_layers=0, num_kv_heads=2, head_dim=32)), ErrorCode.BAD_REQUEST),
        (dict(layout=m.LayoutSpec(num_layers=10**6, num_kv_heads=8, head_dim=128)), ErrorCode.BAD_REQUEST),  # > L1
    ],
    ids=["v0", "v2", "no-model", "rank", "neg-rank", "world0", "neg-chunk", "big-chunk", "dtype", "layers0", "too-big"],
)
def test_bad_register(srv, peer, change, code):
    fields = dict(
        protocol_version=m.PROTOCOL_VERSION,
        model="m",
        layout=m.LayoutSpec(num_layers=2, num_kv_heads=2, head_dim=32),
    )
    fields.update(change)
    contexts = srv.status()["contexts"]
    with pytest.raises(KVDepotError) as exc_info:
        peer.call(m.RegisterContextRequest(**fields))
    assert exc_info.value.code == code
    assert srv.status()["contexts"] == contexts, "a refused registration must not create a context"


def test_bad_chunk_hashes(srv, peer):
    ctx = peer.register().context_id
    objects = srv.status()["l1"]["objects"]
    for keys in ([b"x" * 31], [b"x" * 33], [b"x" * 32, b""], [b"x" * 64]):
        for body in (
            m.LookupRequest(context_id=ctx, keys=keys),
            m.LookupRequest(context_id=ctx, keys=keys, session_id="s"),
            m.PrepareStoreRequest(context_id=ctx, keys=keys),
            m.PrepareRetrieveRequest(context_id=ctx, keys=keys),
            m.RetrieveInlineRequest(context_id=ctx, keys=keys),
            m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=ROWS),
        ):
            with pytest.raises(KVDepotError) as exc_info:
                peer.call(body, payload=[b"\0" * CHUNK_BYTES] * len(keys) if isinstance(body, m.StoreInlineRequest) else [])
            assert exc_info.value.code == ErrorCode.BAD_REQUEST, (type(body).__name__, [len(k) for k in keys])
    with pytest.raises(KVDepotError) as exc_info:  # more keys than one request may carry
        peer.call(m.LookupRequest(context_id=ctx, keys=[b"k" * 32] * ((1 << 16) + 1)))
    assert exc_info.value.code == ErrorCode.BAD_REQUEST
    st = srv.status()
    assert st["l1"]["objects"] == objects and st["leases"] == 0


def test_a_salt_of_megabytes_is_refused(srv, peer):
    """It used to be kept per context (the namespace cache holds 4,096 of them), in KV events and traces."""
    ctx = peer.register().context_id
    key = [b"k" * 32]
    for body in (m.LookupRequest(context_id=ctx, keys=key, cache_salt="s" * 1025),
                 m.PrepareStoreRequest(context_id=ctx, keys=key, cache_salt="s" * (1 << 20))):  # fmt: skip
        with pytest.raises(KVDepotError) as exc_info:
            peer.call(body)
        assert exc_info.value.code == ErrorCode.BAD_REQUEST and "cache_salt is at most 1024" in exc_info.value.message
    assert peer.call(m.LookupRequest(context_id=ctx, keys=key, cache_salt="s" * 1024)).hits == 0
    assert srv.status()["leases"] == 0


def test_a_model_name_or_hash_scheme_of_megabytes_is_refused(srv, peer):
    """A context's model name is kept for its life and becomes a label of every per-model series of
    /metrics and /status (and a KV-events topic): four registrations of an 8 MiB name made each /metrics
    scrape 400 MB. Like cache_salt, it is bounded; a long model path is still fine."""
    layout = m.LayoutSpec(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads, head_dim=LAYOUT.head_dim)
    contexts = srv.status()["contexts"]
    for change in (dict(model="m" * (1 << 20)), dict(model="m", hash_scheme="s" * (1 << 20))):
        fields = dict(protocol_version=m.PROTOCOL_VERSION, layout=layout) | change
        with pytest.raises(KVDepotError) as exc_info:
            peer.call(m.RegisterContextRequest(**fields))
        assert exc_info.value.code == ErrorCode.BAD_REQUEST, exc_info.value.message
        assert "at most" in exc_info.value.message
    assert srv.status()["contexts"] == contexts, "a refused registration must not create a context"
    ctx = peer.register(model="/models/" + "m" * 4000).context_id
    assert peer.call(m.UnregisterContextRequest(context_id=ctx)).ok


def test_bad_leases(srv, peer):
    ctx = peer.register().context_id
    for body, code in (
        (m.CommitStoreRequest(context_id=ctx, lease_id=10**9), ErrorCode.UNKNOWN_LEASE),
        (m.CommitStoreRequest(context_id=ctx, lease_id=10**9, abort=True), ErrorCode.UNKNOWN_LEASE),
        (m.CommitRetrieveRequest(context_id=ctx, lease_id=10**9), ErrorCode.UNKNOWN_LEASE),
        (m.CommitRetrieveRequest(context_id=ctx, lease_id=-3), ErrorCode.UNKNOWN_LEASE),
    ):
        with pytest.raises(KVDepotError) as exc_info:
            peer.call(body)
        assert exc_info.value.code == code
    # A write lease is not a read lease, and the other way round; the wrong finish changes nothing.
    h = [os.urandom(32)]
    w = peer.call(m.PrepareStoreRequest(context_id=ctx, keys=h))
    with pytest.raises(KVDepotError) as exc_info:
        peer.call(m.CommitRetrieveRequest(context_id=ctx, lease_id=w.lease_id))
    assert exc_info.value.code == ErrorCode.ILLEGAL_STATE
    assert peer.call(m.CommitStoreRequest(context_id=ctx, lease_id=w.lease_id)).committed == 1
    r = peer.call(m.PrepareRetrieveRequest(context_id=ctx, keys=h))
    assert len(r.offsets) == 1
    with pytest.raises(KVDepotError) as exc_info:
        peer.call(m.CommitStoreRequest(context_id=ctx, lease_id=r.lease_id))
    assert exc_info.value.code == ErrorCode.ILLEGAL_STATE
    assert peer.call(m.CommitRetrieveRequest(context_id=ctx, lease_id=r.lease_id)).ok
    with pytest.raises(KVDepotError) as exc_info:  # finishing twice
        peer.call(m.CommitRetrieveRequest(context_id=ctx, lease_id=r.lease_id))
    assert exc_info.value.code == ErrorCode.UNKNOWN_LEASE
    assert srv.status()["leases"] == 0


def test_out_of_range_start_and_first(peer):
    ctx = peer.register().context_id
    keys = [os.urandom(32), os.urandom(32)]
    for body in (
        m.PrepareRetrieveRequest(context_id=ctx, keys=keys, start=3),
        m.PrepareRetrieveRequest(context_id=ctx, keys=keys, start=-1),
        m.RetrieveInlineRequest(context_id=ctx, keys=keys, start=5),
        m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=ROWS, first=3),
        m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=ROWS, first=-1),
        m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=ROWS, first=1, count=5),  # past the keys
    ):
        with pytest.raises(KVDepotError) as exc_info:
            peer.call(body, payload=[os.urandom(CHUNK_BYTES)] if getattr(body, "count", 0) else ())
        assert exc_info.value.code == ErrorCode.BAD_REQUEST, body


# --- payloads -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n_keys, rows_per_frame, frames",
    [
        (2, ROWS, [CHUNK_BYTES]),  # one frame short
        (2, ROWS, [CHUNK_BYTES] * 3),  # one frame too many
        (2, ROWS, [CHUNK_BYTES, CHUNK_BYTES - 1]),  # one byte short
        (2, ROWS, [CHUNK_BYTES, CHUNK_BYTES + 1]),  # one byte over
        (1, 1, [CHUNK_BYTES]),  # rows_per_frame=1 means 4 frames a chunk
        (1, 2, [CHUNK_BYTES // 4] * 4),  # ... and 2 means 2 frames a chunk
        (1, -1, [CHUNK_BYTES]),  # negative split
        (1, 1000, [CHUNK_BYTES]),  # a split larger than the frame limit
        (1, ROWS, []),  # no payload at all
        (0, ROWS, [CHUNK_BYTES]),  # payload with no keys
    ],
)
def test_store_inline_payload_mismatch(srv, peer, n_keys, rows_per_frame, frames):
    ctx = peer.register().context_id
    before = srv.status()
    keys = [os.urandom(32) for _ in range(n_keys)]
    body = m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=rows_per_frame)
    with pytest.raises(KVDepotError) as exc_info:
        peer.call(body, payload=[os.urandom(n) for n in frames])
    assert exc_info.value.code == ErrorCode.PAYLOAD_MISMATCH
    after = srv.status()
    assert after["l1"]["objects"] == before["l1"]["objects"]
    assert after["l1"]["used_bytes"] == before["l1"]["used_bytes"]
    assert after["leases"] == 0
    if keys:
        assert peer.call(m.LookupRequest(context_id=ctx, keys=keys)).hits == 0


def test_store_inline_well_formed_by_hand(peer):
    """Positive control for the mismatch cases: the same framing, done right, stores the bytes."""
    ctx = peer.register().context_id
    data = [os.urandom(CHUNK_BYTES) for _ in range(3)]
    for rpf, per in ((ROWS, 1), (1, ROWS), (2, 2)):
        keys = [os.urandom(32) for _ in range(3)]
        frames = [d[i * CHUNK_BYTES // per : (i + 1) * CHUNK_BYTES // per] for d in data for i in range(per)]
        reply = peer.call(m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=rpf), payload=frames)
        assert reply.statuses == [int(m.SlotStatus.ALLOCATED)] * 3
        header, out = peer.request(m.RetrieveInlineRequest(context_id=ctx, keys=keys))
        got = codec.decode_reply_body(m.RequestType.RETRIEVE_INLINE, header, out[1])
        assert got.found == 3
        assert b"".join(out[2:]) == b"".join(data)


def test_payload_frame_over_the_frame_limit(srv, peer):
    ctx = peer.register().context_id
    objects = srv.status()["l1"]["objects"]
    big = np.zeros(2 * MiB, dtype=np.uint8)
    # Any request: the limit is checked before dispatch.
    rid = _rid(peer)
    code, got_rid, msg = peer.error_of([*codec.encode_request(rid, m.PingRequest()), big])
    assert code == ErrorCode.MESSAGE_TOO_LARGE and got_rid == rid
    assert "frame limit" in msg
    # A STORE_INLINE whose split claims a 2 MiB frame.
    layout_rows = 2 * MiB // (CHUNK_BYTES // ROWS)
    rid = _rid(peer)
    body = m.StoreInlineRequest(context_id=ctx, keys=[os.urandom(32)], rows_per_frame=layout_rows)
    code, got_rid, _ = peer.error_of([*codec.encode_request(rid, body), big])
    assert code == ErrorCode.MESSAGE_TOO_LARGE and got_rid == rid
    assert srv.status()["l1"]["objects"] == objects


def test_frame_over_the_hard_limit_drops_only_that_connection(srv):
    """Frames above ZeroMQ's MAXMSGSIZE make it drop the connection (no reply); nothing else suffers."""
    with RawPeer(srv.url) as bystander:
        assert bystander.ping()
        with RawPeer(srv.url) as p:
            assert p.ping()
            p.send_frames([*codec.encode_request(1, m.PingRequest()), b"\0" * (40 * MiB)])
            assert not p.sock.poll(1000)  # no reply can come: the connection was cut
        assert bystander.ping()


# --- clients that vanish mid-transfer -----------------------------------------------------------------


def test_client_vanishing_after_a_big_store_inline(srv):
    n = 512  # 4 MiB in 512 frames
    for _ in range(3):
        p = RawPeer(srv.url)
        ctx = p.register().context_id
        keys = [os.urandom(32) for _ in range(n)]
        body = m.StoreInlineRequest(context_id=ctx, keys=keys, rows_per_frame=ROWS)
        p.send_frames([*codec.encode_request(p.next_id(), body), *([b"\x5a" * CHUNK_BYTES] * n)])
        p.close()  # gone before the reply
    wait_until(lambda: srv.status()["leases"] == 0, what="the store leases to finish")
    with RawPeer(srv.url) as q:
        assert q.ping()


def test_client_vanishing_after_a_big_retrieve_inline(srv, seed):
    tokens = make_tokens(512 * CHUNK, seed)  # 4 MiB
    kv = make_kv(LAYOUT, len(tokens), seed)
    with srv.client() as c:
        assert c.store(tokens, kv) == 512 * CHUNK
        hashes = c.hashes(tokens)
        for _ in range(5):
            p = RawPeer(srv.url)
            ctx = p.register(model=c.model).context_id
            body = m.RetrieveInlineRequest(context_id=ctx, keys=hashes)
            p.send_frames(codec.encode_request(p.next_id(), body))
            p.close()
        # The read locks end once ZeroMQ is done with the frames, reader or no reader.
        wait_until(lambda: srv.status()["leases"] == 0, what="the retrieve read locks to end")
        assert srv.status()["l1"]["read_locked"] == 0
        assert_bytes_equal(c.retrieve(tokens), kv)
