"""The peer tier's parts on their own: ring, pool, directory shard, member table, handshake."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from kvdepot.peer.auth import HandshakeFailed, client_handshake, serve_handshake
from kvdepot.peer.directory import DirectoryShard
from kvdepot.peer.discovery import MemberTable, masters_of
from kvdepot.peer.owed import OwedRecords, OwedUnpublishes
from kvdepot.peer.pool import PublishedPool
from kvdepot.peer.ring import HashRing
from kvdepot.protocol.messages import PeerLocation, PeerNodeInfo


def node(i: int, incarnation: int = 1) -> PeerNodeInfo:
    return PeerNodeInfo(id=f"10.0.0.{i}:31995", host=f"10.0.0.{i}", control_port=31995, data_port=31996, incarnation=incarnation)


# --- ring ---------------------------------------------------------------------------------------------


def test_ring_owners_are_distinct_stable_and_agree_across_builds():
    nodes = [f"n{i}" for i in range(5)]
    a, b = HashRing(nodes), HashRing(reversed(nodes))
    for i in range(200):
        key = f"key{i}".encode()
        owners = a.owners(key, 3)
        assert owners == b.owners(key, 3)  # every node computes the same owners
        assert len(set(owners)) == 3
    assert HashRing(["only"]).owners(b"k", 2) == ["only"]
    assert HashRing().owners(b"k") == []


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ring_owners_many_are_each_keys_owners(n):
    """The batch form a lookup uses (and ``owners`` with it) gives every key the ring's definition of its
    owners: the first ``n`` distinct nodes clockwise from xxh3_64(key) among the points xxh3_64(b"node#i"),
    computed here from scratch (fewer, more, or exactly the precomputed replicas; keys whose position is
    remembered and new ones); its lists cannot be mutated."""
    import bisect

    import xxhash

    nodes = [f"n{i}" for i in range(4)]
    points = sorted((xxhash.xxh3_64_intdigest(f"{node}#{i}".encode()), node) for node in nodes for i in range(160))
    at = [p for p, _ in points]

    def defined(key: bytes) -> list[str]:
        out: list[str] = []
        start = bisect.bisect(at, xxhash.xxh3_64_intdigest(key))
        for step in range(len(points)):
            node = points[(start + step) % len(points)][1]
            if node not in out:
                out.append(node)
            if len(out) == min(n, len(nodes)):
                break
        return out

    ring = HashRing(nodes, replicas=2)
    keys = [f"key{i}".encode() for i in range(300)]
    assert ring.owners(keys[0], n) == defined(keys[0])  # one key's position remembered already
    many = ring.owners_many(keys, n)
    assert [list(o) for o in many] == [defined(k) for k in keys]
    assert all(isinstance(o, tuple) for o in many)
    assert HashRing().owners_many([b"k"], n) == [()] and HashRing().owners(b"k", n) == []


def test_ring_moves_only_the_keys_next_to_a_joining_node():
    before = HashRing([f"n{i}" for i in range(4)])
    after = HashRing([f"n{i}" for i in range(5)])
    keys = [os.urandom(16) for _ in range(4000)]
    moved = sum(before.owners(k)[0] != after.owners(k)[0] for k in keys)
    assert all(after.owners(k)[0] == "n4" for k in keys if before.owners(k)[0] != after.owners(k)[0])
    assert 0.1 < moved / len(keys) < 0.3  # about 1/5 of the keys, all of them to the new node


def test_ring_shares_are_even_with_160_vnodes():
    shares = HashRing([f"10.0.0.{i}:31995" for i in range(8)]).shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    assert max(shares.values()) < 1.5 / 8 and min(shares.values()) > 0.5 / 8


# --- pool ---------------------------------------------------------------------------------------------


def test_pool_generation_guards_every_read():
    pool = PublishedPool(1 << 20)
    first, _ = pool.put(b"k", b"a" * 5000)
    assert first is not None
    second, _ = pool.put(b"k", b"b" * 5000)
    assert second is not None and second.generation > first.generation
    assert pool.acquire(b"k", first.generation) is None  # the old page is gone for good
    entry = pool.acquire(b"k", second.generation)
    assert entry is not None and bytes(pool.view(entry)) == b"b" * 5000
    pool.release(entry)


def test_pool_pages_start_half_a_page_in_and_the_pool_holds_its_whole_capacity():
    """As L1 slots do (storage.allocator.SLOT_PAGE_OFFSET): a page-aligned page copied into a numpy array
    runs ~3 x slower on AMD Zen."""
    pool = PublishedPool(4 * 4096)
    entries = [pool.put(f"k{i}".encode(), bytes([i]) * 4096)[0] for i in range(4)]
    assert all(e is not None for e in entries), "the pool holds exactly its capacity"
    assert {e.offset % 4096 for e in entries} == {2048}
    for i, e in enumerate(entries):
        assert bytes(pool.view(e)) == bytes([i]) * 4096


def test_pool_never_reuses_space_a_reader_still_pins():
    pool = PublishedPool(4 * 4096)
    pages = {f"k{i}".encode(): bytes([i]) * 4096 for i in range(4)}
    for k, v in pages.items():
        assert pool.put(k, v)[0] is not None
    reading = pool.acquire(b"k0")  # a reader is sending k0's bytes
    assert reading is not None
    assert pool.remove(b"k0") is not None  # evicted/deleted while read: retired, not freed
    # The pool is full: the new page must evict an unpinned page, never take k0's range.
    entry, evicted = pool.put(b"new", b"\xff" * 4096)
    assert entry is not None and entry.offset != reading.offset
    assert [e.key for e in evicted] == [b"k1"]
    assert bytes(pool.view(reading)) == pages[b"k0"]  # the reader's bytes are intact
    pool.release(reading)
    assert pool.stats().retired == 0
    again, _ = pool.put(b"later", b"\x01" * 4096)  # now that range is free again
    assert again is not None and again.offset == reading.offset


def test_pool_full_of_pinned_pages_refuses_instead_of_overwriting():
    pool = PublishedPool(2 * 4096)
    pins = []
    for k in (b"a", b"b"):
        pool.put(k, b"x" * 4096)
        pins.append(pool.acquire(k))
    entry, evicted = pool.put(b"c", b"y" * 4096)
    assert entry is None and evicted == []
    assert pool.put(b"huge", b"z" * (3 * 4096)) == (None, [])
    for p in pins:
        pool.release(p)
    assert pool.put(b"c", b"y" * 4096)[0] is not None


def test_pool_lru_order_follows_reads():
    pool = PublishedPool(3 * 4096)
    for k in (b"a", b"b", b"c"):
        pool.put(k, b"." * 4096)
    pool.release(pool.acquire(b"a"))  # read: a is newest now
    _, evicted = pool.put(b"d", b"." * 4096)
    assert [e.key for e in evicted] == [b"b"]


# --- directory ----------------------------------------------------------------------------------------


def rec(key: bytes, node_id: str, generation: int, incarnation: int = 0) -> PeerLocation:
    return PeerLocation(key=key, node=node_id, offset=0, length=10, generation=generation, checksum=b"\0" * 16, incarnation=incarnation)


def test_directory_keeps_the_newest_generation_and_a_late_unpublish_spares_it():
    shard = DirectoryShard()
    assert shard.publish([rec(b"k", "A", 5)]) == 1
    assert shard.publish([rec(b"k", "A", 3)]) == 0  # an older record arriving late is dropped
    assert shard.publish([rec(b"k", "B", 1)]) == 1  # another node's copy sits beside it
    assert shard.unpublish([b"k"], "A", [4]) == 0  # the unpublish of an older generation spares gen 5
    assert sorted((r.node, r.generation) for r in shard.resolve([b"k"])[0]) == [("A", 5), ("B", 1)]
    assert shard.keep_nodes({"A"}) == 1  # B left the cluster: its records go
    assert [r.node for r in shard.resolve([b"k"])[0]] == ["A"]
    assert shard.keep_keys(lambda key: False) == 1
    assert shard.resolve([b"k", b"x"]) == [[], []] and len(shard) == 0


def test_directory_drops_an_earlier_run_of_a_node_and_refuses_its_late_records():
    """A node killed and restarted on its port (its id) within the TTL: the first publish of its new run,
    or membership, drops the earlier run's records, and one of them arriving late (sent just before the
    kill, or replayed) is refused: it would name a page the new run never held."""
    shard = DirectoryShard()
    assert shard.publish([rec(b"k", "A", 5, incarnation=1), rec(b"j", "A", 6, incarnation=1), rec(b"k", "B", 1, incarnation=1)]) == 3
    assert shard.publish([rec(b"x", "A", 1, incarnation=2)]) == 1  # the new run's first page (a lower generation)
    assert [(r.node, r.incarnation) for r in shard.resolve([b"k"])[0]] == [("B", 1)]
    assert shard.resolve([b"j"]) == [[]]
    assert shard.publish([rec(b"j", "A", 7, incarnation=1)]) == 0  # late, from the earlier run
    assert shard.resolve([b"j"]) == [[]]
    # Membership says B restarted before B published anything of its new run.
    assert shard.drop_incarnations_before("B", 3) == 1
    assert shard.publish([rec(b"k", "B", 2, incarnation=1)]) == 0
    assert shard.publish([rec(b"k", "B", 1, incarnation=3)]) == 1
    # A node that left is forgotten: a later run of it (or a clock set back) starts afresh.
    assert shard.keep_nodes({"B"}) == 1
    assert shard.publish([rec(b"y", "A", 1, incarnation=1)]) == 1


# --- discovery ----------------------------------------------------------------------------------------


def test_masters_are_the_head_then_by_id():
    members = [node(5), node(2), node(9), node(3)]
    assert masters_of(members, head=node(9).id, max_masters=3) == [node(9).id, node(2).id, node(3).id]
    # The head gone: the next in order steps in; nothing is elected.
    assert masters_of(members[:2] + members[3:], head=node(9).id, max_masters=3) == [node(2).id, node(3).id, node(5).id]


def test_member_table_expires_the_silent_and_adoption_never_revives_them():
    t = MemberTable(head=node(1).id, max_masters=3, ttl_s=5.0)
    t.heard(node(1), now=100.0)
    t.heard(node(2), now=100.0)
    assert t.expire(now=104.0) == []
    t.heard(node(1), now=104.0)
    assert t.expire(now=106.0) == [node(2).id]
    other = MemberTable(head=node(1).id, max_masters=3, ttl_s=5.0)
    other.heard(node(2))
    view = other.view()
    view.silent_ms[0] = 6000  # the other master last heard node 2 more than a TTL ago
    t.adopt(view)
    assert [n.id for n in t.view().members] == [node(1).id]
    view.silent_ms[0] = 100
    t.adopt(view)
    assert [n.id for n in t.view().members] == [node(1).id, node(2).id]


def test_a_non_master_takes_what_every_master_knows_together():
    """The head restarted on its address knows only who has heartbeated it since: its table alone would
    drop the others from a non-master's ring and shard (and those records were never published again)."""
    from kvdepot.peer.discovery import is_table, merged
    from kvdepot.protocol.messages import PeerMembershipReply

    head = node(1).id
    fresh = PeerMembershipReply(members=[node(1, incarnation=9), node(4)], masters=[head], head=head, silent_ms=[0, 10])
    other = PeerMembershipReply(members=[node(1), node(2), node(3), node(4)], masters=[head, node(2).id], head=head,
                                silent_ms=[900, 50, 60, 300])  # fmt: skip
    view = merged([fresh, other], head, max_masters=2)
    assert [(n.id, n.incarnation) for n in view.members] == [(head, 9), (node(2).id, 1), (node(3).id, 1), (node(4).id, 1)]
    assert view.silent_ms == [0, 50, 60, 10] and view.masters == [head, node(2).id] and is_table(view)
    cached = PeerMembershipReply(members=[node(1), node(5)], masters=[head], head=head)  # a non-master's answer
    assert not is_table(cached)


def test_a_just_started_master_is_settling_until_a_ttl_passes_or_it_adopts_a_settled_table():
    """Just started, a master knows only who has heartbeated it since: its table says so (``settling``)
    for one member TTL, or until it adopts a master's table that is settled. Merged tables settle with
    any settled one. A peer that predates the field reads a settled answer exactly as before, and
    refuses a settling one (it keeps its membership: the safe reading)."""
    import msgspec

    from kvdepot.peer.discovery import merged
    from kvdepot.protocol.messages import PeerMembershipReply

    head = node(1).id
    assert MemberTable(head, 1, ttl_s=5.0, now=100.0).settling(now=104.9)
    assert not MemberTable(head, 1, ttl_s=5.0, now=100.0).settling(now=105.0)
    fresh = MemberTable(head, 1, ttl_s=5.0)
    fresh.heard(node(1))
    old = MemberTable(head, 1, ttl_s=5.0, now=time.monotonic() - 6.0)
    for i in (1, 2, 3):
        old.heard(node(i))
    assert fresh.view().settling and not old.view().settling
    assert merged([fresh.view()], head, 1).settling
    assert not merged([fresh.view(), old.view()], head, 1).settling
    other = MemberTable(head, 1, ttl_s=5.0)
    other.adopt(fresh.view())  # a settling table settles no one
    assert other.view().settling
    fresh.adopt(old.view())
    assert not fresh.view().settling and [n.id for n in fresh.view().members] == [node(i).id for i in (1, 2, 3)]

    class OldReply(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):  # PeerMembershipReply before the field
        members: list[PeerNodeInfo]
        masters: list[str]
        head: str = ""
        silent_ms: list[int] = msgspec.field(default_factory=list)

    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old.view()), type=OldReply).members == old.view().members
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(MemberTable(head, 1, ttl_s=5.0).view()), type=OldReply)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(PeerMembershipReply(members=[], masters=[])), type=OldReply).head == ""


# --- data-plane handshake -----------------------------------------------------------------------------


def _handshake(server_secret: bytes, client_secret: bytes) -> tuple[BaseException | None, BaseException | None]:
    a, b = socket.socketpair()
    errors: list[BaseException | None] = [None, None]

    def serve():
        try:
            serve_handshake(a, server_secret, time.monotonic() + 5)
        except BaseException as exc:
            errors[0] = exc
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        client_handshake(b, client_secret)
    except BaseException as exc:
        errors[1] = exc
    t.join(5)
    a.close()
    b.close()
    return errors[0], errors[1]


def test_handshake_needs_the_same_secret_on_both_ends():
    assert _handshake(b"s", b"s") == (None, None)
    server_err, client_err = _handshake(b"s", b"wrong")
    assert isinstance(server_err, HandshakeFailed) and isinstance(client_err, HandshakeFailed)
    server_err, client_err = _handshake(b"", b"s")  # an open node and a secured one never talk
    assert isinstance(server_err, HandshakeFailed) and isinstance(client_err, HandshakeFailed)


def test_a_view_without_timings_is_never_adopted():
    """A non-master answers with its cached membership, which says nothing of when anyone was last
    heard: adopting it as fresh would keep a dead node alive forever."""
    t = MemberTable(head=node(1).id, max_masters=3, ttl_s=5.0)
    t.heard(node(1))
    cached = MemberTable(head=node(1).id, max_masters=3, ttl_s=5.0)
    cached.heard(node(7))
    view = cached.view()
    view.silent_ms = []
    t.adopt(view)
    assert [n.id for n in t.view().members] == [node(1).id]


# --- data plane reader --------------------------------------------------------------------------------


def _stalling_owner(secret: bytes, send: bytes) -> tuple[socket.socket, threading.Event]:
    """An owner that passes the handshake, reads the request, sends ``send`` and then nothing more."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            serve_handshake(conn, secret, time.monotonic() + 5)
            conn.recv(65536)
            conn.sendall(send)
            done.wait(30)

    threading.Thread(target=serve, daemon=True).start()
    return listener, done


@pytest.mark.parametrize("sent", ["nothing", "half a page"])
def test_a_reader_blocked_mid_page_gives_up_at_its_deadline(sent):
    """Readers' sockets are blocking with kernel timeouts, so a page arrives in one call: that call
    must still end at the deadline when the owner stops sending (before the reply or halfway through
    the page), as a miss, and the connection is dropped rather than reused."""
    import struct
    import time

    from kvdepot.peer.dataplane import PageOutcome, PageRead, TcpTransport

    size = 1 << 20
    reply = struct.pack("<B7xQ", 0, size) + b"x" * (size // 2) if sent == "half a page" else b""
    listener, done = _stalling_owner(b"s", reply)
    transport = TcpTransport(b"s")
    dest = memoryview(bytearray(size))
    try:
        t0 = time.monotonic()
        got = transport.read("127.0.0.1", listener.getsockname()[1], [PageRead(b"k", 1, 0, size, b"\0" * 16, dest)], t0 + 0.5)
        took = time.monotonic() - t0
        assert got == [PageOutcome.MISS]
        assert 0.4 < took < 3.0, f"the read took {took:.2f} s against a 0.5 s deadline"
        assert transport.dropped == 1
    finally:
        done.set()
        transport.close()
        listener.close()


def test_an_owner_counts_every_refused_reader_and_logs_them_once_in_a_while(caplog):
    """A node without the secret retries on every read: each refusal is counted, but the owner's log,
    and the refused reader's, say so once per interval, not once per attempt."""
    import logging

    from kvdepot.peer.dataplane import TcpTransport, DataServer, PageOutcome, PageRead

    class NoPages:
        def acquire(self, key, generation=0):
            return None

        def release(self, entry):
            pass

        def view(self, entry):
            raise AssertionError("nothing is served to a refused reader")

    owner = DataServer(NoPages(), b"the-secret")
    owner.start()
    stranger = TcpTransport(b"not-the-secret")
    try:
        with caplog.at_level(logging.WARNING, logger="kvdepot.peer.dataplane"):
            for _ in range(5):
                dest = memoryview(bytearray(16))
                got = stranger.read("127.0.0.1", owner.port, [PageRead(b"k", 1, 0, 16, b"\0" * 16, dest)], time.monotonic() + 2.0)
                assert got == [PageOutcome.MISS]
            deadline = time.monotonic() + 5
            while owner.refused < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert owner.refused == 5
        owner_said = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
        reader_said = [r.getMessage() for r in caplog.records if "does not hold our cluster secret" in r.getMessage()]
        assert len(owner_said) == 1 and "1 refused so far" in owner_said[0], owner_said
        assert len(reader_said) == 1, reader_said
    finally:
        stranger.close()
        owner.close()


def _one_page_owner(secret: bytes = b"s"):
    from kvdepot.peer.dataplane import DataServer
    from kvdepot.peer.pool import PublishedPool

    pool = PublishedPool(1 << 20)
    entry, _ = pool.put(b"k", b"p" * 4096)
    assert entry is not None
    return DataServer(pool, secret), entry


def _read_one(transport, port: int, entry):
    from kvdepot.peer.dataplane import PageRead

    dest = memoryview(bytearray(entry.length))
    got = transport.read("127.0.0.1", port, [PageRead(b"k", entry.generation, entry.offset, entry.length, entry.checksum, dest)],
                         time.monotonic() + 5.0)  # fmt: skip
    return got, bytes(dest)


def test_an_owner_keeps_accepting_after_accept_fails_and_after_a_thread_would_not_start():
    """Out of file descriptors for a moment (EMFILE from accept), or no thread for one connection:
    that connection is lost, never the accept loop (which used to end quietly, leaving a node that
    published pages nobody could read)."""
    import errno

    from kvdepot.peer.dataplane import PageOutcome, TcpTransport

    owner, entry = _one_page_owner()

    class FlakyListener:
        def __init__(self, real):
            self.real, self.failures = real, 2

        def accept(self):
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EMFILE, "Too many open files")
            return self.real.accept()

        def __getattr__(self, name):
            return getattr(self.real, name)

    owner._listener = FlakyListener(owner._listener)
    real_start, refusals = owner._start_serving, []

    def start_once_refused(conn):
        if not refusals:
            refusals.append(conn)
            raise RuntimeError("can't start new thread")
        real_start(conn)

    owner._start_serving = start_once_refused
    owner.start()
    reader = TcpTransport(b"s", connect_timeout_s=2.0)
    try:
        first, _ = _read_one(reader, owner.port, entry)  # its connection is the one no thread served
        assert first == [PageOutcome.MISS]
        got, data = _read_one(reader, owner.port, entry)
        assert got == [PageOutcome.HIT] and data == b"p" * 4096
        assert owner._listener.failures == 0 and len(refusals) == 1
        assert owner._thread.is_alive()
    finally:
        reader.close()
        owner.close()


def test_a_reader_that_paces_its_handshake_is_closed_at_the_handshake_deadline(monkeypatch):
    """The handshake has one deadline in all: a byte now and then used to restart the timeout on
    every receive, holding the connection (and its thread) for as long as the stranger liked."""
    from kvdepot.peer import dataplane

    monkeypatch.setattr(dataplane, "HANDSHAKE_TIMEOUT_S", 0.5)
    owner, _ = _one_page_owner()
    owner.start()
    try:
        with socket.create_connection(("127.0.0.1", owner.port), timeout=5) as conn:
            assert conn.recv(64)  # the owner's hello
            t0, closed = time.monotonic(), False
            for _ in range(47):  # one byte short of the 48-byte answer, one every 0.1 s (4.7 s)
                try:
                    conn.sendall(b"x")
                except OSError:
                    closed = True
                    break
                conn.settimeout(0.1)
                try:
                    if conn.recv(1) == b"":
                        closed = True
                        break
                except TimeoutError:
                    pass
                except ConnectionResetError:  # closed with our bytes unread: the kernel answers with a reset
                    closed = True
                    break
            took = time.monotonic() - t0
        assert closed and took < 2.5, f"the paced handshake held the connection for {took:.1f} s (limit 0.5 s)"
    finally:
        owner.close()


def test_data_connections_use_tcp_keep_alive_on_both_ends():
    """An idle pooled connection to a reader that lost power or sits behind a partition must end (its
    owner's thread and descriptor with it): TCP keep-alive finds it; nothing else would."""
    from kvdepot.peer.dataplane import KEEPALIVE_IDLE_S, PageOutcome, TcpTransport

    owner, entry = _one_page_owner()
    owner.start()
    reader = TcpTransport(b"s")
    try:
        got, _ = _read_one(reader, owner.port, entry)
        assert got == [PageOutcome.HIT]
        [idle] = reader._peers[("127.0.0.1", owner.port)].idle
        with owner._lock:
            [served] = list(owner._conns)
        for conn in (idle, served):
            assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    finally:
        reader.close()
        owner.close()


def test_a_read_of_more_pages_than_an_owner_takes_a_request_goes_in_slices():
    """An owner closes a request of more than MAX_PAGES_PER_REQUEST pages; a long prompt of small pages
    asks one owner for more: the reader splits it, and every page arrives, each to its own buffer."""
    from kvdepot.peer.dataplane import MAX_PAGES_PER_REQUEST, DataServer, PageOutcome, PageRead, TcpTransport
    from kvdepot.peer.pool import ALIGNMENT, PublishedPool

    n, size = MAX_PAGES_PER_REQUEST + 3, 64
    pool = PublishedPool((n + 1) * max(size, ALIGNMENT))
    pages = []
    for i in range(n):
        entry, evicted = pool.put(f"k{i}".encode(), bytes([i % 251]) * size)
        assert entry is not None and not evicted
        pages.append((f"k{i}".encode(), entry, entry.checksum))
    owner = DataServer(pool, b"s")
    owner.start()
    reader = TcpTransport(b"s")
    try:
        dests = [memoryview(bytearray(size)) for _ in range(n)]
        reads = [PageRead(key, e.generation, e.offset, e.length, digest, d) for (key, e, digest), d in zip(pages, dests, strict=True)]
        got = reader.read("127.0.0.1", owner.port, reads, time.monotonic() + 20.0)
        assert got == [PageOutcome.HIT] * n
        assert all(bytes(d) == bytes([i % 251]) * size for i, d in enumerate(dests))
        assert reader.dropped == 0
    finally:
        reader.close()
        owner.close()


def test_owed_records_are_taken_once_and_past_the_limit_everything_is_owed():
    owed = OwedRecords(limit=4)
    owed.owe([b"a", b"b"])
    owed.owe([b"b", b"c"])
    assert len(owed) == 3
    assert owed.take() == (False, {b"a", b"b", b"c"})
    assert owed.take() == (False, set()) and len(owed) == 0  # paid: owed again only if it fails again
    owed.owe(bytes([i]) for i in range(5))  # one past the limit: a full re-publish instead of a key list
    assert len(owed) == 4
    owed.owe([b"z"])
    assert owed.take() == (True, set())
    assert owed.take() == (False, set())


def test_owed_unpublishes_keep_the_newest_generation_per_owner_and_key_and_count_what_the_bound_drops():
    owed = OwedUnpublishes(limit=3)
    owed.owe("n1", [(b"a", 5), (b"b", 1)])
    owed.owe("n1", [(b"a", 3)])  # an older generation adds nothing: the newer one covers it
    owed.owe("n2", [(b"a", 2), (b"c", 1)])  # the fourth entry: over the bound, dropped and counted
    assert len(owed) == 3 and owed.dropped == 1
    assert owed.take() == {"n1": [(b"a", 5), (b"b", 1)], "n2": [(b"a", 2)]}
    assert owed.take() == {} and len(owed) == 0  # sent: owed again only if it fails again


class _StallsOn:
    """A pool whose acquire of one key stalls (an owner busy with a large request)."""

    def __init__(self, pool, slow: bytes, delay_s: float) -> None:
        self.pool, self.slow, self.delay_s = pool, slow, delay_s

    def acquire(self, key, generation=0):
        if key == self.slow:
            time.sleep(self.delay_s)
        return self.pool.acquire(key, generation)

    def release(self, entry):
        self.pool.release(entry)

    def view(self, entry):
        return self.pool.view(entry)


def test_a_slice_that_fails_after_a_whole_one_drops_its_connection(monkeypatch):
    """A read in slices whose second slice passes its deadline: the first slice's success used to put
    the connection back, with the owner's late replies still coming, and the next read on it took
    them for its own (a held page read as CORRUPT, or as another page's MISS)."""
    from kvdepot.peer import dataplane
    from kvdepot.peer.dataplane import DataServer, PageOutcome, PageRead, TcpTransport

    monkeypatch.setattr(dataplane, "MAX_PAGES_PER_REQUEST", 2)  # both ends read the module's value
    size = 4096
    pool = PublishedPool(16 * size)
    entries = {name: pool.put(name, name * size)[0] for name in (b"a", b"b", b"c", b"d", b"x")}
    owner = DataServer(_StallsOn(pool, b"c", 0.6), b"s")
    owner.start()
    reader = TcpTransport(b"s", max_channels_per_peer=1)

    def read(name):
        e = entries[name]
        return PageRead(name, e.generation, e.offset, e.length, e.checksum, memoryview(bytearray(size)))

    try:
        first = reader.read("127.0.0.1", owner.port, [read(b"a"), read(b"b"), read(b"c"), read(b"d")], time.monotonic() + 0.3)
        assert first == [PageOutcome.HIT, PageOutcome.HIT, PageOutcome.MISS, PageOutcome.MISS]
        assert reader.dropped == 1, "a connection whose read failed mid-request was put back for reuse"
        time.sleep(1.0)  # the owner has sent c's and d's replies by now
        again = reader.read("127.0.0.1", owner.port, [read(b"x")], time.monotonic() + 2.0)
        assert again == [PageOutcome.HIT], f"a held page read as {again[0].name}"
    finally:
        reader.close()
        owner.close()


def test_strangers_that_never_finish_a_handshake_do_not_lock_readers_out(monkeypatch):
    """Connections still in their handshake count towards the owner's cap: anyone who can reach the
    data port could hold every place with sockets that send nothing, and each reader's new connection
    was closed at once. At the cap the oldest connection still in its handshake makes way."""
    from kvdepot.peer import dataplane
    from kvdepot.peer.dataplane import DataServer, PageOutcome, PageRead, TcpTransport

    monkeypatch.setattr(dataplane, "MAX_CONNECTIONS", 8)
    pool = PublishedPool(1 << 20)
    entry, _ = pool.put(b"k", b"p" * 4096)
    owner = DataServer(pool, b"the-secret")
    owner.start()
    strangers = []
    reader = TcpTransport(b"the-secret")
    try:
        strangers = [socket.create_connection(("127.0.0.1", owner.port)) for _ in range(8)]  # no secret, nothing sent
        time.sleep(0.3)  # all accepted, each waiting for its handshake
        dest = memoryview(bytearray(entry.length))
        read = PageRead(b"k", entry.generation, entry.offset, entry.length, entry.checksum, dest)
        assert reader.read("127.0.0.1", owner.port, [read], time.monotonic() + 2.0) == [PageOutcome.HIT]
        assert bytes(dest) == b"p" * 4096
    finally:
        for s in strangers:
            s.close()
        reader.close()
        owner.close()
