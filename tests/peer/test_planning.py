"""Where to read from (a router's hint) and whether to read at all (pull or recompute)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from support.peer_cluster import keys, page_bytes, wait_for

from kvdepot.peer import PeerStore, planner
from kvdepot.peer.planner import PullPlanner, Reason

SIZE = 512 << 10
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "secret": "planning", "metrics_port": 0}


def cluster(n: int) -> list[PeerStore]:
    head = PeerStore(port=0, data_port=0, pool_size_mb=16, **FAST)
    nodes = [head] + [PeerStore(discovery=head.node_id, port=0, data_port=0, pool_size_mb=16, **FAST) for _ in range(n - 1)]
    wait_for(lambda: all(len(s.status()["members"]) == n for s in nodes), 10, f"{n} members")
    return nodes


def test_a_hint_finds_pages_the_directory_lost_and_a_wrong_hint_falls_back_to_the_ring():
    a, b, reader = cluster(3)
    try:
        names = keys("h", 6)
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 6
        assert reader.batch_exists(names) == 6
        # A wrong hint (a node that holds none of them, or no node at all): the directory answers.
        assert reader.batch_exists(names, hint=b.node_id) == 6
        assert reader.batch_exists(names, hint="10.9.9.9:8000") == 6
        # The directory loses every record (as right after a re-shard): only the hint can find them.
        for s in (a, b, reader):
            s.node.shard.keep_nodes(())
        assert reader.batch_exists(names) == 0
        host = a.node_id.rsplit(":", 1)[0]
        assert reader.batch_exists(names, hint=a.node_id) == 6  # host:port of the node
        reader.node.located.clear()  # else the reader reads where that lookup found them, hint unasked
        got = reader.batch_get(names, hint=host)  # or just its host (the engine's address, as llm-d passes it)
        assert all(g == page_bytes(n, SIZE) for g, n in zip(got, names, strict=True))
        hints = reader.node.metrics.summary()["hints"]
        assert hints["found"] >= 12 and hints["missing"] >= 6, hints
    finally:
        for s in (reader, b, a):
            s.close()


def test_pulls_that_would_lose_to_recomputing_are_skipped_and_counted():
    a, reader = cluster(2)
    try:
        names = keys("p", 8)
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 8
        bufs = [bytearray(SIZE) for _ in names]
        # No estimate yet: pull (and learn the peer's bandwidth).
        assert reader.batch_get_into(names, bufs, recompute_s=1e-9) == [True] * 8
        est = reader.status()["peers"][a.node_id]
        assert est["bandwidth_bytes_per_s"] > 0 and est["rtt_s"] > 0, est
        # Recomputing is estimated faster than pulling 4 MiB: skipped, a miss the engine recomputes.
        assert reader.batch_get_into(names, bufs, recompute_s=1e-6) == [False] * 8
        # Pulling is faster than a slow prefill: pulled.
        assert reader.batch_get_into(names, bufs, recompute_s=60.0) == [True] * 8
        assert all(bytes(buf) == page_bytes(n, SIZE) for buf, n in zip(bufs, names, strict=True))
        decisions = reader.status()["pull_decisions"]
        assert decisions == {"pull/no_estimate": 1, "recompute/pull_slower": 1, "pull/pull_faster": 1}, decisions
        # A node's own pages are never weighed: a local read is one memcpy.
        assert a.batch_get_into(names[:1], bufs[:1], recompute_s=1e-6) == [True]
        # A lookup weighs alike, so that a scheduler never plans a load the read would decline.
        assert reader.batch_exists(names, recompute_s=1e-6) == 0
        assert reader.batch_exists(names, recompute_s=60.0) == 8
        assert a.batch_exists(names, recompute_s=1e-6) == 8
        assert reader.status()["pull_decisions"]["recompute/pull_slower"] == 2
    finally:
        reader.close()
        a.close()


def test_a_read_cut_short_by_its_deadline_teaches_the_planner_nothing():
    """A page that does not come within the read's deadline: the hit bytes over the whole wait made a
    sample that said the peer was slow, and the planner then refused every pull from it."""
    a, reader = cluster(2)
    try:
        names = ["fast", "slow"]
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True, True]
        gate = threading.Event()
        real = a.node.pool.acquire

        def acquire(key: bytes, generation: int = 0):
            if key == b"slow":  # the owner's data plane stalls on this page until released
                gate.wait(10)
            return real(key, generation)

        a.node.pool.acquire = acquire
        bufs = [bytearray(SIZE) for _ in names]
        try:
            assert reader.batch_get_into(names, bufs, timeout_s=0.5) == [True, False]
        finally:
            gate.set()
        assert reader.status()["peers"].get(a.node_id, {}).get("bandwidth_bytes_per_s", 0.0) == 0.0
    finally:
        reader.close()
        a.close()


def test_an_estimate_with_no_sample_for_a_while_lets_a_pull_probe_and_starts_afresh(monkeypatch):
    """An estimate that refuses every pull gets no new sample (no pull, no sample): once it is
    ``STALE_S`` old, a pull is let through to measure again, and that sample replaces it."""
    now = [1000.0]
    monkeypatch.setattr(planner, "time", SimpleNamespace(monotonic=lambda: now[0]), raising=False)
    p = PullPlanner()
    p.read_measured("B", 1 << 20, 0.8)  # slow once: 1.3 MB/s
    assert p.decide({"B": 64 << 20}, 0.05).reason is Reason.SLOWER
    now[0] += getattr(planner, "STALE_S", 60.0) + 1
    probe = p.decide({"B": 64 << 20}, 0.05)
    assert probe.pull and probe.reason is Reason.NO_ESTIMATE
    p.read_measured("B", 64 << 20, 0.01)  # the probe: 6.7 GB/s
    assert p.decide({"B": 64 << 20}, 0.05).reason is Reason.FASTER


def test_a_slow_directory_owner_does_not_make_a_fast_peer_look_slow():
    """A resolve asks every owner at once and collects their replies one after another: a reply that
    came while a slower owner was still being waited on was timed from its send to its collection, so
    the slow owner's delay (up to ``control_timeout_s``: a dead node) became the fast peer's round trip,
    and pulls from it were refused as slower than recomputing until enough other samples diluted it."""
    a, slow, reader = cluster(3)
    try:
        ring = reader.node._ring
        owned_by = lambda node, prefix, n: [k for k in (f"{prefix}{i}" for i in range(100_000)) if ring.owners(k.encode(), 2)[0] == node][:n]  # noqa: E731
        names = owned_by(slow.node_id, "s", 1) + owned_by(a.node_id, "a", 7)  # the slow owner's reply is collected first
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 8
        bufs = [bytearray(SIZE) for _ in names]
        assert reader.batch_get_into(names, bufs, recompute_s=60.0) == [True] * 8  # learns a's bandwidth
        real = slow.node._serve_shard

        def lagging(body):
            time.sleep(0.4)  # within control_timeout_s (0.5): answered, only late
            return real(body)

        slow.node._serve_shard = lagging
        try:
            assert reader.batch_exists(names) == 8
        finally:
            slow.node._serve_shard = real
        assert reader.status()["peers"][a.node_id]["rtt_s"] < 0.05, reader.status()["peers"]
        # 4 MiB from a on loopback: milliseconds; recomputing is estimated at 60 ms.
        assert reader.batch_get_into(names, bufs, recompute_s=0.06) == [True] * 8
        assert all(bytes(buf) == page_bytes(n, SIZE) for buf, n in zip(bufs, names, strict=True))
    finally:
        for s in (reader, slow, a):
            s.close()


def test_a_hinted_node_that_does_not_answer_leaves_the_ring_time_to_answer():
    """A router's hint names a node that stalls (dead, not yet expired from the ring). With a read's
    budget under ``control_timeout_s`` (SGLang passes a share of its own) the hint took all of it: the
    ring was never asked, and every page was a miss for as long as the hint was wrong."""
    a, stalled, reader = cluster(3)
    try:
        names = keys("d", 6)
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 6
        real = stalled.node._serve_shard
        gate = threading.Event()

        def hanging(body):
            if getattr(body, "own_pages", False):
                gate.wait(5)
            return real(body)

        stalled.node._serve_shard = hanging
        try:
            assert reader.batch_exists(names, timeout_s=0.4, hint=stalled.node_id) == 6
            bufs = [bytearray(SIZE) for _ in names]
            reader.node.located.clear()
            assert reader.batch_get_into(names, bufs, timeout_s=0.4, hint=stalled.node_id) == [True] * 6
            assert all(bytes(buf) == page_bytes(n, SIZE) for buf, n in zip(bufs, names, strict=True))
        finally:
            gate.set()
            stalled.node._serve_shard = real
    finally:
        for s in (reader, stalled, a):
            s.close()


def test_nodes_that_left_are_forgotten_by_the_planner():
    """A cluster that runs for weeks sees nodes come and go (a restarted pod has a new address, so a new
    id): the planner's estimate of each node that left stayed for the reader's life, and ``peers`` in its
    status listed every node it ever read from."""
    head, reader = cluster(2)
    try:
        for i in range(3):
            other = PeerStore(discovery=head.node_id, port=0, data_port=0, pool_size_mb=16, **FAST)
            try:
                wait_for(lambda: len(reader.status()["members"]) == 3, 10, "the new node to join")
                names = keys(f"gone{i}-", 4)
                assert other.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 4
                bufs = [bytearray(SIZE) for _ in names]
                assert reader.batch_get_into(names, bufs) == [True] * 4
                assert other.node_id in reader.status()["peers"]
            finally:
                other.close()
            wait_for(lambda: len(reader.status()["members"]) == 2, 10, "the node to leave")
        peers = reader.status()["peers"]
        assert set(peers) <= {head.node_id}, peers
    finally:
        reader.close()
        head.close()


def test_single_page_reads_take_a_hint_and_recompute_s_as_batches_do():
    """README: "every read takes `hint=` and `recompute_s=`": ``get`` and ``exists`` too, not only the
    batch calls (they raised TypeError)."""
    a, reader = cluster(2)
    try:
        [name] = keys("s", 1)
        assert a.set(name, page_bytes(name, SIZE))
        for s in (a, reader):
            s.node.shard.keep_nodes(())  # the directory lost the record: only the hint finds the page
        assert not reader.exists(name)
        assert reader.exists(name, hint=a.node_id)
        reader.node.located.clear()
        assert reader.get(name, hint=a.node_id, timeout_s=2) == page_bytes(name, SIZE)
        # The estimate learnt by that read: recomputing one page is faster than pulling it, so it is a miss.
        assert not reader.exists(name, hint=a.node_id, recompute_s=1e-9)
        assert reader.get(name, hint=a.node_id, recompute_s=1e-9) is None
    finally:
        reader.close()
        a.close()
