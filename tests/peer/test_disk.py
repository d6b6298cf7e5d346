"""The disk tier under the pool (L4): evicted pages stay readable, promoted back on a read, a restart
keeps them, and an unusable path turns the tier off without stopping the node."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
from support.peer_cluster import check_pages, keys, page_bytes, wait_for

from kvdepot.peer import PeerStore

SIZE = 64 << 10
FAST = {"heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "control_timeout_s": 0.5, "timeout_s": 2.0, "secret": "disk-test", "metrics_port": 0}


def test_pages_evicted_from_the_pool_are_promoted_from_disk_on_a_read(tmp_path):
    with PeerStore(port=0, data_port=0, pool_size_mb=2, disk_path=str(tmp_path / "l4"), **FAST) as owner, \
         PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=8, **FAST) as reader:  # fmt: skip
        wait_for(lambda: len(reader.status()["members"]) == 2 and len(owner.status()["members"]) == 2, 10, "two members")
        names = keys("d", 48)  # 3 MiB through a 2 MiB pool: a third of the pages leave it
        for n in names:
            assert owner.set(n, page_bytes(n, SIZE))
        wait_for(lambda: owner.status()["disk"]["written"] == 48, 10, "the write-through")
        assert owner.status()["pool"]["evictions"] >= 16
        assert reader.batch_exists(names) == 48  # a page on disk is a hit
        assert check_pages(reader, "d", 48, SIZE) == {"hit": 48, "miss": 0, "wrong": 0}
        assert owner.status()["disk"]["promoted"] >= 16
        # Deleted: gone from pool, disk and directory.
        assert owner.delete("d0")
        wait_for(lambda: not reader.exists("d0"), 5, "the delete to reach the directory")


def test_a_restarted_node_serves_what_its_disk_kept(tmp_path):
    disk = str(tmp_path / "l4")
    with PeerStore(port=0, data_port=0, pool_size_mb=8, **FAST) as head:
        owner = PeerStore(discovery=head.node_id, port=0, data_port=0, pool_size_mb=1, disk_path=disk, **FAST)
        names = keys("r", 8)
        assert owner.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 8
        wait_for(lambda: owner.status()["disk"]["written"] == 8, 10, "the write-through")
        port = int(owner.node_id.rsplit(":", 1)[1])
        owner.close()
        wait_for(lambda: len(head.status()["members"]) == 1, 10, "the owner to leave")
        assert head.batch_exists(names) == 0
        with PeerStore(discovery=head.node_id, port=port, data_port=0, pool_size_mb=1, disk_path=disk, **FAST) as again:
            assert again.status()["disk"]["pages"] == 8
            wait_for(lambda: head.batch_exists(names) == 8, 10, "the restarted node's disk pages in the directory")
            assert check_pages(head, "r", 8, SIZE) == {"hit": 8, "miss": 0, "wrong": 0}


@contextmanager
def _owner_restarted_within_the_ttl(name: str, options: dict, settle_s: float = 0.0):
    """A head and a second node (member TTL 30 s: nobody expires the killed node meanwhile; three nodes,
    so most keys' records live on the other two, not on the restarted node's fresh shard), and an owner
    process that sets 8 pages named ``name``, is killed ``settle_s`` after they are in the directory,
    and starts again on its port, so with its id. Yields (head, the restarted owner)."""
    from support.peer_cluster import NodeProcess

    slow = {**FAST, "member_ttl_s": 30.0}
    options = {**options, "extra": {**options.get("extra", {}), "member_ttl_s": 30.0}}
    with PeerStore(port=0, data_port=0, pool_size_mb=8, **slow) as head, PeerStore(discovery=head.node_id, port=0, data_port=0, pool_size_mb=8, **slow):
        owner = NodeProcess(discovery=head.node_id, secret=FAST["secret"], **options).start()
        try:
            owner.command(f"set {name} 8 {SIZE} 0")
            wait_for(lambda: head.batch_exists(keys(name, 8)) == 8, 10, "the owner's pages in the directory")
            time.sleep(settle_s)
            port = int(owner.node_id.rsplit(":", 1)[1])
        finally:
            owner.kill()
        again = NodeProcess(discovery=head.node_id, secret=FAST["secret"], port=port, **options).start()
        try:
            assert again.node_id == owner.node_id
            yield head, again
        finally:
            again.kill()


def test_a_node_killed_and_restarted_within_the_ttl_serves_what_its_disk_kept(tmp_path):
    """Killed and back on its port before the others expire it: it keeps its id, and the head still
    holds its earlier incarnation's records of its pages. The disk's records it publishes again replace
    them (a generation of 0 did not: the pages stayed unreadable though the disk had them)."""
    options = {"pool_size_mb": 1, "extra": {"disk_path": str(tmp_path / "l4")}}
    # settle: the write-through (async) reaches the disk before the kill
    with _owner_restarted_within_the_ttl("r", options, settle_s=1.0) as (head, _):
        wait_for(lambda: check_pages(head, "r", 8, SIZE)["hit"] == 8, 15, "the restarted node's disk pages readable")
        assert check_pages(head, "r", 8, SIZE) == {"hit": 8, "miss": 0, "wrong": 0}


def _what_names(head, names: list[str], again) -> str:
    """Who the directory says holds ``names``, and which run of each node the head knows (a failure's story)."""
    found = head.node.resolve([n.encode() for n in names], time.monotonic() + 2, remembered=False)
    kept = [(r.node, r.incarnation, r.generation) for recs in head.node.shard.resolve([n.encode() for n in names]) for r in recs]
    runs = {n.id: n.incarnation for n in head.node.members()}
    return (f"found {[(f.node, f.incarnation, f.generation) for f in found if f is not None]}, the head's shard keeps {kept}, "
            f"the head knows runs {runs}, the restarted node says {again.command('status')}")


def test_a_node_restarted_within_the_ttl_without_its_pages_leaves_no_records_of_them(tmp_path):
    """Killed and back on its port (its id) before the others expire it, with an empty pool and no disk:
    the records of its earlier run named pages nobody holds, and nothing ever unpublished them. They
    read as present for good (``batch_exists``), cost every read a round trip and a miss, and in a
    server's tier list hid the copies in the tiers below."""
    names = keys("g", 8)
    with _owner_restarted_within_the_ttl("g", {"pool_size_mb": 4}) as (head, again):
        try:
            wait_for(lambda: not any(head.exists(n) for n in names), 15, "the earlier run's records to go")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {_what_names(head, names, again)}") from None
        assert check_pages(head, "g", 8, SIZE) == {"hit": 0, "miss": 8, "wrong": 0}
        again.command(f"set g 8 {SIZE} 0")  # written again: found again
        wait_for(lambda: head.batch_exists(names) == 8, 10, "the new run's pages in the directory")
        assert check_pages(head, "g", 8, SIZE) == {"hit": 8, "miss": 0, "wrong": 0}


def test_an_unusable_disk_path_turns_the_tier_off_and_the_node_still_serves(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with PeerStore(port=0, data_port=0, pool_size_mb=2, disk_path=str(blocker / "l4"), **FAST) as node:
        assert node.status()["disk"] is None
        assert node.set("x", b"y" * 5000) and node.get("x") == b"y" * 5000


def _gated_disk(store):
    """Hold the store's disk writer inside its next write (of the page named "gate") until released."""
    import threading

    disk = store.node.disk
    gate, inside = threading.Event(), threading.Event()
    real = disk._fs.put_now

    def put_now(key, data):
        if bytes(key).startswith(b"gate"):
            inside.set()
            assert gate.wait(10)
        return real(key, data)

    disk._fs.put_now = put_now
    return disk, gate, inside


def _in_thread(fn):
    import threading

    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_a_page_deleted_or_cleared_while_queued_for_the_disk_never_comes_back(tmp_path):
    """A delete or a clear (how an operator invalidates KV) that comes while the page still waits for
    the disk writer: the writer used to store it afterwards, and a promote, or the node's next start,
    served the deleted bytes again."""
    with PeerStore(port=0, data_port=0, pool_size_mb=8, disk_path=str(tmp_path / "l4"), **FAST) as store:
        for finish in ("delete", "clear"):
            disk, gate, inside = _gated_disk(store)
            assert store.set("gate", page_bytes("gate", SIZE))
            assert inside.wait(10)  # the writer is busy; what comes next waits in its queue
            assert store.set("k", page_bytes("k", SIZE))
            done = _in_thread(lambda: store.delete("k") if finish == "delete" else store.clear())
            time.sleep(0.2)
            gate.set()
            done.join(10)
            wait_for(lambda: disk.pending() == 0, 10, "the disk queue to drain")
            time.sleep(0.2)  # the writer's last page, taken off the queue, ends
            assert not disk.has(b"k"), f"a page {finish}d while queued reached the disk"
            assert not store.exists("k") and store.get("k") is None
        assert store.status()["disk"]["skipped"] >= 1


def test_a_newer_page_that_misses_the_disk_takes_the_older_one_off_it(tmp_path, monkeypatch):
    """A key written again while the disk queue is full: the new page is in the pool, the old one on
    disk. Once the pool lets the new one go, a promote used to serve the old bytes."""
    from kvdepot.peer import disk as disk_module

    monkeypatch.setattr(disk_module, "QUEUE_PAGES", 1)
    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=str(tmp_path / "l4"), **FAST) as store:
        old, new = page_bytes("old", SIZE), page_bytes("new", SIZE)
        assert store.set("k", old)
        wait_for(lambda: store.status()["disk"]["written"] == 1, 10, "the first page on disk")
        disk, gate, inside = _gated_disk(store)
        assert store.set("gate", page_bytes("gate", SIZE))
        assert inside.wait(10)
        assert store.set("filler", page_bytes("filler", SIZE))  # the queue's one place
        writing = _in_thread(lambda: store.set("k", new))  # its disk write is dropped: the queue is full
        time.sleep(0.2)
        gate.set()
        writing.join(10)
        wait_for(lambda: disk.pending() == 0, 10, "the disk queue to drain")
        assert store.status()["disk"]["dropped"] >= 1
        for i in range(40):  # 2.5 MiB through a 1 MiB pool: "k" leaves it
            assert store.set(f"push{i}", page_bytes(f"push{i}", SIZE))
        got = store.get("k")
        assert got in (None, new), "the page written before the newest one came back from disk"


def test_a_delete_of_a_page_only_on_disk_spares_the_record_of_the_key_written_meanwhile(tmp_path):
    """The delete's unpublish of a disk-only page named every generation: a page of the key put while
    the delete ran, whose publish reached the owner first, lost its record (held, yet unreadable)."""
    from kvdepot.protocol import messages as m

    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=str(tmp_path / "l4"), **FAST) as store:
        assert store.set("k", page_bytes("k", SIZE))
        wait_for(lambda: store.status()["disk"]["written"] == 1, 10, "the page on disk")
        for i in range(40):  # 2.5 MiB through a 1 MiB pool: "k" is on disk only
            assert store.set(f"push{i}", page_bytes(f"push{i}", SIZE))
        assert store.node.pool.peek(b"k") is None and store.exists("k")
        node, real = store.node, store.node._call_shard
        raced = []

        def call_shard(owner, body, deadline):
            if isinstance(body, m.PeerUnpublishRequest) and b"k" in body.keys and not raced:
                raced.append(True)
                assert store.set("k", page_bytes("k", SIZE, 1))  # put meanwhile; its publish gets there first
            return real(owner, body, deadline)

        node._call_shard = call_shard
        assert store.delete("k")
        assert raced
        assert store.exists("k"), "the page put during the delete lost its record"
        assert store.get("k") == page_bytes("k", SIZE, 1)


def test_pages_the_disk_drops_to_stay_within_its_bound_leave_the_directory(tmp_path):
    """Pages evicted from the pool are published as on disk; the disk tier in turn drops its oldest to
    stay within ``disk_size_gb``. The node used to go on publishing those: its memory of them and its
    directory records grew for good, and ``exists`` counted pages no read could deliver."""
    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=str(tmp_path / "l4"), disk_size_gb=1 / 1024, **FAST) as store:
        names = keys("b", 48)  # 3 MiB through a 1 MiB pool onto a 1 MiB disk
        for n in names:
            assert store.set(n, page_bytes(n, SIZE))
        node = store.node
        wait_for(lambda: node.disk.pending() == 0 and store.status()["disk"]["written"] == 48, 10, "the write-through")

        def held() -> set[bytes]:
            return {e.key for e in node.pool.entries()} | {bytes(k) for k in node.disk._fs.keys()}

        assert len(held()) < 40, "the disk kept nearly everything: the test proves nothing"
        wait_for(lambda: len(node.shard) == len(held()), 10, "one record per page still held")
        assert len(node._disk_only) <= store.status()["disk"]["pages"]
        assert b"b0" not in held() and not store.exists("b0") and store.get("b0") is None


def test_a_read_promotes_from_disk_only_within_its_deadline_and_a_slow_promote_suspects_no_one(tmp_path):
    """Pages a read finds on a disk are promoted slice by slice. Every slice used to be promoted
    whatever the read's deadline (each promote publishing with the full control timeout), and a promote
    that ran past the reader's control timeout (a slow disk) marked a healthy owner suspect."""
    import threading

    from kvdepot.peer.dataplane import PageOutcome

    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=str(tmp_path / "l4"), **FAST) as owner, \
         PeerStore(discovery=owner.node_id, port=0, data_port=0, pool_size_mb=8, **FAST) as reader:  # fmt: skip
        wait_for(lambda: len(reader.status()["members"]) == 2 and len(owner.status()["members"]) == 2, 10, "two members")
        names = keys("dl", 48)  # 3 MiB through a 1 MiB pool
        for n in names:
            assert owner.set(n, page_bytes(n, SIZE))
        wait_for(lambda: owner.status()["disk"]["written"] == 48, 10, "the write-through")
        cold = [n.encode() for n in names if not owner.node.pool.contains(n.encode())]
        assert len(cold) >= 24, "the pool kept most pages: the test proves nothing"
        disk, real = owner.node.disk, owner.node.disk.load
        loads: list[bytes] = []
        deadline = time.monotonic() + 0.5
        gate = threading.Event()

        def slow_load(key, into):  # a slow disk: the first page takes the read's whole budget
            loads.append(key)
            while time.monotonic() < deadline:
                time.sleep(0.01)
            assert gate.wait(10)
            return real(key, into)

        disk.load = slow_load
        gate.set()
        out, _ = owner.node.fetch(cold, [memoryview(bytearray(SIZE)) for _ in cold], deadline)
        assert len(loads) == 1, f"{len(loads)} pages promoted after the read's deadline had passed"
        assert all(o is PageOutcome.MISS for o in out[1:])

        gate.clear()  # the disk now stalls until released: the reader's promote call runs its full control timeout
        try:
            reader.node.fetch(cold[1:9], [memoryview(bytearray(SIZE)) for _ in range(8)], time.monotonic() + 5)
            assert reader.node._suspects.get(owner.node_id, 0.0) <= time.monotonic(), "a slow promote made the owner suspect"
        finally:
            gate.set()


@pytest.mark.parametrize("finish", ["delete", "clear"])
def test_a_page_deleted_while_a_promote_loads_it_does_not_come_back(tmp_path, finish):
    """A promote (a read's, or the warmer an existence check starts) reads the page from disk, then
    puts it into the pool. A delete or clear between the two used to find it nowhere, and the promote
    then put the deleted bytes in under a fresh generation and published them: served again."""
    import threading

    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=str(tmp_path / "l4"), **FAST) as store:
        assert store.set("k", page_bytes("k", SIZE))
        wait_for(lambda: store.status()["disk"]["written"] >= 1, 10, "the page on disk")
        for i in range(40):  # 2.5 MiB through a 1 MiB pool: "k" is left on disk only
            assert store.set(f"push{i}", page_bytes(f"push{i}", SIZE))
        wait_for(lambda: store.node.disk.pending() == 0, 10, "the disk queue to drain")
        assert store.node.pool.peek(b"k") is None and store.exists("k")
        time.sleep(0.3)  # the warmer that exists() started is done
        if store.node.pool.peek(b"k") is not None:  # it promoted the page: push it out again
            for i in range(40, 80):
                assert store.set(f"push{i}", page_bytes(f"push{i}", SIZE))
        assert store.node.pool.peek(b"k") is None

        fs = store.node.disk._fs
        real_get = fs.get_now
        racers, results = [], []

        def invalidate():
            results.append(store.delete("k") if finish == "delete" else store.clear() >= 1)

        def get_now(key, dest):
            ok = real_get(key, dest)
            if bytes(key) == b"k" and not racers:  # read from disk; the copy into the pool comes next
                t = threading.Thread(target=invalidate, daemon=True)
                t.start()
                t.join(0.5)  # the delete runs now, or waits while the promote excludes it
                racers.append(t)
            return ok

        fs.get_now = get_now
        store.get("k")  # the read racing the delete may see the old page; what stays is what matters
        fs.get_now = real_get
        assert racers
        racers[0].join(10)
        assert results == [True]
        state = {"in the pool": store.node.pool.peek(b"k") is not None, "published": store.exists("k"),
                 "served": store.get("k") is not None}  # fmt: skip
        assert not any(state.values()), f"the {finish}d page came back: {state}"


def test_a_page_in_the_pool_and_on_disk_promoted_during_a_clear_does_not_come_back(tmp_path):
    """A clear takes the pool's pages, then deletes their disk copies. A promote between the two (a
    reader holding an older non-resident record, or the warmer) found the page on disk and put it back
    in the pool, published: the clear looked for such late copies among disk-only pages alone, so this
    one stayed, served after the clear."""
    with PeerStore(port=0, data_port=0, pool_size_mb=4, disk_path=str(tmp_path / "l4"), **FAST) as store:
        assert store.set("k", page_bytes("k", SIZE))
        wait_for(lambda: store.status()["disk"]["written"] >= 1, 10, "the page on disk")
        node = store.node
        assert node.pool.peek(b"k") is not None  # in the pool and on disk
        disk = node.disk
        real_delete = disk.delete
        promoted = []

        def delete(key):
            if bytes(key) == b"k" and not promoted:
                promoted.append(node.promote([b"k"]))  # the pool was just cleared; the disk still has it
            return real_delete(key)

        disk.delete = delete
        try:
            assert store.clear() >= 1
        finally:
            disk.delete = real_delete
        assert promoted and promoted[0][0], "the promote did not run between the pool's clear and the disk's delete"
        state = {"in the pool": node.pool.peek(b"k") is not None, "published": store.exists("k"), "served": store.get("k") is not None}
        assert not any(state.values()), f"the cleared page came back: {state}"


def test_pages_under_keys_too_long_for_a_file_name_reach_the_disk_and_survive_a_restart(tmp_path):
    """A ``PeerStore`` takes keys up to 1 KiB, and every page set is written to disk; the fs tier names a
    file by its key's hex (at most 127 bytes). A longer key (a path-like name with a model and a tenant)
    was never written: a warning per page, a miss once the pool let it go, and nothing after a restart."""
    disk = str(tmp_path / "l4")
    prefix = "tenant-a/" + "m" * 180 + "/page-"  # a 200-byte key
    names = keys(prefix, 24)  # 1.5 MiB through a 1 MiB pool: some pages leave it
    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=disk, **FAST) as store:
        assert store.batch_set(names, [page_bytes(n, SIZE) for n in names]) == [True] * 24
        wait_for(lambda: store.status()["disk"]["written"] + store.status()["disk"]["dropped"] >= 24, 10, "the write-through")
        assert store.status()["disk"]["written"] == 24
        assert store.status()["pool"]["evictions"] > 0
        assert check_pages(store, prefix, 24, SIZE) == {"hit": 24, "miss": 0, "wrong": 0}
    with PeerStore(port=0, data_port=0, pool_size_mb=1, disk_path=disk, **FAST) as again:
        assert again.status()["disk"]["pages"] == 24
        assert check_pages(again, prefix, 24, SIZE) == {"hit": 24, "miss": 0, "wrong": 0}
