"""A peer cluster in a rolling upgrade: nodes of an earlier version beside this one.

Nodes of versions before 2026-11-27 publish directory records without an incarnation (the field came
later, with a default of 0). ``data/peer_publish_2026-11-27.msgpack`` is a PEER_PUBLISH request such a
node sent, frozen as its frames (header, body): this version must keep decoding it, and must keep serving
the pages such a node publishes, whichever run of that node the membership names.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import msgspec
import pytest
import xxhash
from support.peer_cluster import check_pages, keys, page_bytes, wait_for

from kvdepot.errors import BadRequest
from kvdepot.peer import PeerStore
from kvdepot.peer.directory import LEGACY_RUN, DirectoryShard
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m

DATA = Path(__file__).parent / "data"
SIZE = 64 << 10
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0, "metrics_port": 0}


def legacy_publish() -> m.PeerPublishRequest:
    header_frame, body_frame = msgspec.msgpack.decode((DATA / "peer_publish_2026-11-27.msgpack").read_bytes())
    header = codec.decode_request_header(header_frame)
    rtype, body = codec.decode_request_body(header, body_frame)
    assert rtype is m.RequestType.PEER_PUBLISH
    return body


def test_a_record_from_a_node_before_incarnations_decodes_and_is_kept_across_that_node_s_runs():
    body = legacy_publish()
    (rec,) = body.records
    page = bytes(range(256)) * 16
    assert (rec.key, rec.node, rec.offset, rec.length, rec.generation) == (b"page-0", "10.0.0.7:31995", 2048, len(page), 3)
    assert rec.checksum == xxhash.xxh3_128(page).digest() and rec.resident and rec.incarnation == 0
    shard = DirectoryShard()
    # The membership names the node's run (every node has sent one since the first peer tier), and a
    # restart of it drops what its earlier run published ...
    shard.publish(body.records)
    shard.drop_incarnations_before(rec.node, 1_764_000_000_000_000_000)
    assert shard.resolve([rec.key]) == [[]]
    # ... but what the new run publishes (again without an incarnation) is its own, and kept.
    assert shard.publish(body.records) == 1
    assert shard.resolve([rec.key]) == [[rec]]


def _as_before_incarnations(store: PeerStore) -> None:
    """Make ``store``'s node publish records as a node of a version before 2026-11-27 does."""
    record = store.node._record
    store.node._record = lambda *a, **k: msgspec.structs.replace(record(*a, **k), incarnation=0)


def test_a_node_reads_the_pages_of_a_node_from_before_incarnations(caplog):
    caplog.set_level(logging.WARNING, logger="kvdepot.peer.node")
    with PeerStore(discovery="", secret="mixed", port=0, data_port=0, pool_size_mb=32, **FAST) as new:
        with PeerStore(discovery=new.node_id, secret="mixed", port=0, data_port=0, pool_size_mb=32, **FAST) as old:
            _as_before_incarnations(old)
            wait_for(lambda: len(new.status()["members"]) == 2 and len(old.status()["members"]) == 2, 15, "both nodes to see two members")
            names = keys("o", 20)
            assert old.batch_set(names, [page_bytes(k, SIZE) for k in names]) == [True] * 20
            got = wait_for(lambda: (r := check_pages(new, "o", 20, SIZE))["hit"] == 20 and r, 10,
                           "the newer node to read every page the older one published")  # fmt: skip
            assert got == {"hit": 20, "miss": 0, "wrong": 0}
            assert new.batch_exists(names) == 20
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"peer {new.node_id}: node {old.node_id} runs")]
    assert len(said) == 1 and "before 2026-11-27" in said[0], said


# What a node before 2026-11-27 answers a PEER_PUBLISH of this version's records (its PeerLocation has no
# `incarnation` and forbids unknown fields): msgspec's refusal, as such a node (f863c2b) sends it.
OLD_REFUSAL = "malformed PEER_PUBLISH body: ValidationError: Object contains unknown field `incarnation` - at `$.records[0]`"


def _refusing_incarnations(store: PeerStore) -> None:
    """Make ``store``'s node refuse the records of newer nodes as a node before 2026-11-27 does."""
    serve = store.node._serve_shard

    def serve_as_before(body):
        if isinstance(body, m.PeerPublishRequest) and any(r.incarnation != LEGACY_RUN for r in body.records):
            raise BadRequest(OLD_REFUSAL)
        return serve(body)

    store.node._serve_shard = serve_as_before


def test_a_node_reads_the_pages_of_a_node_from_before_incarnations_that_refuses_its_records():
    """The older node refuses every record the newer one publishes to it: that is an answer, not a dead
    node. Its pages stay readable (it was suspected at every refused publish, and the refused records
    owed and sent again on every heartbeat, so every page of it read as a miss for good), and what it
    refused is not owed again (it refuses it every time: past the owed bound, the newer node published
    every page it holds again on every heartbeat)."""
    with PeerStore(discovery="", secret="mixed", port=0, data_port=0, pool_size_mb=32, **FAST) as new:
        with PeerStore(discovery=new.node_id, secret="mixed", port=0, data_port=0, pool_size_mb=32, **FAST) as old:
            _as_before_incarnations(old)
            _refusing_incarnations(old)
            wait_for(lambda: len(new.status()["members"]) == 2 and len(old.status()["members"]) == 2, 15, "both nodes to see two members")
            names = keys("o", 20)
            assert old.batch_set(names, [page_bytes(k, SIZE) for k in names]) == [True] * 20
            mine = keys("n", 20)
            assert new.batch_set(mine, [page_bytes(k, SIZE) for k in mine]) == [True] * 20  # its publishes to `old` are refused
            time.sleep(3 * FAST["heartbeat_interval_s"])  # heartbeats that would repay what was refused
            assert check_pages(new, "o", 20, SIZE) == {"hit": 20, "miss": 0, "wrong": 0}
            assert new.batch_exists(names) == 20
            assert len(new.node.owed) == 0


class _LegacyBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class _LegacyPeerLocation(_LegacyBody):
    """``PeerLocation`` as a node before 2026-11-27 (f863c2b) decodes it: no ``incarnation``, and unknown
    fields refused."""

    key: bytes
    node: str
    offset: int
    length: int
    generation: int
    checksum: bytes
    resident: bool = True


class _LegacyPeerResolveReply(_LegacyBody):
    locations: list[list[_LegacyPeerLocation]]


def test_a_node_from_before_incarnations_decodes_a_newer_shard_s_answer_naming_its_version_s_pages():
    """A newer node is the directory owner of some keys of an older node's pages (the ring takes no
    version into account). An older node that resolves them there must be able to decode the answer:
    those records carry no incarnation, and one sent as ``incarnation: 0`` made the whole answer
    undecodable to it, so it found none of those pages of its own version for the whole upgrade."""
    shard = DirectoryShard()
    shard.publish(legacy_publish().records)  # what the older node published to the newer owner
    _, body_frame = codec.encode_reply(7, m.PeerResolveReply(locations=shard.resolve([b"page-0", b"absent"])))
    reply = msgspec.msgpack.decode(body_frame, type=_LegacyPeerResolveReply)
    ((rec,), none) = reply.locations
    assert (rec.key, rec.node, rec.offset, rec.generation, rec.resident) == (b"page-0", "10.0.0.7:31995", 2048, 3, True) and none == []
    # (The older decoder is as strict as that node's: a newer node's record, which names its run, it refuses.)
    newer = m.PeerLocation(key=b"k", node="n", offset=0, length=1, generation=1, checksum=b"", incarnation=5)
    with pytest.raises(msgspec.ValidationError, match="incarnation"):
        msgspec.msgpack.decode(codec.encode_reply(8, m.PeerResolveReply(locations=[[newer]]))[1], type=_LegacyPeerResolveReply)
