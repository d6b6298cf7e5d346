"""Wire messages and framing: round trips of every request/reply, decode errors and payload splitting."""

from __future__ import annotations

import msgspec
import pytest

from kvdepot.errors import ErrorCode, KVDepotError, LeaseExpired, UnknownLease
from kvdepot.config import RpcConfig
from kvdepot.limits import MAX_FRAME_BYTES
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.codec import (
    MAX_BODY_BYTES,
    ProtocolViolation,
    check_payload,
    decode_reply_body,
    decode_reply_header,
    decode_request_body,
    decode_request_header,
    encode_error,
    encode_reply,
    encode_request,
    frame_sizes,
    request_type_of,
    rows_per_frame_for,
    split_object,
)
from kvdepot.protocol.messages import PROTOCOL_VERSION, REGISTRY, RequestHeader, RequestType, SlotStatus

KEYS = [b"\x01" * 48, b"\x02" * 48]

_NODE = m.PeerNodeInfo(id="10.0.0.1:31995", host="10.0.0.1", control_port=31995, data_port=31996, incarnation=7)
_LOC = m.PeerLocation(key=b"k" * 48, node=_NODE.id, offset=8192, length=4096, generation=9, checksum=b"c" * 16)

REQUESTS: dict[RequestType, msgspec.Struct] = {
    RequestType.PING: m.PingRequest(),
    RequestType.REGISTER_CONTEXT: m.RegisterContextRequest(
        protocol_version=1,
        model="meta-llama/Llama-3.1-8B",
        layout=m.LayoutSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", use_mla=False),
        world_size=2,
        rank=1,
        chunk_size=256,
        client=m.ClientInfo(pid=1234, hostname="h", boot_id="b", pid_namespace=4026531836),
    ),
    RequestType.UNREGISTER_CONTEXT: m.UnregisterContextRequest(context_id=7),
    RequestType.GET_CHUNK_SIZE: m.GetChunkSizeRequest(),
    RequestType.LOOKUP: m.LookupRequest(context_id=7, keys=KEYS, cache_salt="s", session_id="req-1"),
    RequestType.QUERY_PREFETCH_STATUS: m.QueryPrefetchStatusRequest(context_id=7, session_id="req-1"),
    RequestType.FREE_LOOKUP_LOCKS: m.FreeLookupLocksRequest(context_id=7, session_id="req-1", start=1, end=3),
    RequestType.PREPARE_STORE: m.PrepareStoreRequest(context_id=7, keys=KEYS, cache_salt="s"),
    RequestType.COMMIT_STORE: m.CommitStoreRequest(context_id=7, lease_id=99, abort=True),
    RequestType.PREPARE_RETRIEVE: m.PrepareRetrieveRequest(context_id=7, keys=KEYS, session_id="r", start=1),
    RequestType.COMMIT_RETRIEVE: m.CommitRetrieveRequest(context_id=7, lease_id=100),
    RequestType.STORE_INLINE: m.StoreInlineRequest(context_id=7, keys=KEYS, rows_per_frame=4, first=1),
    RequestType.RETRIEVE_INLINE: m.RetrieveInlineRequest(context_id=7, keys=KEYS, start=0),
    RequestType.END_SESSION: m.EndSessionRequest(context_id=7, session_id="req-1"),
    RequestType.CLEAR: m.ClearRequest(scope="all"),
    RequestType.REPORT_BLOCK_ALLOCATION: m.ReportBlockAllocationRequest(context_id=7, allocated_blocks=3, freed_blocks=1),
    RequestType.RENEW_LEASES: m.RenewLeasesRequest(context_id=7, lease_ids=[5, 6], sessions=["req-1"]),
    RequestType.PIN_PREFIX: m.PinPrefixRequest(context_id=7, keys=[b"a" * 32], cache_salt="t", ttl_s=30.0),
    RequestType.UNPIN: m.UnpinRequest(pin_id=3),
    RequestType.CLOSE_AGENT_SESSION: m.CloseAgentSessionRequest(name="conv", cache_salt="t"),
    RequestType.REGISTER_KV_CACHE: m.RegisterKVCacheRequest(
        context_id=7,
        memories=[
            m.CudaIpcMemory(device_uuid="GPU-1234", handle=b"\x01" * 66, size=1 << 30, offset=4096, ref_counter_handle=b"/torch_1_2",
                            ref_counter_offset=3, event_handle=b"\x02" * 64, event_sync_required=True),
            m.HostFileMemory(path="/dev/shm/kvdepot-kvcache-1-ab", size=1 << 20, offset=8192),
        ],
        layers=[m.PagedLayerSpec(memory=1, offset=256, shape=[2, 16, 16, 8, 128], stride=[262144, 16384, 1024, 128, 1], dtype="bfloat16",
                                 format="kv_first", group=0)],
        block_size=16,
    ),
    RequestType.UNREGISTER_KV_CACHE: m.UnregisterKVCacheRequest(context_id=7, cache_id=2),
    RequestType.STORE_BLOCKS: m.StoreBlocksRequest(context_id=7, cache_id=2, keys=KEYS, block_ids=[[4, 9, 1, 0]], first=1, ready_event=b"e" * 64),
    RequestType.RETRIEVE_BLOCKS: m.RetrieveBlocksRequest(context_id=7, cache_id=2, keys=KEYS, block_ids=[[3, 5], [6, 7]], session_id="r",
                                                         skip_first_n_tokens=16),
    RequestType.PEER_JOIN: m.PeerJoinRequest(node=_NODE),
    RequestType.PEER_HEARTBEAT: m.PeerHeartbeatRequest(node=_NODE),
    RequestType.PEER_PUBLISH: m.PeerPublishRequest(records=[_LOC]),
    RequestType.PEER_UNPUBLISH: m.PeerUnpublishRequest(keys=[b"k" * 48], node="10.0.0.1:31995", generations=[3]),
    RequestType.PEER_RESOLVE: m.PeerResolveRequest(keys=[b"k" * 48, b"x"]),
    RequestType.PEER_STATUS: m.PeerStatusRequest(),
    RequestType.PEER_PROMOTE: m.PeerPromoteRequest(keys=[b"k" * 48]),
}

REPLIES: dict[RequestType, msgspec.Struct] = {
    RequestType.PING: m.PingReply(),
    RequestType.REGISTER_CONTEXT: m.RegisterContextReply(
        context_id=7,
        chunk_size=256,
        chunk_bytes=33554432,
        hash_algorithm="sha256",
        server_version="0.1.0",
        max_frame_bytes=16 << 20,
        heartbeat_interval_s=1.0,
        lease_ttl_s=60.0,
        shm=m.ShmInfo(path="/dev/shm/kvdepot-x", size=1 << 30, nonce=b"\x00\xff" * 8, liveness_lock=(1 << 30) + 77),
        blocks=m.BlockTransferOffer(devices=["GPU-1234"], host_files=True, shm_dir="/dev/shm"),
    ),
    RequestType.UNREGISTER_CONTEXT: m.Ack(),
    RequestType.GET_CHUNK_SIZE: m.ChunkSizeReply(chunk_size=256),
    RequestType.LOOKUP: m.LookupReply(hits=None, locked=True),
    RequestType.QUERY_PREFETCH_STATUS: m.LookupReply(hits=3),
    RequestType.FREE_LOOKUP_LOCKS: m.FreeLookupLocksReply(released=2),
    RequestType.PREPARE_STORE: m.PrepareStoreReply(lease_id=5, offsets=[4096, -1], statuses=[0, 1]),
    RequestType.COMMIT_STORE: m.CommitStoreReply(committed=1),
    RequestType.PREPARE_RETRIEVE: m.PrepareRetrieveReply(lease_id=6, offsets=[8192]),
    RequestType.COMMIT_RETRIEVE: m.Ack(ok=False),
    RequestType.STORE_INLINE: m.StoreInlineReply(statuses=[0, 3]),
    RequestType.RETRIEVE_INLINE: m.RetrieveInlineReply(found=2, rows_per_frame=8),
    RequestType.END_SESSION: m.Ack(),
    RequestType.CLEAR: m.ClearReply(removed=12, tiers_removed={"disk": 3}),
    RequestType.REPORT_BLOCK_ALLOCATION: m.Ack(),
    RequestType.RENEW_LEASES: m.RenewLeasesReply(renewed=2),
    RequestType.PIN_PREFIX: m.PinReply(pin_id=3, pinned=1, state="soft", expires_in_s=30.0),
    RequestType.UNPIN: m.PinReply(pin_id=3, pinned=1, state="released"),
    RequestType.CLOSE_AGENT_SESSION: m.Ack(),
    RequestType.REGISTER_KV_CACHE: m.RegisterKVCacheReply(cache_id=2, num_blocks=4096, layer_events=[b"\x03" * 64, b"\x04" * 64]),
    RequestType.UNREGISTER_KV_CACHE: m.Ack(),
    RequestType.STORE_BLOCKS: m.StoreBlocksReply(statuses=[1, 0]),
    RequestType.RETRIEVE_BLOCKS: m.RetrieveBlocksReply(found=1),
    RequestType.PEER_JOIN: m.PeerMembershipReply(members=[_NODE], masters=[_NODE.id], head=_NODE.id, silent_ms=[12]),
    RequestType.PEER_HEARTBEAT: m.PeerMembershipReply(members=[_NODE], masters=[_NODE.id]),
    RequestType.PEER_PUBLISH: m.PeerCountReply(count=1),
    RequestType.PEER_UNPUBLISH: m.PeerCountReply(count=0),
    RequestType.PEER_RESOLVE: m.PeerResolveReply(locations=[[_LOC], []]),
    RequestType.PEER_STATUS: m.PeerStatusReply(node=_NODE, members=[_NODE], masters=[_NODE.id], pool_used_bytes=4096,
                                               pool_capacity_bytes=1 << 20, pool_keys=1, directory_records=2),
    RequestType.PEER_PROMOTE: m.PeerResolveReply(locations=[[_LOC]]),
}


def header_frame(version=PROTOCOL_VERSION, request_id=42, rtype=1, timeout_ms=0) -> bytes:
    return msgspec.msgpack.encode(RequestHeader(version, request_id, rtype, timeout_ms))


# --- the registry and wire enums --------------------------------------------------------------------


def test_request_type_values_are_pinned():
    assert {t.name: t.value for t in RequestType} == {
        "PING": 1,
        "REGISTER_CONTEXT": 2,
        "UNREGISTER_CONTEXT": 3,
        "GET_CHUNK_SIZE": 4,
        "LOOKUP": 5,
        "QUERY_PREFETCH_STATUS": 6,
        "FREE_LOOKUP_LOCKS": 7,
        "PREPARE_STORE": 8,
        "COMMIT_STORE": 9,
        "PREPARE_RETRIEVE": 10,
        "COMMIT_RETRIEVE": 11,
        "STORE_INLINE": 12,
        "RETRIEVE_INLINE": 13,
        "END_SESSION": 14,
        "CLEAR": 15,
        "REPORT_BLOCK_ALLOCATION": 16,
        "RENEW_LEASES": 17,
        "PIN_PREFIX": 18,
        "UNPIN": 19,
        "CLOSE_AGENT_SESSION": 20,
        "REGISTER_KV_CACHE": 21,
        "UNREGISTER_KV_CACHE": 22,
        "STORE_BLOCKS": 23,
        "RETRIEVE_BLOCKS": 24,
        "PEER_JOIN": 32,
        "PEER_HEARTBEAT": 33,
        "PEER_PUBLISH": 34,
        "PEER_UNPUBLISH": 35,
        "PEER_RESOLVE": 36,
        "PEER_STATUS": 37,
        "PEER_PROMOTE": 38,
    }
    values = [t.value for t in RequestType]
    assert len(values) == len(set(values))


def test_slot_status_values_are_pinned():
    assert {s.name: s.value for s in SlotStatus} == {"ALLOCATED": 0, "EXISTS": 1, "BUSY": 2, "NO_SPACE": 3, "OVER_QUOTA": 4}


def test_slot_statuses_from_the_wire_are_the_enum_and_an_unknown_value_is_refused():
    from kvdepot.types import slot_statuses

    got = slot_statuses([0, 1, 2, 3, 4, 0])
    assert got == [SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY, SlotStatus.NO_SPACE, SlotStatus.OVER_QUOTA, SlotStatus.ALLOCATED]
    assert all(type(s) is SlotStatus for s in got)
    assert slot_statuses(s for s in (1, 1)) == [SlotStatus.EXISTS] * 2  # any iterable, as the inline path passes
    with pytest.raises(ValueError):
        slot_statuses([0, 99])


def test_registry_covers_every_type_with_distinct_request_classes():
    assert set(REGISTRY) == set(RequestType)
    req_classes = [req for req, _ in REGISTRY.values()]
    assert len(req_classes) == len(set(req_classes))
    assert set(REQUESTS) == set(RequestType), "add a sample request for the new type"
    assert set(REPLIES) == set(RequestType), "add a sample reply for the new type"
    for rtype, (req_cls, rep_cls) in REGISTRY.items():
        assert type(REQUESTS[rtype]) is req_cls
        assert type(REPLIES[rtype]) is rep_cls
        assert request_type_of(REQUESTS[rtype]) is rtype


# --- round trips ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rtype", list(RequestType), ids=lambda t: t.name)
def test_every_request_round_trips(rtype):
    body = REQUESTS[rtype]
    frames = encode_request(1234, body, timeout_ms=500)
    assert len(frames) == 2
    header = decode_request_header(frames[0])
    assert (header.version, header.request_id, header.type, header.timeout_ms) == (PROTOCOL_VERSION, 1234, rtype.value, 500)
    got_type, got = decode_request_body(header, frames[1])
    assert got_type is rtype
    assert got == body
    assert type(got) is type(body)


@pytest.mark.parametrize("rtype", list(RequestType), ids=lambda t: t.name)
def test_every_reply_round_trips(rtype):
    body = REPLIES[rtype]
    frames = encode_reply(77, body)
    header = decode_reply_header(frames[0])
    assert (header.version, header.request_id, header.status) == (PROTOCOL_VERSION, 77, 0)
    assert decode_reply_body(rtype, header, frames[1]) == body


def test_request_defaults_survive_a_round_trip():
    frames = encode_request(1, m.FreeLookupLocksRequest(context_id=1, session_id="s"))
    _, got = decode_request_body(decode_request_header(frames[0]), frames[1])
    assert (got.start, got.end) == (0, -1)


def test_memoryview_frames_decode():
    frames = encode_request(9, REQUESTS[RequestType.LOOKUP])
    header = decode_request_header(memoryview(frames[0]))
    assert decode_request_body(header, memoryview(frames[1]))[1] == REQUESTS[RequestType.LOOKUP]


@pytest.mark.parametrize(
    ("code", "cls"), [(ErrorCode.UNKNOWN_LEASE, UnknownLease), (ErrorCode.LEASE_EXPIRED, LeaseExpired)]
)
def test_error_reply_raises_the_matching_exception(code, cls):
    frames = encode_error(5, code, "lease 9 is gone")
    header = decode_reply_header(frames[0])
    assert (header.request_id, header.status) == (5, int(code))
    with pytest.raises(cls) as info:
        decode_reply_body(RequestType.COMMIT_STORE, header, frames[1])
    assert info.value.code is code
    assert info.value.message == "lease 9 is gone"


def test_error_reply_with_an_unknown_code_raises_the_base_error():
    frames = encode_error(5, ErrorCode.NO_SPACE, "full")
    with pytest.raises(KVDepotError) as info:
        decode_reply_body(RequestType.PREPARE_STORE, decode_reply_header(frames[0]), frames[1])
    assert type(info.value) is KVDepotError and info.value.code is ErrorCode.NO_SPACE


# --- decode errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode({"version": 1}),
        msgspec.msgpack.encode([1, 2]),  # too few fields
        msgspec.msgpack.encode(["1", 2, 3, 0]),  # wrong field type
        msgspec.msgpack.encode([1, 2, 3, 0, "x" * 300]),  # decodable (extra fields are ignored), but > 256 bytes
    ],
    ids=["empty", "invalid-msgpack", "map", "short", "wrong-type", "oversized"],
)
def test_bad_request_header_is_bad_request(frame):
    with pytest.raises(ProtocolViolation) as info:
        decode_request_header(frame)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert info.value.request_id == 0


def test_wrong_version_is_version_mismatch_with_the_request_id():
    with pytest.raises(ProtocolViolation) as info:
        decode_request_header(header_frame(version=PROTOCOL_VERSION + 1, request_id=31))
    assert info.value.code is ErrorCode.VERSION_MISMATCH
    assert info.value.request_id == 31


@pytest.mark.parametrize("rtype", [0, max(RequestType) + 1, 999, -1])
def test_unknown_request_type(rtype):
    header = decode_request_header(header_frame(rtype=rtype, request_id=8))
    with pytest.raises(ProtocolViolation) as info:
        decode_request_body(header, msgspec.msgpack.encode({}))
    assert info.value.code is ErrorCode.UNKNOWN_REQUEST_TYPE
    assert info.value.request_id == 8


@pytest.mark.parametrize(
    ("rtype", "body"),
    [
        (RequestType.LOOKUP, {"keys": [b"x"]}),  # context_id missing
        (RequestType.LOOKUP, {"context_id": "7", "keys": [b"x"]}),  # wrong type
        (RequestType.LOOKUP, {"context_id": 7, "keys": [b"x"], "surprise": 1}),  # unknown field
        (RequestType.PING, [1, 2]),  # not a map
        (RequestType.COMMIT_STORE, b"\xc1"),  # not msgpack at all
    ],
    ids=["missing", "wrong-type", "unknown-field", "array", "garbage"],
)
def test_malformed_body_is_bad_request(rtype, body):
    header = decode_request_header(header_frame(rtype=rtype.value, request_id=12))
    frame = body if isinstance(body, bytes) else msgspec.msgpack.encode(body)
    with pytest.raises(ProtocolViolation) as info:
        decode_request_body(header, frame)
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert info.value.request_id == 12


@pytest.mark.parametrize("body", [{"scope": "A" * (4 << 20)}, {"B" * (4 << 20): 1}], ids=["huge-value", "huge-field-name"])
def test_a_malformed_body_is_described_briefly_however_large_its_bad_value(body):
    """The decoder's message quotes the offending value whole: it went back to the client, into the
    log and into the recent-events ring (512 of them kept), megabytes each."""
    header = decode_request_header(header_frame(rtype=RequestType.CLEAR.value, request_id=14))
    with pytest.raises(ProtocolViolation) as info:
        decode_request_body(header, msgspec.msgpack.encode(body))
    assert info.value.code is ErrorCode.BAD_REQUEST
    assert len(info.value.message) < 600 and "characters in all" in info.value.message


def test_body_too_large_is_message_too_large():
    header = decode_request_header(header_frame(rtype=RequestType.PING.value, request_id=13))
    with pytest.raises(ProtocolViolation) as info:
        decode_request_body(header, b"\x80" + bytes(MAX_BODY_BYTES))
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    assert info.value.request_id == 13


def test_body_of_exactly_the_limit_is_not_too_large():
    header = decode_request_header(header_frame(rtype=RequestType.LOOKUP.value))
    key = b"k" * (MAX_BODY_BYTES - 64)
    frame = msgspec.msgpack.encode({"context_id": 1, "keys": [key]})
    frame = msgspec.msgpack.encode({"context_id": 1, "keys": [b"k" * (len(key) + MAX_BODY_BYTES - len(frame))]})
    assert len(frame) == MAX_BODY_BYTES
    assert decode_request_body(header, frame)[0] is RequestType.LOOKUP


def test_malformed_reply_is_bad_request():
    header = decode_reply_header(encode_reply(1, m.PingReply())[0])
    with pytest.raises(ProtocolViolation) as info:
        decode_reply_body(RequestType.CLEAR, header, msgspec.msgpack.encode({"removed": "many"}))
    assert info.value.code is ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolViolation):
        decode_reply_header(b"\xc1")


# --- payload frames ---------------------------------------------------------------------------------


def test_rows_per_frame_for():
    assert rows_per_frame_for(1000, 10, 250) == 2  # 100-byte rows, 2 per frame
    assert rows_per_frame_for(1000, 10, 99) == 0  # one row does not fit
    assert rows_per_frame_for(1000, 10, 100) == 1
    assert rows_per_frame_for(1000, 10, 1 << 20) == 10  # never more rows than there are


def test_frame_sizes_groups_whole_rows():
    assert frame_sizes(48, 4, 3, 40) == [36, 12]  # 12-byte rows: 3 + 1
    assert frame_sizes(48, 4, 2, 40) == [24, 24]
    assert frame_sizes(48, 4, 4, 48) == [48]
    assert frame_sizes(48, 4, 1, 12) == [12, 12, 12, 12]


def test_frame_sizes_byte_split_when_rows_per_frame_is_zero():
    assert frame_sizes(100, 2, 0, 30) == [30, 30, 30, 10]
    assert frame_sizes(90, 2, 0, 30) == [30, 30, 30]
    assert frame_sizes(0, 1, 0, 30) == []


@pytest.mark.parametrize(
    ("object_bytes", "rows", "rows_per_frame", "max_frame"),
    [(48, 5, 1, 100), (48, 0, 1, 100), (48, -4, 1, 100), (48, 4, 4, 47), (48, 4, -1, 100)],
    ids=["rows-do-not-divide", "zero-rows", "negative-rows", "group-exceeds-frame", "negative-group"],
)
def test_frame_sizes_rejects_impossible_splits(object_bytes, rows, rows_per_frame, max_frame):
    with pytest.raises(ValueError):
        frame_sizes(object_bytes, rows, rows_per_frame, max_frame)


def test_split_object_gives_views_in_order():
    buf = bytearray(range(48))
    frames = split_object(buf, 4, 3, 40)
    assert [bytes(f) for f in frames] == [bytes(range(36)), bytes(range(36, 48))]
    buf[40] = 0xFF  # views, not copies
    assert frames[1][4] == 0xFF


def test_split_object_of_a_typed_array_splits_bytes():
    import numpy as np

    arr = np.arange(12, dtype=np.uint16)  # 24 bytes, 4 rows of 6 bytes
    frames = split_object(arr, 4, 0, 10)
    assert [len(f) for f in frames] == [10, 10, 4]
    assert b"".join(bytes(f) for f in frames) == arr.tobytes()


def test_check_payload_accepts_the_agreed_split():
    frames = split_object(bytes(48), 4, 3, 40) * 3
    assert check_payload(frames, 3, 48, 4, 3, 40, request_id=1) == 2
    assert check_payload([], 0, 48, 4, 3, 40, request_id=1) == 2


@pytest.mark.parametrize(
    "frames",
    [[b"x" * 36], [b"x" * 36, b"x" * 12, b"x" * 12], [b"x" * 12, b"x" * 36], [b"x" * 36, b"x" * 11]],
    ids=["too-few", "too-many", "swapped", "short-frame"],
)
def test_check_payload_rejects_mismatched_frames(frames):
    with pytest.raises(ProtocolViolation) as info:
        check_payload(frames, 1, 48, 4, 3, 40, request_id=21)
    assert info.value.code is ErrorCode.PAYLOAD_MISMATCH
    assert info.value.request_id == 21


def test_check_payload_rejects_an_impossible_split_as_payload_mismatch():
    with pytest.raises(ProtocolViolation) as info:
        check_payload([b"x" * 48], 1, 48, 4, 4, 40, request_id=22)  # 4 rows of 12 exceed 40
    assert info.value.code is ErrorCode.PAYLOAD_MISMATCH
    assert info.value.request_id == 22


def test_default_limits():
    assert MAX_FRAME_BYTES == 16 << 20 and RpcConfig().max_frame_bytes == MAX_FRAME_BYTES  # one source
    assert codec.MAX_BODY_BYTES == 8 << 20


@pytest.mark.parametrize(
    "body",
    [
        m.LookupRequest(context_id=1, keys=KEYS),
        m.PrepareStoreRequest(context_id=1, keys=KEYS),
        m.StoreInlineRequest(context_id=1, keys=KEYS, rows_per_frame=4),
    ],
    ids=lambda b: type(b).__name__,
)
def test_agent_session_is_left_off_the_wire_when_unused(body):
    """Protocol 4 servers refuse unknown fields: a client that names no agent session must send exactly
    the fields they know, so the field's addition needs no version bump."""
    plain = msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    assert "agent_session" not in plain
    body.agent_session = "conv"
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(body))["agent_session"] == "conv"
