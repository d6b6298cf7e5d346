"""A peer cluster of real node processes on loopback, and the faults a fleet meets.

Every byte read is checked against what was written under its key (``page_bytes``): a read is a miss
or exactly those bytes. Nodes heartbeat every 0.3 s and expire after 1.5 s here, so faults show within
seconds.
"""

from __future__ import annotations

import threading
import time

import pytest
from support.peer_cluster import NodeProcess, check_pages, keys, page_bytes, wait_for

from kvdepot.bench.backends import _port_is_free
from kvdepot.bench.serverproc import free_port
from kvdepot.peer import PeerStore
from kvdepot.peer.dataplane import PageOutcome, PageRead
from kvdepot.protocol import messages as m

SIZE = 64 << 10
SECRET = "cluster-test-secret"
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0, "metrics_port": 0}


def store(discovery: str = "", secret: str = SECRET, **options) -> PeerStore:
    return PeerStore(discovery=discovery, secret=secret, port=0, data_port=0, pool_size_mb=options.pop("pool_size_mb", 32), **{**FAST, **options})


@pytest.fixture
def nodes():
    started: list[NodeProcess] = []

    def start(**options) -> NodeProcess:
        options.setdefault("secret", SECRET)
        node = NodeProcess(**options).start()
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


def members_of(s: PeerStore) -> int:
    return len(s.status()["members"])


def agree(count: int, local: list[PeerStore], processes: list[NodeProcess]) -> None:
    """Wait until every node sees ``count`` members (membership spreads within a heartbeat or two)."""
    def all_see() -> bool:
        return all(members_of(s) == count for s in local) and all(len(p.command("status")["members"]) == count for p in processes)

    wait_for(all_see, 15, f"every node to see {count} members")


def test_three_nodes_share_pages_every_way(nodes):
    head = nodes()
    a = nodes(discovery=head.node_id)
    with store(head.node_id) as local:
        agree(3, [local], [head, a])
        for node, prefix in ((head, "h"), (a, "a")):
            assert node.command(f"set {prefix} 20 {SIZE}") == {"stored": 20}
        assert local.batch_set(keys("l", 20), [page_bytes(k, SIZE) for k in keys("l", 20)]) == [True] * 20
        for node in (head, a):
            for prefix in "hal":
                assert node.command(f"check {prefix} 20 {SIZE}") == {"hit": 20, "miss": 0, "wrong": 0}, (node.node_id, prefix)
        assert check_pages(local, "h", 20, SIZE) == {"hit": 20, "miss": 0, "wrong": 0}
        assert local.batch_exists(keys("a", 20) + ["nope"] + keys("h", 3)) == 20  # leading hits, as HiCache counts
        buf = bytearray(SIZE)
        assert local.get_into("a7", buf) and bytes(buf) == page_bytes("a7", SIZE)
        assert not local.get_into("a7", bytearray(SIZE - 1))  # a buffer of another size is a miss, not a partial read


def test_killed_node_survivors_still_hit_its_pages_miss_and_writes_land_after(nodes):
    head = nodes()
    a, b = nodes(discovery=head.node_id), nodes(discovery=head.node_id)
    with store(head.node_id) as reader:
        agree(4, [reader], [head, a, b])
        assert a.command(f"set a 40 {SIZE}") == {"stored": 40}
        assert b.command(f"set b 40 {SIZE}") == {"stored": 40}
        assert check_pages(reader, "a", 40, SIZE)["hit"] == 40
        b.kill()
        # At once, before the cluster has noticed: records b owned for a's pages have replicas.
        assert check_pages(reader, "a", 40, SIZE) == {"hit": 40, "miss": 0, "wrong": 0}
        # b's own pages are clean misses (its data plane is gone), and within seconds b is out.
        got = check_pages(reader, "b", 40, SIZE)
        assert got["wrong"] == 0 and got["hit"] == 0
        wait_for(lambda: members_of(reader) == 3, 10, "the dead node to leave")
        assert reader.batch_exists(keys("b", 40)) == 0
        # The ring re-sharded: later writes land and everyone reads them.
        assert a.command(f"set a2 40 {SIZE}") == {"stored": 40}
        assert check_pages(reader, "a2", 40, SIZE) == {"hit": 40, "miss": 0, "wrong": 0}
        assert head.command(f"check a2 40 {SIZE}") == {"hit": 40, "miss": 0, "wrong": 0}


def test_head_master_killed_established_nodes_serve_and_a_restarted_head_rejoins(nodes):
    head = nodes()
    port = int(head.node_id.rsplit(":", 1)[1])
    a = nodes(discovery=head.node_id)
    b = nodes(discovery=head.node_id)
    agree(3, [], [head, a, b])
    head.kill()
    assert a.command(f"set x 30 {SIZE}") == {"stored": 30}

    def b_reads_x() -> bool:
        got = b.command(f"check x 30 {SIZE}")
        assert got["wrong"] == 0, got
        return got["hit"] == 30

    # At once, as a rule: a resolve that asks the dead head first costs one control timeout (0.5 s) of
    # the read's 2 s, then the next replica answers. A loaded machine may stretch that past the read's
    # deadline once; the next read no longer asks the head (suspected).
    wait_for(b_reads_x, 5, "b to read what a wrote after the head died")
    wait_for(lambda: a.command("status")["members"] == sorted(a.command("status")["members"]) and
             len(a.command("status")["members"]) == 2, 10, "the head to be expired")  # fmt: skip
    assert b.command(f"set y 30 {SIZE}") == {"stored": 30}
    assert a.command(f"check y 30 {SIZE}") == {"hit": 30, "miss": 0, "wrong": 0}
    # The head comes back on its address: the others find it again and it reads what they wrote.
    again = nodes(port=port)
    assert again.node_id == head.node_id
    wait_for(lambda: len(again.command("status")["members"]) == 3, 10, "the restarted head to see everyone")
    wait_for(lambda: again.command(f"check x 30 {SIZE}")["hit"] == 30, 10, "the restarted head to read x")
    assert again.command(f"check y 30 {SIZE}") == {"hit": 30, "miss": 0, "wrong": 0}


def watch_keep_nodes(stores, ids: set[str]) -> list[set[str]]:
    """Each call of a store's ``shard.keep_nodes`` that leaves out one of ``ids`` (it drops a live node's
    records), recorded in the list returned; the call itself goes on."""
    narrowed: list[set[str]] = []
    for s in stores:
        real = s.node.shard.keep_nodes

        def keep_nodes(live, real=real):
            if not ids <= set(live):
                narrowed.append(set(live))
            return real(live)

        s.node.shard.keep_nodes = keep_nodes
    return narrowed


def test_a_restarted_head_never_narrows_a_non_masters_membership(nodes):
    """Back on its address, the head knows only who has heartbeated it since. A non-master took the
    first master's answer as the membership, so for a heartbeat or two it dropped the others from its
    ring and its directory shard: their records there, which the masters (whose own view never changed)
    never published again. It now takes what every master that answers knows, together."""
    two = {"max_masters": 2}
    head = nodes(extra=two)
    port = int(head.node_id.rsplit(":", 1)[1])
    with store(head.node_id, **two) as s1, store(head.node_id, **two) as s2, store(head.node_id, **two) as s3:
        stores = [s1, s2, s3]
        agree(4, stores, [head])
        ids = {s.node_id for s in stores}
        non_masters = [s for s in stores if s.node_id not in s.status()["masters"]]
        assert len(non_masters) == 2
        narrowed = watch_keep_nodes(non_masters, ids)
        for i, s in enumerate(stores):
            names = keys(f"r{i}-", 16)
            assert s.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 16
        head.kill()
        again = nodes(port=port, extra=two)
        assert again.node_id == head.node_id
        agree(4, stores, [again])
        time.sleep(1.0)  # a few more heartbeats
        assert not narrowed, f"a non-master dropped live members from its shard: {narrowed[:3]}"
        for i in range(len(stores)):
            for reader in stores:
                assert reader.batch_exists(keys(f"r{i}-", 16)) == 16


def test_a_restarted_head_that_is_the_only_master_narrows_no_one(nodes):
    """One master: back on its address, the head is everyone's only source and knows only who has
    heartbeated it since, so the node that heartbeated it first was told the other had left. It dropped
    that node from its ring (its pages read as misses) and its records from its directory shard. A
    master that has just started now says it is settling, for one member TTL, and no node drops a
    member on a settling table's word: nothing leaves and every page reads throughout."""
    one = {"max_masters": 1}
    head = nodes(extra=one)
    port = int(head.node_id.rsplit(":", 1)[1])
    # Reads remember where pages are for the whole test, so they hit while a reader's membership holds
    # the writer: the directory is checked once at the end.
    with store(head.node_id, location_cache_s=60.0, **one) as a, store(head.node_id, location_cache_s=60.0, **one) as b:
        agree(3, [a, b], [head])
        ids = {head.node_id, a.node_id, b.node_id}
        narrowed = watch_keep_nodes((a, b), ids)
        for s, prefix in ((a, "ha"), (b, "hb")):
            names = keys(prefix, 16)
            assert s.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 16
        pairs = ((a, "hb"), (b, "ha"))
        for reader, prefix in pairs:
            wait_for(lambda r=reader, p=prefix: check_pages(r, p, 16, SIZE)["hit"] == 16, 10, "the other node's pages")
        stop = threading.Event()
        seen = {"hit": 0, "miss": 0, "wrong": 0}
        lost: list[set[str]] = []

        def read_and_watch() -> None:
            while not stop.is_set():
                for reader, prefix in pairs:
                    for k, v in check_pages(reader, prefix, 16, SIZE).items():
                        seen[k] += v
                    known = {n.id for n in reader.node.members()}
                    if not ids <= known:
                        lost.append(known)
                time.sleep(0.005)

        watcher = threading.Thread(target=read_and_watch)
        watcher.start()
        try:
            head.kill()
            again = nodes(port=port, extra=one)
            assert again.node_id == head.node_id
            agree(3, [a, b], [again])
            time.sleep(FAST["member_ttl_s"] + 1.0)  # the head settles, and a few heartbeats after
        finally:
            stop.set()
            watcher.join(30)
        assert not lost, f"a node's membership lost a live node: {lost[:3]}"
        assert not narrowed, f"a node dropped live members' records from its shard: {narrowed[:3]}"
        assert seen["miss"] == 0 and seen["wrong"] == 0 and seen["hit"] > 0, seen
        for reader, prefix in pairs:
            reader.node.located.clear()  # through the directory now
            assert check_pages(reader, prefix, 16, SIZE) == {"hit": 16, "miss": 0, "wrong": 0}


def test_a_node_without_the_secret_can_neither_join_nor_read(nodes):
    head = nodes()
    assert head.command(f"set s 10 {SIZE}") == {"stored": 10}
    with store(head.node_id, secret="not-the-secret", join_timeout_s=1.0) as intruder, store(head.node_id, secret="", join_timeout_s=1.0) as open_node:
        for s in (intruder, open_node):
            assert not s.node.joined
            assert s.status()["members"] == [s.node_id]
            assert s.batch_exists(keys("s", 10)) == 0 and s.get("s0") is None
        with store(head.node_id) as member:  # a legitimate member, to learn a real location
            wait_for(lambda: member.exists("s0"), 10, "the member to see s0")
            loc = member.node.resolve([b"s0"], time.monotonic() + 2)[0]
            assert loc is not None
            peer = next(n for n in member.node.members() if n.id == loc.node)
            # Straight at the owner's data plane with the wrong secret: refused, not a byte served.
            dest = bytearray(loc.length)
            page = PageRead(loc.key, loc.generation, loc.offset, loc.length, loc.checksum, memoryview(dest))
            assert intruder.node._transport.read(peer.host, peer.data_port, [page], time.monotonic() + 2) == [PageOutcome.MISS]
            assert dest == bytearray(loc.length)
            assert member.node._transport.read(peer.host, peer.data_port, [page], time.monotonic() + 2) == [PageOutcome.HIT]
            assert bytes(dest) == page_bytes("s0", SIZE)


def test_a_stalled_peer_is_a_timely_miss_and_serves_again_after(nodes):
    # The stall is one read's 1 s deadline and should end inside the member TTL: this test is about a
    # stall the others wait out (a loaded machine could stretch 1 s past 1.5 s; 5 s it cannot). A stall
    # past the TTL is the next test's.
    ttl = {"member_ttl_s": 5.0}
    head = nodes(extra=ttl)
    a = nodes(discovery=head.node_id, extra=ttl)
    assert a.command(f"set p 20 {SIZE}") == {"stored": 20}
    with store(head.node_id, timeout_s=1.0, **ttl) as reader:
        agree(3, [reader], [head, a])
        wait_for(lambda: check_pages(reader, "p", 20, SIZE)["hit"] == 20, 10, "the pages")
        a.pause()  # SIGSTOP: its sockets stay open, nothing answers
        try:
            t0 = time.monotonic()
            got = check_pages(reader, "p", 20, SIZE)
            took = time.monotonic() - t0
            assert got["hit"] == 0 and got["wrong"] == 0
            assert took < 10, f"a stalled peer held a read for {took:.1f} s"  # bounded by the deadline, not a hang
        finally:
            a.resume()
        wait_for(lambda: check_pages(reader, "p", 20, SIZE)["hit"] == 20, 15, "service back after the stall")


def test_a_head_that_loses_its_other_master_keeps_its_run_and_its_records():
    """The head serves every node all along, but its own heartbeats go unanswered until its table drops
    the dead second master and takes another: the first answer then came more than a TTL after the
    last, and the head took itself for a node that had been away (a new run, every other node's record
    dropped from its shard, a whole-cluster re-publish) though nobody had expired it."""
    two = {"max_masters": 2}
    head = store(**two)
    a, b = store(head.node.info.id, **two), store(head.node.info.id, **two)
    try:
        wait_for(lambda: all(len(s.node.members()) == 3 for s in (head, a, b)), 15, "3 members")
        other = a if a.node.info.id in head.node.masters() else b
        survivor = b if other is a else a
        names = keys("k", 200)
        assert all(survivor.batch_set(names, [page_bytes(n, 4096) for n in names]))
        wait_for(lambda: len(head.node.shard) > 0, 5, "the head holding records of the survivor's pages")
        run = head.node.info.incarnation
        other.close()
        wait_for(lambda: survivor.node.info.id in head.node.masters(), 15, "a new second master")
        time.sleep(1.0)  # a few rounds with it
        assert head.node.info.incarnation == run, "the head started a new run though no one had expired it"
    finally:
        for s in (head, a, b):
            s.close()


def test_a_node_started_before_its_head_joins_once_the_head_is_up():
    """start() waits up to join_timeout_s for a master, but asked only once: the heartbeat thread starts
    after that wait, so a node launched a moment before its head (a whole cluster started at once)
    waited out the timeout and came up unjoined."""
    port = free_port()
    head: list[PeerStore] = []
    late = threading.Timer(1.0, lambda: head.append(PeerStore(port=port, data_port=0, secret=SECRET, **FAST)))
    late.start()
    try:
        with store(f"127.0.0.1:{port}", join_timeout_s=15.0) as node:
            assert node.node.joined, "a head up 1 s after the node was never asked again within join_timeout_s"
    finally:
        late.join()
        for h in head:
            h.close()


def test_a_node_that_joins_later_than_a_ttl_after_its_start_keeps_its_run():
    """A node started longer than a member TTL before its head answers was never heard by any master, so
    none could have expired it; yet its first answer came more than a TTL after its start, and it took
    itself for a node that had been away: a new run (a spurious warning, a whole-cluster re-publish)."""
    port = free_port()
    head: list[PeerStore] = []
    late = threading.Timer(2.5, lambda: head.append(PeerStore(port=port, data_port=0, secret=SECRET, **FAST)))
    late.start()
    started = time.time_ns()  # a run's incarnation is its start's wall clock; a new run's, a later one
    try:
        with store(f"127.0.0.1:{port}", join_timeout_s=15.0) as node:
            assert node.node.joined
            time.sleep(0.6)  # a round or two after the join
            assert node.node.info.incarnation - started < 1e9, "a node's first join counted as a return from away"
    finally:
        late.join()
        for h in head:
            h.close()


def test_a_batch_larger_than_the_pool_reports_only_the_pages_it_kept():
    """A later page of the same call evicts an earlier one from a full pool: the call used to report
    that one stored anyway, and SGLang took it for backed up though no node had it."""
    with store(pool_size_mb=1) as s:
        names = keys("big", 8)  # 2 MiB through a 1 MiB pool
        stored = s.batch_set(names, [page_bytes(n, 256 << 10) for n in names])
        assert 0 < sum(stored) < len(names) and not stored[0]
        assert stored == s.exists_many(names)


@pytest.mark.parametrize("bad", ["key", "value"])
def test_a_batch_refused_midway_leaves_the_directory_as_the_pool_is(bad):
    """A batch with a bad key or an empty page used to raise after the pages before it went into the
    pool and evicted others: the evicted pages' records stayed in the directory (counted by every
    existence check, never readable) and the pages taken were never announced."""
    with store(pool_size_mb=1) as s:
        names = keys("p", 16)  # 16 x 64 KiB: the pool is full
        assert all(s.batch_set(names, [page_bytes(n, 64 << 10) for n in names]))
        assert s.batch_exists(names) == 16
        with pytest.raises((ValueError, TypeError)):
            if bad == "key":
                s.batch_set(["new", ""], [page_bytes("new", 64 << 10), page_bytes("x", 64 << 10)])
            else:
                s.batch_set(["new", "empty"], [page_bytes("new", 64 << 10), b""])
        seen = {n: (s.exists(n), s.get(n) is not None) for n in names + ["new"]}
        assert not {n: v for n, v in seen.items() if v[0] != v[1]}, f"(exists, readable) disagree: {seen}"


def test_an_unpublish_an_owner_missed_reaches_it_once_it_answers():
    """A clear while the writer suspects the other owner of the records: its unpublish to that owner
    is skipped. The stale records used to stay for good (nothing sent them again), and every existence
    check counted pages no node held."""
    with store() as a, store(a.node_id) as b:
        wait_for(lambda: members_of(a) == 2 and members_of(b) == 2, 10, "two members")
        names = keys("ghost", 40)
        assert b.batch_set(names, [page_bytes(n, 4096) for n in names]) == [True] * 40
        assert sum(a.exists_many(names)) == 40 and len(a.node.shard) == 40
        b.node._suspects[a.node_id] = time.monotonic() + 1.0  # as after a failed call: skipped for a while
        assert b.clear() == 40
        wait_for(lambda: len(a.node.shard) == 0, 15, "the skipped unpublishes to reach a once it is no longer suspected")
        assert sum(a.exists_many(names)) == 0
        assert b.status()["publish"]["unpublish_owed"] == 0 and b.status()["publish"]["unpublish_dropped"] == 0


def test_a_republish_and_a_clear_larger_than_one_request_reach_an_owner_in_slices(monkeypatch):
    """A node holding more pages than one request's body takes (8 MiB: ~40k records of 100-byte keys)
    sent its whole re-publish to a newcomer owner as one request per owner: refused as too large, owed,
    sent again on every heartbeat and refused again, for good; the newcomer's shard never held one of
    its records (nor could a clear's unpublish of them go). The limit is lowered here so that 1,200
    pages are past it."""
    from kvdepot.protocol import codec

    monkeypatch.setattr(codec, "MAX_BODY_BYTES", 64 << 10)
    names = [(b"page-%05d|" % i).ljust(100, b"h") for i in range(1200)]
    with store(pool_size_mb=8) as a:
        assert a.batch_set(names, [b"v"] * len(names)) == [True] * len(names)
        with store(a.node_id, pool_size_mb=4) as b:  # the newcomer: with two records per key, it owns them all
            wait_for(lambda: len(b.node.shard) == len(names), 10, f"the newcomer's shard to hold all {len(names)} records")
            assert a.status()["publish"]["owed"] == 0
            assert a.clear() == len(names)
            wait_for(lambda: len(b.node.shard) == 0, 10, "the clear's unpublishes to reach the newcomer")
            assert a.status()["publish"]["unpublish_owed"] == 0


def test_a_node_restarted_with_its_clock_stepped_back_takes_a_later_run_and_its_pages_read(monkeypatch):
    """A node's run is the wall clock at its start. Killed and restarted on its address within the
    member TTL with the clock stepped back (NTP, a VM restored), the new run was older than the dead
    one every shard knew of: its records were refused for good and its pages never read anywhere.
    The cluster's answer now names the later run, and the node takes a run after it."""
    import socket

    from kvdepot.peer import node as node_module

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with store() as head, store(head.node_id) as reader:
        future = time.time_ns() + 3600 * 10**9
        monkeypatch.setattr(node_module, "_new_incarnation", lambda: future)
        first = PeerStore(discovery=head.node_id, secret=SECRET, port=port, data_port=0, pool_size_mb=32, **FAST)
        monkeypatch.undo()  # the clock steps back an hour
        try:
            wait_for(lambda: members_of(reader) == 3, 10, "three members")
            names = keys("early", 8)
            assert first.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 8
            wait_for(lambda: check_pages(reader, "early", 8, SIZE)["hit"] == 8, 10, "the first run's pages")
        finally:
            first.close()  # no goodbye: as a kill, the others still hold this run until the TTL
        with PeerStore(discovery=head.node_id, secret=SECRET, port=port, data_port=0, pool_size_mb=32, **FAST) as again:
            assert again.node_id == first.node_id
            names = keys("late", 16)
            assert again.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 16
            reader.node.located.clear()
            wait_for(lambda: check_pages(reader, "late", 16, SIZE)["hit"] == 16, 10,
                     f"the restarted node's pages to read (its run {again.node.info.incarnation}, the dead one's {future})")
            assert again.node.info.incarnation > future
            assert check_pages(reader, "early", 8, SIZE)["wrong"] == 0


def test_a_page_evicted_while_its_record_was_on_the_way_leaves_no_record_behind():
    """One writer's publish was slow; another writer's put evicted that page meanwhile, and the
    eviction's unpublish reached the owners first. The publish then landed: a record of freed space,
    counted by every existence check (a "hit" that no read could serve) until the key was written again."""
    page = 256 << 10
    with store(pool_size_mb=1) as writer, store(writer.node_id) as other:
        wait_for(lambda: members_of(writer) == 2, 10, "two members")
        slow = b"slow-page".ljust(16, b"\0")
        gate, inside = threading.Event(), threading.Event()
        real = writer.node._call_shards

        def held(requests, deadline):
            bodies = [body for each in requests.values() for body in each]
            if any(isinstance(body, m.PeerPublishRequest) and any(r.key == slow and r.resident for r in body.records) for body in bodies):
                inside.set()
                assert gate.wait(10)
            return real(requests, deadline)

        writer.node._call_shards = held
        put = threading.Thread(target=writer.set, args=(slow, page_bytes("slow", page)))
        put.start()
        try:
            assert inside.wait(10)  # its record is on the way
            names = keys("crowd", 4)
            assert writer.batch_set(names, [page_bytes(n, page) for n in names]) == [True] * 4  # evicts it
            assert writer.node.pool.peek(slow) is None
        finally:
            gate.set()
            put.join(10)
        assert other.exists_many([slow]) == [False], "a record of an evicted page outlived its unpublish"
        assert writer.exists_many([slow]) == [False]


def _stall_resolves(s: PeerStore, gate: threading.Event) -> None:
    """``s`` answers directory lookups only once ``gate`` is set (its other calls go on)."""
    real = s.node._serve_shard

    def stalled(body):
        if isinstance(body, m.PeerResolveRequest):
            assert gate.wait(10)
        return real(body)

    s.node._serve_shard = stalled


def test_a_lookup_cut_short_by_its_own_deadline_does_not_suspect_the_owner():
    """SGLang gives a lookup a share of its budget; a directory call that ran out of *that* says nothing
    of the owner. It used to mark the owner suspect for a while, and every page the owner held read as
    a miss meanwhile. A call that times out after the full ``control_timeout_s`` still suspects it."""
    # One record per key: b holds no replica of a's records, so its lookups go to a.
    with store(directory_replicas=1) as a, store(a.node_id, directory_replicas=1) as b:
        wait_for(lambda: members_of(a) == 2 and members_of(b) == 2, 10, "two members")
        names = [n for n in keys("cut", 40) if b.node._ring.owners(n.encode(), 1) == [a.node_id]]
        assert names, "the ring put no key's first record on a: the test proves nothing"
        assert a.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * len(names)
        assert b.batch_exists(names) == len(names)

        def suspected() -> bool:
            return b.node._suspects.get(a.node_id, 0.0) > time.monotonic()

        gate = threading.Event()
        _stall_resolves(a, gate)
        try:
            b.batch_exists(names, timeout_s=0.1)  # a's answer cannot come within the caller's 0.1 s
            assert not suspected(), "a healthy owner was suspected for the caller's own short deadline"
        finally:
            gate.set()
        assert b.batch_exists(names) == len(names)
        gate.clear()
        try:
            b.batch_exists(names, timeout_s=5.0)  # the call to a runs its full control_timeout_s
            assert suspected()
        finally:
            gate.set()


def test_records_of_pages_deleted_while_their_owner_was_stalled_do_not_outlive_its_return(nodes):
    """The others expire a shard owner stopped past the TTL and send their unpublishes to the owners of
    the new ring only (one owed to it is dropped once it has left). Back, its own view unchanged, it
    kept the records of pages deleted meanwhile for good: every existence check counted pages no node
    held. Now a node back after a TTL without a master's answer starts a new run with an empty shard of
    others' records, and every node publishes its pages to it again."""
    one_master = {"max_masters": 1}
    head = nodes(extra=one_master)
    d = nodes(discovery=head.node_id, extra=one_master)
    with store(head.node_id, **one_master) as writer, store(head.node_id, **one_master) as reader:
        wait_for(lambda: members_of(writer) == members_of(reader) == len(d.command("status")["members"]) == 4, 15, "4 members")
        names = keys("gone", 60)
        assert writer.batch_set(names, [page_bytes(n, 4096) for n in names]) == [True] * 60
        assert d.command("status")["directory_records"] > 0  # d owns some of these keys' records
        kept = keys("kept", 20)
        assert reader.batch_set(kept, [page_bytes(n, 4096) for n in kept]) == [True] * 20
        d.pause()
        try:
            wait_for(lambda: members_of(writer) == members_of(reader) == 3, 15, "d expired by the others")
            assert sum(writer.delete(n) for n in names) == 60  # unpublished at the owners of now: d is not one
        finally:
            d.resume()
        wait_for(lambda: members_of(writer) == members_of(reader) == 4 and d.command("status")["joined"], 15, "d back")
        wait_for(lambda: reader.exists_many(names) == [False] * 60, 10, "the deleted pages gone from every shard")
        assert check_pages(reader, "kept", 20, 4096) == {"hit": 20, "miss": 0, "wrong": 0}  # d's shard included


def test_a_node_stalled_past_the_ttl_publishes_its_pages_again_when_it_wakes(nodes):
    """The others expire a node stopped past the member TTL and drop its records; the node itself saw
    nothing (no heartbeat round of its own failed, its view never changed). On waking it finds that
    no master heard it for longer than the TTL, and publishes everything again. One master (the head),
    so the stalled node's view is the head's alone: it cannot change through a's own member table."""
    one_master = {"max_masters": 1}
    head = nodes(extra=one_master)
    a = nodes(discovery=head.node_id, extra=one_master)
    assert a.command(f"set p 20 {SIZE}") == {"stored": 20}
    with store(head.node_id, **one_master) as reader:
        agree(3, [reader], [head, a])
        wait_for(lambda: check_pages(reader, "p", 20, SIZE)["hit"] == 20, 10, "the pages")
        a.pause()
        try:
            wait_for(lambda: len(head.command("status")["members"]) == 2 and members_of(reader) == 2, 15, "a expired by the others")
        finally:
            a.resume()
        agree(3, [reader], [head, a])
        reader.node.located.clear()  # where it read them before the stall: ask the directory, as a new reader would
        wait_for(lambda: check_pages(reader, "p", 20, SIZE)["hit"] == 20, 15, "a's pages readable again")


def test_garbage_and_a_connection_closed_mid_page_are_misses_then_service_comes_back():
    with store() as owner, store(owner.node_id) as reader:
        wait_for(lambda: members_of(reader) == 2, 10, "two members")
        names = keys("g", 4)
        assert owner.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 4
        assert check_pages(reader, "g", 4, SIZE)["hit"] == 4
        # Garbage: the owner's pool bytes change under a published record.
        entry = owner.node.pool.acquire(b"g1")
        view = owner.node.pool.view(entry)
        view[100] ^= 0xFF
        garbage_before = reader.node._transport.garbage
        assert check_pages(reader, "g", 4, SIZE)["wrong"] == 0
        assert reader.get("g1") is None
        assert reader.node._transport.garbage > garbage_before
        view[100] ^= 0xFF
        owner.node.pool.release(entry)
        assert check_pages(reader, "g", 4, SIZE) == {"hit": 4, "miss": 0, "wrong": 0}
        # A connection closed halfway through a page.
        server = owner.node._data_server
        original = server._send_page

        def half_then_close(conn, key, generation, offset, length):
            conn.sendall(b"\0" * 16 + b"\x01" * (length // 2))
            raise ConnectionError("closed mid-page")

        server._send_page = half_then_close
        dropped = reader.node._transport.dropped
        try:
            assert reader.get("g2") is None
            assert reader.node._transport.dropped > dropped  # that connection is never reused
        finally:
            server._send_page = original
        assert check_pages(reader, "g", 4, SIZE) == {"hit": 4, "miss": 0, "wrong": 0}


def test_a_flipped_byte_in_any_received_piece_of_a_large_page_is_a_miss():
    """Readers receive a page in pieces and hash each as it lands: a byte flipped in a later piece (or
    in the short last one) must fail the page as surely as one in the first."""
    from kvdepot.peer.dataplane import RECV_PIECE_BYTES

    size = 2 * RECV_PIECE_BYTES + 4096
    with store() as owner, store(owner.node_id) as reader:
        wait_for(lambda: members_of(reader) == 2, 10, "two members")
        names = keys("L", 1)
        assert owner.batch_set(names, [page_bytes(names[0], size)]) == [True]
        assert check_pages(reader, "L", 1, size)["hit"] == 1
        entry = owner.node.pool.acquire(names[0].encode())
        view = owner.node.pool.view(entry)
        try:
            for offset in (RECV_PIECE_BYTES + 7, size - 1):
                view[offset] ^= 0xFF
                garbage_before = reader.node._transport.garbage
                assert check_pages(reader, "L", 1, size) == {"hit": 0, "miss": 1, "wrong": 0}
                assert reader.node._transport.garbage > garbage_before
                view[offset] ^= 0xFF
        finally:
            owner.node.pool.release(entry)
        assert check_pages(reader, "L", 1, size) == {"hit": 1, "miss": 0, "wrong": 0}


def test_evictions_under_concurrent_reads_never_hand_out_wrong_bytes():
    """The owner's pool holds 16 pages; a writer keeps rewriting 48 keys (new versions evict old pages)
    while four reader threads on another node read them: every hit must be one of the versions written."""
    size = 256 << 10
    with store(pool_size_mb=4) as owner, store(owner.node_id) as reader:
        wait_for(lambda: members_of(reader) == 2, 10, "two members")
        names = keys("e", 48)
        stop = threading.Event()
        versions_written = [0]
        failures: list[str] = []
        counts = {"hit": 0, "miss": 0}
        lock = threading.Lock()

        def write():
            v = 0
            while not stop.is_set():
                v += 1
                for n in names:
                    owner.set(n, page_bytes(n, size, v))
                versions_written[0] = v

        def read(seed: int):
            i = seed
            while not stop.is_set():
                batch = [names[(i + j) % len(names)] for j in range(4)]
                i += 5
                for name, value in zip(batch, reader.batch_get(batch), strict=True):
                    if value is None:
                        with lock:
                            counts["miss"] += 1
                        continue
                    top = versions_written[0] + 1
                    if not any(value == page_bytes(name, size, v) for v in range(top, 0, -1)):
                        failures.append(f"{name}: bytes of no version written")
                    with lock:
                        counts["hit"] += 1

        threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(30)
        assert not failures, failures[:5]
        assert owner.node.pool.stats().evictions > 100, "the test must actually evict under the readers"
        assert counts["hit"] > 20, counts  # reads did land between evictions


def test_publishes_an_owner_missed_reach_it_once_it_answers(nodes):
    """Pages written while one owner of their records is stalled (SIGSTOP, shorter than the member TTL,
    so membership never changes and nothing re-publishes for that reason). The first publish to it
    times out (it may still land when the owner wakes: it sat in a socket), and the writer then skips
    the suspected owner for a while: the second batch's publish is never sent. The writer owes both and
    sends them again once the owner answers; without that, the owner's shard would lack the second
    batch's records for as long as the pages live."""
    slow_ttl = {"member_ttl_s": 30.0}  # the stall must not end anyone's membership
    head = nodes(extra=slow_ttl)
    b = nodes(discovery=head.node_id, extra=slow_ttl)
    with store(head.node_id, **slow_ttl) as writer:
        agree(3, [writer], [head, b])
        first, second = keys("owed-a", 40), keys("owed-b", 40)
        on_b = [n for n in first + second if b.node_id in writer.node._ring.owners(n.encode(), 2)]
        assert any(n in on_b for n in second), "the ring put none of the second batch on b: the test proves nothing"
        before = b.command("status")["directory_records"]
        b.pause()
        try:
            for batch in (first, second):
                assert writer.batch_set(batch, [page_bytes(n, SIZE) for n in batch]) == [True] * len(batch)
            # The heartbeat takes what is owed to send it again and owes what fails again (b is still
            # stopped): read between the two, the count is low for a moment. Wait for it, not for a read.
            wait_for(lambda: writer.status()["publish"]["owed"] >= len(on_b), 10, "the records b missed to be owed")
        finally:
            b.resume()
        wait_for(lambda: b.command("status")["directory_records"] - before == len(on_b), 15, "b's missed records sent again")
        wait_for(lambda: writer.status()["publish"]["owed"] == 0, 15, "nothing owed")
        assert writer.status()["publish"]["repaid"] >= len(on_b)
        assert len(b.command("status")["members"]) == 3


def test_nodes_given_the_heads_host_name_agree_with_it_on_the_masters():
    """The head's address given by a host name (a Kubernetes Service, ``localhost``), not as its node id:
    such a node ordered the members with a head that was none of them, so it took other masters than
    the head did (itself, maybe), and the cluster's nodes disagreed on whom to heartbeat."""
    fast = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "secret": "by-name", "metrics_port": 0}
    head = PeerStore(port=0, data_port=0, pool_size_mb=16, **fast)
    port = head.node_id.rsplit(":", 1)[1]
    nodes = [PeerStore(discovery=f"localhost:{port}", port=0, data_port=0, pool_size_mb=16, **fast) for _ in range(3)]
    everyone = [head, *nodes]
    try:
        wait_for(lambda: all(len(s.status()["members"]) == 4 for s in everyone), 10, "4 members")
        wait_for(lambda: all(s.status()["masters"] == head.status()["masters"] for s in everyone), 10, "one set of masters")
        assert head.status()["masters"][0] == head.node_id
        names = [f"n{i}" for i in range(8)]
        assert nodes[0].batch_set(names, [n.encode() * 100 for n in names]) == [True] * 8
        assert nodes[2].batch_get(names) == [n.encode() * 100 for n in names]
    finally:
        for s in reversed(everyone):
            s.close()


def test_a_head_given_its_own_address_by_host_name_is_the_head():
    """The head started with its own discovery address, given by a host name: it kept the name as its
    head and its answers repeated it, so no node ever took the head's id, and the masters were the
    lowest ids (the head not among them when its id sorts last)."""
    fast = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "secret": "by-name", "metrics_port": 0}
    # A port whose id sorts after the others' (ephemeral ports are below 61000): ordered by id alone,
    # the head would not be the first master.
    port = next(p for p in range(64999, 61000, -1) if _port_is_free(p))
    head = PeerStore(discovery=f"localhost:{port}", port=port, data_port=0, pool_size_mb=16, **fast)
    nodes = [PeerStore(discovery=f"localhost:{port}", port=0, data_port=0, pool_size_mb=16, **fast) for _ in range(3)]
    everyone = [head, *nodes]
    try:
        wait_for(lambda: all(len(s.status()["members"]) == 4 for s in everyone), 10, "4 members")
        wait_for(lambda: all(s.status()["masters"] == head.status()["masters"] for s in everyone), 10, "one set of masters")
        # README: "The masters are the head, then the other nodes by id".
        wait_for(lambda: all(s.status()["masters"][0] == head.node_id for s in everyone), 5, "the head first among the masters")
        assert all(s.node.head == head.node_id for s in everyone)
    finally:
        for s in reversed(everyone):
            s.close()


def test_the_only_master_restarted_with_its_clock_stepped_back_takes_a_later_run_and_its_pages_read(monkeypatch):
    """As above, for the head when it is the only master (``max_masters=1``): no master's table ever
    reaches it (it heartbeats no one), so nothing told it that the others still knew its later, dead
    run. Every other shard kept that run and refused each record of the new one for good: the head's
    pages whose directory records live on the other nodes read nowhere, for the whole run."""
    import socket

    from kvdepot.peer import node as node_module

    one = {"max_masters": 1}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    head_id = f"127.0.0.1:{port}"
    future = time.time_ns() + 3600 * 10**9
    monkeypatch.setattr(node_module, "_new_incarnation", lambda: future)
    first = PeerStore(discovery="", secret=SECRET, port=port, data_port=0, pool_size_mb=32, **{**FAST, **one})
    monkeypatch.undo()  # the clock steps back an hour
    with store(head_id, **one) as a, store(head_id, **one) as b:
        try:
            assert first.node_id == head_id
            wait_for(lambda: members_of(a) == 3 and members_of(b) == 3, 10, "three members")
            names = keys("early", 32)
            assert first.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 32
            wait_for(lambda: check_pages(a, "early", 32, SIZE)["hit"] == 32, 10, "the first run's pages")
        finally:
            first.close()  # no goodbye: as a kill, the others still hold this run until the TTL
        with PeerStore(discovery="", secret=SECRET, port=port, data_port=0, pool_size_mb=32, **{**FAST, **one}) as again:
            assert again.node_id == head_id
            wait_for(lambda: members_of(again) == 3, 10, "the restarted head to know three members")
            names = keys("late", 32)
            assert again.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 32
            time.sleep(FAST["member_ttl_s"] + 1.0)  # the head settles, and a few heartbeats after
            for reader in (a, b):
                reader.node.located.clear()
                wait_for(lambda r=reader: check_pages(r, "late", 32, SIZE)["hit"] == 32, 10,
                         f"the restarted head's pages to read on {reader.node_id} (its run {again.node.info.incarnation}, "
                         f"the dead one's {future}): {check_pages(reader, 'late', 32, SIZE)}")
                assert check_pages(reader, "early", 32, SIZE)["wrong"] == 0
            assert again.node.info.incarnation > future
