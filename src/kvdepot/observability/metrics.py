"""Every metric kvdepot keeps, in one registry, with every name in this file.

Counters that several threads increment (the RPC loop, the BLOCKING workers, the L2 driver) are
prometheus-client counters: thread-safe, and read without copying a dict another thread may be
changing. What is a state rather than an event count (L1 usage, leases, quarantine, the tiers and the
L2 controllers) is read from the storage snapshot when someone asks: ``/status`` and ``/metrics`` see the
same numbers. The observability work extends this module, never a second registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REQUEST_FAILURE_CLASSES = ("lease_expired_frees", "short_retrieves")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kvdepot_requests", "Requests handled, by request type.", ["type"], registry=r)
        self.errors = Counter("kvdepot_error_replies", "Error replies sent, by error code.", ["code"], registry=r)
        self.request_failures = Counter(
            "kvdepot_request_failures",
            "Per-request problems the server absorbed (each one request's miss), by class.",
            ["class"],
            registry=r,
        )
        self.dropped_frames = Counter("kvdepot_dropped_messages", "Messages too malformed to answer by request id.", registry=r)
        self.disconnects = Counter(
            "kvdepot_disconnects", "Connections closed: after a goodbye, or without one.", ["kind"], registry=r
        )
        self.engine_blocks = Counter(
            "kvdepot_engine_blocks", "KV blocks engines reported allocating and freeing.", ["event"], registry=r
        )
        for cls in REQUEST_FAILURE_CLASSES:
            self.request_failures.labels(cls)  # present (as 0) before the first one

    def watch_storage(self, snapshot: Callable[[], object]) -> None:
        """Export the storage snapshot's states and counters at each scrape."""
        self.registry.register(_StorageCollector(snapshot))

    def text(self) -> bytes:
        """The Prometheus exposition of everything."""
        return generate_latest(self.registry)


def counts(counter: Counter) -> dict[str, int]:
    """A labelled counter's current values by its (single) label, or ``{"": value}`` unlabelled."""
    out: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = next(iter(sample.labels.values()), "") if sample.labels else ""
                out[key] = int(sample.value)
    return out


class _StorageCollector:
    """Reads a StorageSnapshot when the registry is collected (duck-typed: no storage import here)."""

    def __init__(self, snapshot: Callable[[], object]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable:
        return []  # collected lazily: nothing to describe up front

    def collect(self) -> Iterable:
        s = self._snapshot()
        l1 = s.l1
        gauges = {
            "kvdepot_l1_capacity_bytes": ("L1 arena capacity.", l1.capacity_bytes),
            "kvdepot_l1_used_bytes": ("L1 bytes allocated (objects and quarantined extents).", l1.used_bytes),
            "kvdepot_l1_objects": ("Objects in L1.", l1.objects),
            "kvdepot_l1_read_locked_objects": ("L1 objects with at least one reader.", l1.read_locked),
            "kvdepot_l1_leases": ("Active leases.", l1.leases),
            "kvdepot_l1_quarantined_leases": ("Leases ended while their toucher may still run.", l1.quarantined_leases),
            "kvdepot_l1_quarantined_bytes": ("Arena bytes held back from reuse by quarantine.", l1.quarantined_bytes),
            "kvdepot_l1_fragmentation": ("1 - largest free extent / free bytes.", l1.fragmentation),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in (
            ("kvdepot_l1_evicted_objects", "Objects evicted from L1.", l1.evicted_objects),
            ("kvdepot_l1_expired_leases", "Leases ended by their TTL.", l1.expired_leases),
            ("kvdepot_l1_quota_refused", "Chunks refused because their salt's quota is below one chunk.", l1.quota_refused),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        healthy = GaugeMetricFamily("kvdepot_l2_healthy", "1 while an L2 tier serves.", labels=["tier", "kind"])
        tier_counts = {
            n: CounterMetricFamily(f"kvdepot_l2_{n}", f"Objects an L2 tier {n} (its own count).", labels=["tier"])
            for n in ("stored", "loaded", "corrupt", "failures")
        }
        for t in s.tiers:
            healthy.add_metric([t["name"], t["kind"]], 1.0 if t["healthy"] else 0.0)
            for n, family in tier_counts.items():
                family.add_metric([t["name"]], t[n])
        yield healthy
        yield from tier_counts.values()
        for controller, stats in s.controllers.items():
            for field, value in stats.items():
                yield GaugeMetricFamily(f"kvdepot_l2_{controller}_{field}", f"L2 {controller} controller: {field}.", value=value)
