"""The recent-events ring behind /events/recent and what feeds it, and the per-tenant tally."""

from __future__ import annotations

import logging
import threading

import pytest

from kvdepot.events import EventKind, ObjectEvent, RemovedBecause, RequestDone
from kvdepot.observability.recent import RecentEvents, RecentLogHandler, bus_feed, l1_events_to
from kvdepot.observability.tenants import TenantTally
from kvdepot.types import ClearScope, ObjectKey


def test_the_ring_keeps_the_latest_newest_last():
    ring = RecentEvents(capacity=3)
    for i in range(5):
        ring.add("k", i=i)
    got = ring.latest()
    assert [e["i"] for e in got] == [2, 3, 4] and [e["seq"] for e in got] == [3, 4, 5]
    assert all(e["kind"] == "k" and e["t"] > 0 for e in got)
    assert [e["i"] for e in ring.latest(2)] == [3, 4]
    assert [e["i"] for e in ring.latest(after=4)] == [4]
    assert ring.latest(0) == [] and len(ring) == 3


def test_the_ring_filters_by_kind():
    ring = RecentEvents()
    for kind in ("a", "b", "a", "c"):
        ring.add(kind)
    assert [e["seq"] for e in ring.latest(kinds=("a", "c"))] == [1, 3, 4]
    assert [e["seq"] for e in ring.latest(1, kinds=("a",))] == [3]


def test_concurrent_adds_lose_nothing_and_stay_bounded():
    ring = RecentEvents(capacity=100)

    def add_many(t: int) -> None:
        for i in range(2000):
            ring.add("x", thread=t, i=i)

    threads = [threading.Thread(target=add_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = ring.latest()
    assert len(got) == 100 and [e["seq"] for e in got] == list(range(7901, 8001))


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RecentEvents(capacity=0)


def test_warnings_and_errors_logged_under_kvdepot_are_kept():
    ring = RecentEvents()
    handler = RecentLogHandler(ring)
    log = logging.getLogger("kvdepot.test_recent")
    log.addHandler(handler)
    try:
        log.info("routine")
        log.warning("a tier is slow: %s", "disk")
        log.error("gave up")
    finally:
        log.removeHandler(handler)
    assert [(e["kind"], e["message"], e["logger"]) for e in ring.latest()] == [
        ("warning", "a tier is slow: disk", "kvdepot.test_recent"),
        ("error", "gave up", "kvdepot.test_recent"),
    ]


def test_error_replies_from_the_bus_are_one_entry_per_type_and_code_per_batch():
    ring = RecentEvents()
    feed = bus_feed(ring)
    feed([RequestDone("LOOKUP", "BAD_REQUEST", 0.001), RequestDone("PING", "ok", 0.0), RequestDone("LOOKUP", "BAD_REQUEST", 0.001)])
    feed([RequestDone("COMMIT_STORE", "LEASE_EXPIRED", 0.001)])
    assert [(e["type"], e["code"], e["count"]) for e in ring.latest()] == [("LOOKUP", "BAD_REQUEST", 2), ("COMMIT_STORE", "LEASE_EXPIRED", 1)]


def _ev(kind: EventKind, key: bytes, gen: int, size: int = 100, salt: str = "", because: RemovedBecause | None = None) -> ObjectEvent:
    return ObjectEvent(kind, ObjectKey(key), gen, size, salt, because=because)


S, R = EventKind.STORED, EventKind.REMOVED


def test_l1_events_become_one_entry_per_batch_and_reason():
    ring = RecentEvents()
    listen = l1_events_to(ring)
    listen([_ev(S, b"a", 1), _ev(S, b"b", 2, size=50)])
    listen([_ev(R, b"a", 1, because=RemovedBecause.EVICTED), _ev(R, b"b", 2, size=50, because=RemovedBecause.CLEARED),
            _ev(R, b"c", 3, because=RemovedBecause.EVICTED)])  # fmt: skip
    got = [{k: v for k, v in e.items() if k not in ("seq", "t")} for e in ring.latest()]
    assert got == [
        {"kind": "l1_stored", "objects": 2, "bytes": 150},
        {"kind": "l1_removed", "because": "evicted", "objects": 2, "bytes": 200},
        {"kind": "l1_removed", "because": "cleared", "objects": 1, "bytes": 50},
    ]


def _usage(tally: TenantTally) -> dict[str, tuple[int, int]]:
    return {salt: (u.objects, u.bytes) for salt, u in tally.snapshot().items()}


def test_the_tenant_tally_follows_stores_and_removals():
    tally = TenantTally()
    tally.on_events([_ev(S, b"a", 1, 100, "t1"), _ev(S, b"b", 2, 30, "t1"), _ev(S, b"c", 3, 7)])
    assert _usage(tally) == {"t1": (2, 130), "": (1, 7)}
    tally.on_events([_ev(R, b"a", 1, 100, "t1", RemovedBecause.EVICTED), _ev(R, b"c", 3, 7, "", RemovedBecause.CLEARED)])
    assert _usage(tally) == {"t1": (1, 30)}


def test_the_tenant_tally_survives_batches_out_of_order_and_repeats():
    tally = TenantTally()
    tally.on_events([_ev(R, b"a", 5, 100, "t", RemovedBecause.EVICTED)])  # the removal overtook the store
    tally.on_events([_ev(S, b"a", 5, 100, "t")])
    assert _usage(tally) == {}
    tally.on_events([_ev(S, b"b", 6, 10, "t"), _ev(S, b"b", 6, 10, "t")])  # the same generation twice
    assert _usage(tally) == {"t": (1, 10)}
    tally.on_events([_ev(S, b"b", 8, 20, "t")])  # a newer object under the same key replaces it
    tally.on_events([_ev(R, b"b", 6, 10, "t", RemovedBecause.EVICTED)])  # the old one's late removal
    assert _usage(tally) == {"t": (1, 20)}
    tally.on_events([_ev(R, b"b", 8, 20, "t", RemovedBecause.EVICTED), _ev(R, b"zz", 9, 1, "t", RemovedBecause.EVICTED)])
    assert _usage(tally) == {}


def test_the_tenant_tally_forgets_what_l1_removed_while_the_bus_dropped_the_removal(tmp_path):
    """A server that runs for weeks: the event bus drops records under a burst, and a dropped removal
    used to leave its objects, and their tenant, in the tally (/status, /metrics) for the server's life,
    with L1 empty. After a drop the tally starts over from what L1 holds."""
    from kvdepot.config import ObservabilityConfig, StorageConfig
    from kvdepot.observability.metrics import Metrics
    from kvdepot.server.observers import Observers
    from kvdepot.storage.l1 import Toucher
    from kvdepot.storage.manager import StorageManager
    from kvdepot.types import ClientId

    storage = StorageManager(StorageConfig(l1_size_gb=1 / 1024, shm_dir=str(tmp_path), prefault=False))
    storage.start()
    obs = Observers(ObservabilityConfig(event_queue_size=4), Metrics())
    obs.attach(storage)
    try:
        owner = ClientId(b"tenant-test")
        for salt in ("gone", "kept"):
            ks = [ObjectKey(salt.encode().ljust(16, b".") + i.to_bytes(32, "big")) for i in range(2)]
            storage.commit(storage.reserve(ks, 4096, owner, salt, toucher=Toucher.CLIENT).lease_id, owner)
        obs.bus.publish(RequestDone("PING", "ok", 0.0))
        obs.bus.publish(RequestDone("PING", "ok", 0.0))  # the queue is full (the bus is not drained yet)
        doomed = [ObjectKey(b"gone".ljust(16, b".") + i.to_bytes(32, "big")) for i in range(2)]
        assert storage.delete(doomed, ClearScope.L1).l1_removed == 2  # its removal is dropped
        assert obs.bus.stats().dropped >= 1
        obs.start()
        assert obs.bus.flush()
        assert _usage(obs.tenants) == {"kept": (2, 8192)}
    finally:
        obs.close()
        storage.close()
