"""What a reader remembers of where pages were (``peer/locations.py``), alone and in a live pair of nodes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.peer_cluster import check_names, keys, page_bytes, wait_for

from kvdepot.errors import ConfigError
from kvdepot.peer import PeerStore, locations
from kvdepot.peer.config import PeerConfig
from kvdepot.peer.locations import LocationCache
from kvdepot.protocol.messages import PeerLocation, PeerResolveRequest

FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "secret": "locations", "metrics_port": 0}
SIZE = 128 << 10


def loc(key: bytes, node: str = "n1", resident: bool = True, generation: int = 1, incarnation: int = 0) -> PeerLocation:
    return PeerLocation(key=key, node=node, offset=0, length=8, generation=generation, checksum=b"\0" * 16, resident=resident,
                        incarnation=incarnation)  # fmt: skip


def test_remembers_resident_pages_on_usable_nodes_until_the_ttl(monkeypatch):
    # The cache's own clock, moved by hand: with real time, a loaded machine that holds this test up
    # for a TTL between a put and the get after it would expire entries the test expects to find.
    now = [1000.0]
    monkeypatch.setattr(locations, "time", SimpleNamespace(monotonic=lambda: now[0]))
    cache = LocationCache(ttl_s=0.2)
    cache.put_many([loc(b"a"), loc(b"b", node="n2"), loc(b"c", resident=False), None])
    assert cache.get_many([b"a", b"b", b"c", b"d"], {"n1": 0, "n2": 0}) == [loc(b"a"), loc(b"b", node="n2"), None, None]
    # A node that left (or failed a call) is not read from, and what pointed there is dropped.
    assert cache.get_many([b"a", b"b"], {"n1": 0}) == [loc(b"a"), None]
    assert cache.get_many([b"b"], {"n1": 0, "n2": 0}) == [None]
    cache.forget([b"a"])
    assert cache.get_many([b"a"], {"n1": 0}) == [None]
    cache.put_many([loc(b"e", generation=7)])
    now[0] += 0.19
    assert cache.get_many([b"e"], {"n1": 0}) == [loc(b"e", generation=7)]
    now[0] += 0.02  # past the TTL
    assert cache.get_many([b"e"], {"n1": 0}) == [None]
    assert len(cache) == 0


def test_a_newer_location_replaces_the_old_and_the_bound_keeps_the_newest():
    cache = LocationCache(ttl_s=60, max_entries=8)
    cache.put_many([loc(b"k", generation=1)])
    cache.put_many([loc(b"k", generation=2)])
    assert cache.get_many([b"k"], {"n1": 0})[0].generation == 2
    cache.put_many([loc(bytes([i])) for i in range(9)])  # one more than the bound: shrunk to 3/4
    assert len(cache) == 6
    assert cache.get_many([bytes([8]), bytes([0])], {"n1": 0}) == [loc(bytes([8])), None]


def test_a_location_from_a_run_of_its_node_before_the_one_known_now_is_forgotten():
    # Killed and restarted on its port (its id) within the TTL: the earlier run's pages are gone.
    cache = LocationCache(ttl_s=60)
    cache.put_many([loc(b"old", incarnation=5), loc(b"new", incarnation=9)])
    assert cache.get_many([b"old", b"new"], {"n1": 9}) == [None, loc(b"new", incarnation=9)]
    assert cache.get_many([b"old"], {"n1": 5}) == [None]  # dropped, not just hidden
    # A reader whose view lags (it has not heard of the restart yet) still reads the newer run's pages.
    assert cache.get_many([b"new"], {"n1": 5}) == [loc(b"new", incarnation=9)]


def test_a_location_is_always_remembered_for_a_while():
    # The server's peer tier loads what its lookup found (a router's hint included) from this memory.
    with pytest.raises(ConfigError, match="location_cache_s"):
        PeerConfig(location_cache_s=0)


def test_a_page_read_again_skips_the_directory_and_a_stale_location_is_looked_up_again():
    owner = PeerStore(port=0, data_port=0, pool_size_mb=16, **FAST)
    reader = PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=16, **FAST)
    try:
        wait_for(lambda: len(reader.status()["members"]) == 2, 10, "two members")
        names = keys("r", 4)
        assert owner.batch_set(names, [page_bytes(n, SIZE, 1) for n in names]) == [True] * 4
        assert check_names(reader, names, SIZE, [1]) == {"hit": 4, "miss": 0, "wrong": 0}
        before = reader.node.metrics.summary()
        assert check_names(reader, names, SIZE, [1]) == {"hit": 4, "miss": 0, "wrong": 0}
        after = reader.node.metrics.summary()
        assert after["remembered_locations"] - before["remembered_locations"] == 4
        assert after["lookups"] == before["lookups"], "the directory was asked again"
        # Rewritten (a new generation): the owner no longer serves the remembered one, so the reader
        # looks the keys up again and reads the new bytes, never the old page's.
        assert owner.batch_set(names, [page_bytes(n, SIZE, 2) for n in names]) == [True] * 4
        assert check_names(reader, names, SIZE, [2]) == {"hit": 4, "miss": 0, "wrong": 0}
        assert reader.node.metrics.summary()["relookups"] - after["relookups"] == 4
        # Deleted: a clean miss, though the reader remembered where the pages were.
        for n in names:
            assert owner.delete(n)
        assert check_names(reader, names, SIZE, [2]) == {"hit": 0, "miss": 4, "wrong": 0}
        # An existence check always asks the directory: it never answers from memory.
        assert owner.batch_set(names[:1], [page_bytes(names[0], SIZE, 3)]) == [True]
        assert reader.batch_get(names[:1]) == [page_bytes(names[0], SIZE, 3)]
        owner.delete(names[0])
        assert reader.batch_exists(names[:1]) == 0
    finally:
        reader.close()
        owner.close()


def test_a_stale_record_on_the_first_replica_does_not_hide_the_fresh_one_on_the_next():
    """A publish that did not reach one owner of a key's record (it was stalled, or the ring was
    changing) leaves that shard naming an old generation. A reader that finds the page gone from there
    asks the next replica instead of taking the same stale record again, and reads the new bytes."""
    owner = PeerStore(port=0, data_port=0, pool_size_mb=16, **FAST)
    reader = PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=16, **FAST)
    try:
        wait_for(lambda: len(reader.status()["members"]) == 2 and len(owner.status()["members"]) == 2, 10, "two members")
        [name] = keys("stale", 1)
        key = name.encode()
        nodes = {owner.node_id: owner.node, reader.node_id: reader.node}
        first = nodes[reader.node._ring.owners(key, 2)[0]]
        assert owner.batch_set([name], [page_bytes(name, SIZE, 1)]) == [True]
        wait_for(lambda: first.shard.resolve([key])[0], 5, "the first owner's record")
        [old] = first.shard.resolve([key])[0]
        assert owner.batch_set([name], [page_bytes(name, SIZE, 2)]) == [True]
        wait_for(lambda: first.shard.resolve([key])[0][0].generation != old.generation, 5, "the new record")
        [new] = first.shard.resolve([key])[0]
        # As if the second publish never reached the first owner: it names the old generation only.
        first.shard.unpublish([key], new.node, [new.generation])
        assert first.shard.publish([old]) == 1
        reader.node.located.clear()
        assert check_names(reader, [name], SIZE, [2]) == {"hit": 1, "miss": 0, "wrong": 0}
    finally:
        reader.close()
        owner.close()


def _resolves_sent(node, monkeypatch) -> list[tuple[str, int]]:
    """(owner, keys) of every directory lookup ``node`` sends from now on."""
    sent: list[tuple[str, int]] = []
    begin = node._begin

    def spy(owner, body, deadline):
        if isinstance(body, PeerResolveRequest):
            sent.append((owner, len(body.keys)))
        return begin(owner, body, deadline)

    monkeypatch.setattr(node, "_begin", spy)
    return sent


def test_a_reader_that_holds_a_keys_record_reads_it_without_a_directory_round_trip(monkeypatch):
    """In a cluster of ``directory_replicas`` nodes every node holds every record: a first read asks no
    other node where a page is. A record here that is stale (an unpublish that has not reached this
    replica) is caught by the read and becomes a miss, never the old bytes."""
    owner = PeerStore(port=0, data_port=0, pool_size_mb=16, **FAST)
    reader = PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=16, **FAST)
    try:
        wait_for(lambda: len(reader.status()["members"]) == 2 and len(owner.status()["members"]) == 2, 10, "two members")
        names = keys("own", 6)
        assert owner.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 6
        wait_for(lambda: all(reader.node.shard.resolve([n.encode() for n in names])), 5, "the reader's replica of every record")
        sent = _resolves_sent(reader.node, monkeypatch)
        before = reader.node.metrics.summary()["local_lookups"]
        assert check_names(reader, names, SIZE, [0]) == {"hit": 6, "miss": 0, "wrong": 0}
        assert sent == [], "the reader asked another node for records it holds"
        assert reader.node.metrics.summary()["local_lookups"] - before == 6
        # Deleted on the owner, but the reader's replica still names the page (its unpublish was lost).
        key = names[0].encode()
        [stale] = reader.node.shard.resolve([key])[0]
        assert owner.delete(names[0])
        reader.node.shard.publish([stale])
        reader.node.located.clear()
        assert check_names(reader, names[:1], SIZE, [0]) == {"hit": 0, "miss": 1, "wrong": 0}
        assert sent, "the stale record was not checked against the other owner"
    finally:
        reader.close()
        owner.close()


def test_records_this_node_does_not_hold_are_asked_of_their_owners(monkeypatch):
    nodes = [PeerStore(port=0, data_port=0, pool_size_mb=16, **FAST)]
    nodes += [PeerStore(discovery=nodes[0].node_id, port=0, data_port=0, pool_size_mb=16, **FAST) for _ in range(2)]
    owner, _, reader = nodes
    try:
        wait_for(lambda: all(len(n.status()["members"]) == 3 for n in nodes), 10, "three members")
        names = keys("far", 24)
        assert owner.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 24
        elsewhere = [n for n in names if reader.node_id not in reader.node._ring.owners(n.encode(), 2)]
        assert 0 < len(elsewhere) < len(names), "24 keys over 3 nodes: some records live elsewhere, some here"
        sent = _resolves_sent(reader.node, monkeypatch)
        assert check_names(reader, names, SIZE, [0]) == {"hit": 24, "miss": 0, "wrong": 0}
        assert sum(n for _, n in sent) == len(elsewhere)
        assert reader.node_id not in {o for o, _ in sent}
    finally:
        for n in reversed(nodes):
            n.close()
