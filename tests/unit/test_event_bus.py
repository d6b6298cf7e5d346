"""The event bus: publishing never waits, a full queue drops and counts, subscribers get their types in
order, a failing subscriber is counted and harms no other, and close hands out what was queued."""

from __future__ import annotations

import threading

import pytest

from kvdepot.events import ChunkRequestDone, RequestDone
from kvdepot.observability.bus import BusState, EventBus
from kvdepot.observability.metrics import Metrics


def test_subscribers_get_only_their_types_in_publish_order():
    bus = EventBus(1000)
    requests, everything = [], []
    bus.subscribe("requests", requests.extend, (RequestDone,))
    bus.subscribe("all", everything.extend, (object,))
    bus.start()
    events = [RequestDone("PING", "ok", i / 1000) for i in range(50)] + [ChunkRequestDone("lookup", 0, 0, "m", "", (), 16, 1, 0, "ok")]
    for e in events:
        bus.publish(e)
    assert bus.flush()
    bus.close()
    assert requests == events[:50]
    assert everything == events
    assert bus.stats().published == 51 and bus.stats().dropped == 0


def test_a_flood_against_a_stuck_subscriber_drops_and_counts_and_never_blocks_the_publisher():
    bus = EventBus(100)
    release, returned = threading.Event(), threading.Event()
    got = []

    def stuck(events):
        release.wait(60)
        got.extend(events)
        returned.set()

    bus.subscribe("stuck", stuck, (RequestDone,))
    bus.start()
    flood = 20_000
    for i in range(flood):
        bus.publish(RequestDone("PING", "ok", float(i)))
    stats = bus.stats()
    # The publisher went through the whole flood while the subscriber was stuck: it never waited on it.
    assert not returned.is_set()
    assert stats.dropped >= flood - 2 * bus.capacity - 1  # at most a queue's worth (plus one batch in hand) got through
    assert stats.published + stats.dropped == flood
    assert stats.depth <= bus.capacity
    release.set()
    assert bus.flush()
    bus.close()
    assert len(got) == stats.published  # what was accepted was delivered, in order
    assert [e.duration_s for e in got] == sorted(e.duration_s for e in got)


def test_a_failing_subscriber_is_counted_and_the_others_still_get_everything():
    bus = EventBus(100)
    good = []

    def broken(events):
        raise RuntimeError("a bug in one concern")

    bus.subscribe("broken", broken, (RequestDone,))
    bus.subscribe("good", good.extend, (RequestDone,))
    bus.start()
    for i in range(10):
        bus.publish(RequestDone("PING", "ok", 0.0))
        assert bus.flush()
    bus.close()
    assert len(good) == 10
    assert bus.stats().handler_errors["broken"] == 10 and bus.stats().handler_errors["good"] == 0


def test_close_hands_out_what_was_queued_then_ignores_publishes():
    bus = EventBus(1000)
    got = []
    bus.subscribe("c", got.extend, (RequestDone,))
    bus.start()
    for _ in range(100):
        bus.publish(RequestDone("PING", "ok", 0.0))
    bus.close()
    assert len(got) == 100 and bus.state is BusState.CLOSED
    bus.publish(RequestDone("PING", "ok", 0.0))
    assert bus.stats().published == 100


def test_the_state_machine_refuses_what_it_does_not_allow():
    bus = EventBus(10)
    bus.start()
    with pytest.raises(RuntimeError):
        bus.subscribe("late", lambda e: None, (object,))
    with pytest.raises(RuntimeError):
        bus.start()
    bus.close()
    bus.close()  # idempotent
    with pytest.raises(ValueError):
        EventBus(-1)


def test_a_bus_of_capacity_zero_is_off():
    bus = EventBus(0)
    got = []
    bus.subscribe("c", got.extend, (RequestDone,))
    bus.start()
    bus.publish(RequestDone("PING", "ok", 0.0))
    assert not bus.enabled and not bus.wants(RequestDone)
    bus.close()
    assert got == [] and bus.stats().published == 0


def test_metrics_export_the_bus_counters_and_request_latency():
    bus = EventBus(4)
    metrics = Metrics()
    metrics.subscribe_to(bus)
    release = threading.Event()
    bus.subscribe("stuck", lambda e: release.wait(10), (RequestDone,))
    bus.start()
    for _ in range(100):
        bus.publish(RequestDone("LOOKUP", "BAD_REQUEST", 0.002))
    text = metrics.text().decode()
    release.set()
    bus.flush()
    bus.close()
    dropped = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvdepot_events_dropped_total"))
    assert dropped >= 90
    after = metrics.text().decode()
    count = next(float(line.split()[-1]) for line in after.splitlines()
                 if line.startswith('kvdepot_request_seconds_count{outcome="BAD_REQUEST",type="LOOKUP"}'))  # fmt: skip
    assert 1 <= count <= 10
