"""A peer cluster under membership churn (autoscaling): many in-process nodes with small pools, nodes
that leave several at a time, masters that leave one after another, and nodes that join meanwhile.

Every byte read is checked against what was written under its key (``page_bytes``): a read is a miss or
exactly those bytes. Nodes heartbeat every 0.3 s and expire after 1.5 s here.
"""

from __future__ import annotations

import time

from support.peer_cluster import check_pages, keys, page_bytes, wait_for

from kvdepot.peer import PeerStore

SIZE = 4096
SECRET = "churn-test-secret"
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0, "metrics_port": 0}


def store(discovery: str = "", **options) -> PeerStore:
    return PeerStore(discovery=discovery, secret=SECRET, port=0, data_port=0, pool_size_mb=2, **{**FAST, **options})


def cluster(n: int, **options) -> list[PeerStore]:
    head = store(**options)
    nodes = [head] + [store(head.node_id, **options) for _ in range(n - 1)]
    wait_for(lambda: all(len(s.node.members()) == n for s in nodes), 15, f"{n} members")
    return nodes


def fill(nodes: list[PeerStore], count: int = 20) -> dict[str, list[str]]:
    """``count`` pages on each node, named after it; returns node id -> its page names."""
    written = {}
    for i, s in enumerate(nodes):
        names = keys(f"p{i}-", count)
        assert all(s.batch_set(names, [page_bytes(k, SIZE) for k in names]))
        written[s.node_id] = names
    return written


def never_wrong(nodes: list[PeerStore], written: dict[str, list[str]]) -> int:
    """Read every live node's pages through every live node: each a miss or exactly its bytes (asserted);
    returns the hits."""
    hits = 0
    for s in nodes:
        for names in written.values():
            got = check_pages(s, names[0][: names[0].index("-") + 1], len(names), SIZE)
            assert got["wrong"] == 0, got
            hits += got["hit"]
    return hits


def test_masters_that_leave_one_after_another_within_a_ttl_are_replaced():
    """The head and the other two masters go one after another, each before the survivors expired the
    one before: no live master was left to expire them, so no node was ever promoted, and every node
    kept the dead masters (and their records, and owners for a share of every key) for good."""
    nodes = cluster(7)
    try:
        written = fill(nodes)
        masters = nodes[0].node.masters()
        assert len(masters) == 3
        for mid in masters:
            next(s for s in nodes if s.node_id == mid).close()
            time.sleep(0.5)  # a third of the TTL apart
        live = [s for s in nodes if s.node_id not in masters]
        wait_for(lambda: all(len(s.node.members()) == len(live) for s in live), 10, "the dead masters to leave every live node's view")
        ids = {s.node_id for s in live}
        for s in live:
            assert set(s.node.masters()) <= ids and len(s.node.masters()) == 3, (s.node_id, s.node.masters())
        gone_pages = [k for nid in masters for k in written[nid]]
        written = {nid: names for nid, names in written.items() if nid in ids}
        assert never_wrong(live, written) > 0
        # No shard keeps a record of a page of a node that left.
        for s in live:
            assert {loc.node for found in s.node.shard.resolve([k.encode() for k in gone_pages]) for loc in found} == set(), s.node_id
        late = store(live[0].node.masters()[0])  # and a node that joins now, through a new master, is served
        try:
            wait_for(lambda: all(len(s.node.members()) == len(live) + 1 for s in [*live, late]), 10, "a newcomer to join every live node's view")
        finally:
            late.close()
    finally:
        for s in nodes:
            s.close()


def test_a_republish_with_several_dead_owners_in_the_ring_does_not_stall_the_heartbeat():
    """Several nodes vanish at once (a scale-down) and another joins before they expire: every node
    re-publishes under a ring that still names the dead ones, and waited a full control timeout on each
    of them in turn, on the heartbeat thread. Its heartbeats stopped for longer than the TTL: it took
    itself for a node that had been away (a new run, every other node's record dropped from its shard, a
    whole-cluster re-publish), and the masters could expire it, live as it was."""
    nodes = cluster(9)
    try:
        written = fill(nodes)
        masters = set(nodes[0].node.masters())
        gone = [s for s in nodes if s.node_id not in masters][:4]
        live = [s for s in nodes if s not in gone]
        runs = {s.node_id: s.node.info.incarnation for s in live}
        for s in gone:
            s.close()
        late = store(nodes[0].node_id)  # joins while the four are still members
        try:
            live.append(late)
            wait_for(lambda: all(len(s.node.members()) == len(live) for s in live), 10, "the vanished nodes to leave")
            time.sleep(1.0)
            renewed = [nid for nid, run in runs.items() if next(s for s in live if s.node_id == nid).node.info.incarnation != run]
            assert not renewed, f"{len(renewed)} live nodes took themselves for nodes that had been away: {renewed}"
            assert never_wrong(live, {nid: names for nid, names in written.items() if nid in runs}) > 0
        finally:
            late.close()
    finally:
        for s in nodes:
            s.close()


def test_a_node_bootstrapping_through_a_non_master_while_the_head_is_down_joins():
    """``discovery=HEAD,OTHER``: OTHER is there to bootstrap through when the head is down. A node that
    is not a master answers with its cached view (no table); the newcomer, whose own first view names it
    the only master, took itself for a master, ignored that view and kept its own table (itself): it
    said it had joined, yet saw no one and no one saw it, for good."""
    nodes = cluster(5)
    try:
        head, rest = nodes[0], nodes[1:]
        written = fill(rest, 5)
        head.close()
        wait_for(lambda: all(len(s.node.members()) == 4 for s in rest), 10, "the head to leave")
        other = next(s for s in rest if s.node_id not in s.node.masters())
        with store(f"{head.node_id},{other.node_id}") as late:
            live = [*rest, late]
            wait_for(lambda: all(len(s.node.members()) == 5 for s in live), 10, "the newcomer in every node's view")
            # Its pages are found and read, as the others' are.
            every = [k for names in written.values() for k in names]
            wait_for(lambda: late.batch_exists(every) == len(every), 10, "the newcomer to find every page")
            assert never_wrong([late], written) == sum(map(len, written.values()))
    finally:
        for s in nodes:
            s.close()
