"""Every metric kvdepot keeps, in one registry, with every name in this file.

Counters that several threads increment (the RPC loop, the BLOCKING workers, the L2 driver) are
prometheus-client counters: thread-safe, and read without copying a dict another thread may be
changing. What is a state rather than an event count (L1 usage, leases, quarantine, the tiers and the
L2 controllers) is read from the storage snapshot when someone asks: ``/status`` and ``/metrics`` see the
same numbers. The observability work extends this module, never a second registry.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvdepot.events import L1Changed, RequestDone, TierRemoved, TierStored, TierTaskDone

REQUEST_FAILURE_CLASSES = ("lease_expired_frees", "short_retrieves")
MAX_MODELS = 64  # distinct model labels kept; clients name models, so a flood of names shares one label
# A model label nothing named for this long gives its place to a new model when all are taken (a fleet
# that rolls model versions would otherwise count every version past the 64th as "(other)" for good).
MODEL_IDLE_S = 6 * 3600.0
OTHER_MODELS = "(other)"
L1 = "l1"  # where a hit was found: L1, or the name of the L2 tier that supplied it
REQUEST_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)


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
            "kvdepot_disconnects", "Connections closed: after a goodbye, without one, or refused in the handshake.", ["kind"], registry=r
        )
        self.handshake_failures = Counter(
            "kvdepot_handshake_failures",
            "Connections that failed the security handshake: auth (a CurveZMQ key not admitted), protocol (no or wrong "
            "keys), incomplete (closed before the handshake ended: a client dying while connecting, a TCP probe).",
            ["reason"],
            registry=r,
        )
        self.clients_gone = Counter(
            "kvdepot_clients_gone", "Clients whose leases the server ended: exited (its process is gone) or revoked (went silent; may still run).",
            ["how"], registry=r,
        )
        self.leases_ended_by_client_gone = Counter(
            "kvdepot_leases_ended_client_gone", "Leases ended because their client exited or was revoked.", ["how"], registry=r
        )
        for how in ("exited", "revoked"):
            self.clients_gone.labels(how)
            self.leases_ended_by_client_gone.labels(how)
        self.engine_blocks = Counter(
            "kvdepot_engine_blocks", "KV blocks engines reported allocating and freeing.", ["event"], registry=r
        )
        # What engines got out of kvdepot, by model (a lookup asks for the tokens of its complete chunks).
        self.lookups = Counter("kvdepot_lookups", "Prompt lookups (a store's check of what is stored is none), by model.", ["model"], registry=r)
        self.requested_tokens = Counter("kvdepot_requested_tokens", "Tokens lookups asked for (complete chunks), by model.", ["model"], registry=r)
        self.hit_tokens = Counter(
            "kvdepot_hit_tokens", "Tokens lookups found, by model and where: l1, or the L2 tier that supplied them.", ["model", "tier"], registry=r
        )
        self.missed_tokens = Counter("kvdepot_missed_tokens", "Tokens lookups asked for and did not find, by model.", ["model"], registry=r)
        self.stored_chunks = Counter("kvdepot_stored_chunks", "Chunks engines stored (committed), by model.", ["model"], registry=r)
        self.stored_bytes = Counter("kvdepot_stored_bytes", "Bytes engines stored (committed), by model.", ["model"], registry=r)
        self.retrieved_chunks = Counter("kvdepot_retrieved_chunks", "Chunks engines read back, by model.", ["model"], registry=r)
        self.retrieved_bytes = Counter("kvdepot_retrieved_bytes", "Bytes engines read back, by model.", ["model"], registry=r)
        self.transfer_bytes = Counter("kvdepot_transfer_bytes", "Bytes moved by transfer path (shm, inline; cuda_ipc, host_file: the server-driven path) and direction (store, retrieve).",
                                      ["path", "direction"], registry=r)  # fmt: skip
        for path in ("shm", "inline", "cuda_ipc", "host_file"):
            for direction in ("store", "retrieve"):
                self.transfer_bytes.labels(path, direction)
        # Fed by the event bus (``subscribe_to``), off the request path.
        self.request_seconds = Histogram(
            "kvdepot_request_seconds", "Time from receipt to reply, by request type and outcome (ok or the error code).", ["type", "outcome"],
            registry=r, buckets=REQUEST_BUCKETS,
        )
        self.l1_removed = Counter("kvdepot_l1_removed_objects", "Objects that left L1, by reason (evicted, cleared, deleted, discarded, over_quota).",
                                  ["reason"], registry=r)  # fmt: skip
        self.tier_events = Counter("kvdepot_l2_object_events", "Objects an L2 tier stored or dropped through kvdepot, by tier kind and event.",
                                   ["tier", "event"], registry=r)  # fmt: skip
        self.kv_events = Counter("kvdepot_kv_events", "KV events published for routers, by event (BlockStored, BlockRemoved, AllBlocksCleared).",
                                 ["event"], registry=r)  # fmt: skip
        self.kv_event_batches = Counter("kvdepot_kv_event_batches", "KV-event batches published (one sequence number each).", registry=r)
        self.kv_event_replays = Counter("kvdepot_kv_event_replays", "Replay requests answered.", registry=r)
        self.kv_event_resets = Counter(
            "kvdepot_kv_event_resets", "Times every KV-event topic got an AllBlocksCleared because the event bus dropped records "
            "(the stream would have lost them: see --event-queue-size).", registry=r,
        )
        self.kv_event_unknown_namespace = Counter(
            "kvdepot_kv_event_unknown_namespace", "Objects left out of KV events because no context had named their namespace "
            "(the publisher keeps a bounded set, the most recently used; the bus may drop the record naming one).", registry=r,
        )
        self.tier_task_seconds = Histogram(
            "kvdepot_l2_task_seconds", "Time an L2 tier's task took against its backend, by tier, task (store, lookup, load, clear, delete) "
            "and outcome (ok, failed).", ["tier", "task", "outcome"], registry=r, buckets=REQUEST_BUCKETS,
        )
        self.silent_miss = Gauge("kvdepot_silent_miss_alarm", "1 while a model with stored objects gets lookups and no hit (see /healthcheck).",
                                 ["model"], registry=r)  # fmt: skip
        for cls in REQUEST_FAILURE_CLASSES:
            self.request_failures.labels(cls)  # present (as 0) before the first one
        # model label -> [when something last named it (monotonic)]: a cell the lookup path updates
        # without the lock (it never adds or removes a key; only the lock's holders do)
        self._models: dict[str, list[float]] = {}
        self._hit_places: dict[str, set[str]] = {}  # model label -> the places its hit_tokens series has
        self._models_lock = threading.Lock()
        # What the models whose labels went to others (``_forget_model_locked``) had counted, per counter
        # (and their hit tokens per place): /status keeps it in its totals, which never go back.
        self.forgotten: dict[Any, int] = {}
        self.forgotten_hits: dict[str, int] = {}
        # Per model, the children lookups count into: labels() costs microseconds and every lookup
        # would pay it several times. Read without the lock (a dict's get is atomic); filled and
        # emptied under it, so a forgotten model's children never stay cached.
        self._lookup_children: dict[str, tuple[Any, Any, Any]] = {}
        self._hit_children: dict[tuple[str, str], Any] = {}

    # --- what engines got (called by the handlers, any thread) ----------------------------------------

    def lookup_asked(self, model: str, tokens: int) -> None:
        lookups, requested, _ = self._lookup_counters(model)
        lookups.inc()
        requested.inc(tokens)
        seen = self._models.get(model)
        if seen is not None:
            seen[0] = time.monotonic()  # in use

    def lookup_answered(self, model: str, found: Mapping[str, int], missed: int) -> None:
        """The final count of a lookup: tokens found per place (``L1`` or a tier's name), and missed."""
        for where, tokens in found.items():
            if tokens:
                hit = self._hit_children.get((model, where))
                if hit is None:
                    with self._models_lock:
                        m = self._model_locked(model)
                        hit = self.hit_tokens.labels(m, where)
                        self._hit_places.setdefault(m, set()).add(where)
                        if len(self._hit_children) < 16 * MAX_MODELS:  # bounded, as above
                            self._hit_children[(model, where)] = hit
                hit.inc(tokens)
        self._lookup_counters(model)[2].inc(missed)

    def _lookup_counters(self, model: str) -> tuple[Any, Any, Any]:
        """(lookups, requested tokens, missed tokens) of ``model``'s label."""
        children = self._lookup_children.get(model)
        if children is None:
            with self._models_lock:
                m = self._model_locked(model)
                children = (self.lookups.labels(m), self.requested_tokens.labels(m), self.missed_tokens.labels(m))
                if len(self._lookup_children) < 4 * MAX_MODELS:  # names past the cap share "(other)": bounded
                    self._lookup_children[model] = children
        return children

    def stored(self, model: str, chunks: int, nbytes: int, path: str) -> None:
        if chunks:
            self.transfer_bytes.labels(path, "store").inc(nbytes)
            m = self._model(model)
            self.stored_chunks.labels(m).inc(chunks)
            self.stored_bytes.labels(m).inc(nbytes)

    def retrieved(self, model: str, chunks: int, nbytes: int, path: str) -> None:
        if chunks:
            self.transfer_bytes.labels(path, "retrieve").inc(nbytes)
            m = self._model(model)
            self.retrieved_chunks.labels(m).inc(chunks)
            self.retrieved_bytes.labels(m).inc(nbytes)

    def _model(self, model: str) -> str:
        with self._models_lock:
            return self._model_locked(model)

    def _model_locked(self, model: str) -> str:
        """``model``'s label: its own while there is room, or in place of the model longest unnamed once
        that one is idle past ``MODEL_IDLE_S`` (its series go), else "(other)"."""
        now = time.monotonic()
        seen = self._models.get(model)
        if seen is not None:
            seen[0] = now
            return model
        if len(self._models) >= MAX_MODELS:
            idle, oldest = min((seen[0], name) for name, seen in self._models.items())
            if now - idle < MODEL_IDLE_S:
                return OTHER_MODELS
            self._forget_model_locked(oldest)
        self._models[model] = [now]
        return model

    def _forget_model_locked(self, model: str) -> None:
        del self._models[model]
        for labels, v in labelled(self.hit_tokens):
            if labels["model"] == model:
                self.forgotten_hits[labels["tier"]] = self.forgotten_hits.get(labels["tier"], 0) + v
        for metric in (self.lookups, self.requested_tokens, self.missed_tokens, self.stored_chunks, self.stored_bytes,
                       self.retrieved_chunks, self.retrieved_bytes):  # fmt: skip
            self.forgotten[metric] = self.forgotten.get(metric, 0) + sum(v for labels, v in labelled(metric) if labels["model"] == model)
            try:
                metric.remove(model)
            except KeyError:
                pass  # that series was never made
        for where in self._hit_places.pop(model, ()):
            self.hit_tokens.remove(model, where)
        # The caches may map names past the cap to "(other)" too: emptied, they are filled again as used.
        self._lookup_children.clear()
        self._hit_children.clear()

    def labels_lock(self) -> threading.Lock:
        """Held while a model's label is given to another: read the per-model counters and ``forgotten``
        under it, so a model's counts are never seen twice or not at all."""
        return self._models_lock

    def forget_silent_miss(self, model: str) -> None:
        """The alarm no longer watches ``model`` (it made room for another): its series goes too."""
        try:
            self.silent_miss.remove(model)
        except KeyError:
            pass  # it never fired, so it has no series

    # --- what the event bus hands over (its drain thread) -----------------------------------------------

    def subscribe_to(self, bus: Any) -> None:
        """Feed the bus-driven metrics, and export the bus's own counters at each scrape."""
        bus.subscribe("metrics", self._on_events, (RequestDone, L1Changed, TierStored, TierRemoved, TierTaskDone))
        self.registry.register(_BusCollector(bus.stats))

    def _on_events(self, events: list) -> None:
        for e in events:
            if isinstance(e, RequestDone):
                self.request_seconds.labels(e.rtype, e.outcome).observe(e.duration_s)
            elif isinstance(e, L1Changed):
                for o in e.events:
                    if o.because is not None:
                        self.l1_removed.labels(o.because.value).inc()
            elif isinstance(e, TierTaskDone):
                self.tier_task_seconds.labels(e.tier, e.task, "ok" if e.ok else "failed").observe(e.seconds)
            elif isinstance(e, TierStored):
                self.tier_events.labels(e.kind, "stored").inc(len(e.keys))
            else:
                self.tier_events.labels(e.kind, e.because).inc(len(e.keys))

    def watch_tenants(self, usage: Callable[[], Mapping[str, Any]]) -> None:
        """Per-``cache_salt`` L1 use at each scrape (``usage()``: salt -> objects, bytes), the largest
        ``MAX_TENANT_LABELS`` only: salts can be per user, and a label per user would flood Prometheus."""
        self.registry.register(_TenantCollector(usage))

    def watch_storage(self, snapshot: Callable[[], object]) -> None:
        """Export the storage snapshot's states and counters at each scrape."""
        self.registry.register(_StorageCollector(snapshot))

    def text(self) -> bytes:
        """The Prometheus exposition of everything."""
        return generate_latest(self.registry)


def labelled(counter: Counter) -> list[tuple[dict[str, str], int]]:
    """Every (labels, value) of a counter."""
    return [
        (dict(sample.labels), int(sample.value))
        for family in counter.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    ]


def counts(counter: Counter) -> dict[str, int]:
    """A labelled counter's current values by its (single) label, or ``{"": value}`` unlabelled."""
    out: dict[str, int] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = next(iter(sample.labels.values()), "") if sample.labels else ""
                out[key] = int(sample.value)
    return out


# (metric name, help, field of the storage snapshot's part): every name exported from the snapshot.
_L1_GAUGES = (
    ("kvdepot_l1_capacity_bytes", "L1 arena capacity.", "capacity_bytes"),
    ("kvdepot_l1_used_bytes", "L1 bytes allocated (objects and quarantined extents).", "used_bytes"),
    ("kvdepot_l1_objects", "Objects in L1.", "objects"),
    ("kvdepot_l1_read_locked_objects", "L1 objects with at least one reader.", "read_locked"),
    ("kvdepot_l1_leases", "Active leases.", "leases"),
    ("kvdepot_l1_quarantined_leases", "Leases ended while their toucher may still run.", "quarantined_leases"),
    ("kvdepot_l1_quarantined_bytes", "Arena bytes held back from reuse by quarantine.", "quarantined_bytes"),
    ("kvdepot_l1_fragmentation", "1 - largest free extent / free bytes.", "fragmentation"),
    ("kvdepot_l1_awaiting_l2_objects", "L1 objects not yet taken by the L2 push (evicted last).", "awaiting_l2"),
)
_L1_COUNTERS = (
    ("kvdepot_l1_evicted_objects", "Objects evicted from L1.", "evicted_objects"),
    ("kvdepot_l1_expired_leases", "Leases ended by their TTL.", "expired_leases"),
    ("kvdepot_l1_quota_refused", "Chunks refused because their salt's quota is below one chunk.", "quota_refused"),
    ("kvdepot_l1_evicted_awaiting_l2", "Objects evicted before their L2 push took them (lost to L2).", "evicted_awaiting_l2"),
)
_STORE_GAUGES = (
    ("kvdepot_l2_store_queued", "Objects waiting for the L2 push.", "queued"),
    ("kvdepot_l2_store_in_flight", "Store batches being written to the tiers.", "in_flight"),
)
_STORE_COUNTERS = (
    ("kvdepot_l2_store_submitted", "Objects handed to the tiers.", "submitted"),
    ("kvdepot_l2_store_stored", "Object writes the tiers acknowledged (one per tier).", "stored"),
    ("kvdepot_l2_store_failed", "Object writes the tiers failed (one per tier).", "failed"),
    ("kvdepot_l2_store_dropped", "Objects not pushed because the queue was full.", "dropped"),
    ("kvdepot_l2_store_skipped_gone", "Objects that left L1 before their push.", "skipped_gone"),
)
_PREFETCH_GAUGES = (("kvdepot_l2_prefetch_running", "Prefetch jobs running.", "running"),)
_PREFETCH_COUNTERS = (
    ("kvdepot_l2_prefetch_jobs", "Prefetch jobs started (LOOKUP misses asked of L2).", "jobs"),
    ("kvdepot_l2_prefetch_lookups_hit", "Tier lookups that found chunks to load.", "lookups_hit"),
    ("kvdepot_l2_prefetch_chunks_loaded", "Chunks loaded from L2 into L1.", "chunks_loaded"),
    ("kvdepot_l2_prefetch_chunks_failed", "Chunks whose load from L2 failed (a miss).", "chunks_failed"),
)


class _StorageCollector:
    """Reads the storage snapshot (``kvdepot.storage.manager.StorageSnapshot``, read by attribute: this
    module imports nothing of storage's) when the registry is collected."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable:
        return []  # collected lazily: nothing to describe up front

    def collect(self) -> Iterable:
        s = self._snapshot()
        parts = [(s.l1, _L1_GAUGES, _L1_COUNTERS), (s.store, _STORE_GAUGES, _STORE_COUNTERS), (s.prefetch, _PREFETCH_GAUGES, _PREFETCH_COUNTERS)]
        for part, gauges, counters in parts:
            if part is None:  # no L2 tiers: no L2 controllers
                continue
            for name, doc, field in gauges:
                yield GaugeMetricFamily(name, doc, value=getattr(part, field))
            for name, doc, field in counters:
                yield CounterMetricFamily(name, doc, value=getattr(part, field))
        yield from _tier_metrics(s.tiers)


MAX_TENANT_LABELS = 32


class _TenantCollector:
    def __init__(self, usage: Callable[[], Mapping[str, Any]]) -> None:
        self._usage = usage

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        used = GaugeMetricFamily("kvdepot_tenant_used_bytes", f"L1 bytes per cache_salt (the {MAX_TENANT_LABELS} largest; '' is none).",
                                 labels=["cache_salt"])  # fmt: skip
        objects = GaugeMetricFamily("kvdepot_tenant_objects", f"L1 objects per cache_salt (the {MAX_TENANT_LABELS} largest).", labels=["cache_salt"])
        top = sorted(self._usage().items(), key=lambda kv: -kv[1].bytes)[:MAX_TENANT_LABELS]
        for salt, u in top:
            used.add_metric([salt], u.bytes)
            objects.add_metric([salt], u.objects)
        yield used
        yield objects


class _BusCollector:
    """The event bus's own counters (``observability.bus.BusStats``, read by attribute)."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        s = self._stats()
        yield GaugeMetricFamily("kvdepot_event_queue_capacity", "Events the bus's queue holds (0: the bus is off).", value=s.capacity)
        yield GaugeMetricFamily("kvdepot_event_queue_depth", "Events waiting for the bus's drain thread.", value=s.depth)
        yield CounterMetricFamily("kvdepot_events_published", "Events accepted by the bus.", value=s.published)
        yield CounterMetricFamily("kvdepot_events_dropped", "Events dropped because the bus's queue was full.", value=s.dropped)
        errors = CounterMetricFamily("kvdepot_event_handler_errors", "Bus subscribers that raised, by concern.", labels=["concern"])
        for concern, n in s.handler_errors.items():
            errors.add_metric([concern], n)
        yield errors


def _tier_metrics(tiers: Iterable[Any]) -> Iterable:
    healthy = GaugeMetricFamily("kvdepot_l2_healthy", "1 while an L2 tier serves.", labels=["tier", "kind"])
    used = GaugeMetricFamily("kvdepot_l2_used_bytes", "Bytes an L2 tier holds.", labels=["tier"])
    objects = GaugeMetricFamily("kvdepot_l2_objects", "Objects an L2 tier holds.", labels=["tier"])
    stored = CounterMetricFamily("kvdepot_l2_stored", "Objects an L2 tier stored (its own count).", labels=["tier"])
    loaded = CounterMetricFamily("kvdepot_l2_loaded", "Objects an L2 tier loaded and verified.", labels=["tier"])
    corrupt = CounterMetricFamily("kvdepot_l2_corrupt", "Objects an L2 tier found corrupt (deleted; a miss).", labels=["tier"])
    failures = CounterMetricFamily("kvdepot_l2_failures", "Backend failures of an L2 tier.", labels=["tier"])
    newer = CounterMetricFamily("kvdepot_l2_newer_format", "Loads of objects in a newer kvdepot's format (a miss, left in place).", labels=["tier"])
    for t in tiers:
        healthy.add_metric([t.name, t.kind], 1.0 if t.healthy else 0.0)
        used.add_metric([t.name], t.used_bytes)
        objects.add_metric([t.name], t.objects)
        stored.add_metric([t.name], t.stored)
        loaded.add_metric([t.name], t.loaded)
        corrupt.add_metric([t.name], t.corrupt)
        failures.add_metric([t.name], t.failures)
        newer.add_metric([t.name], t.newer_format)
    return (healthy, used, objects, stored, loaded, corrupt, failures, newer)


# --- the peer tier: one node's metrics (its own registry: a node runs in processes without a server) -----

LATENCY_WINDOW = 2048  # the latest operations the p50/p90/p99 are computed over
_PEER_STATE_GAUGES = (
    ("kvdepot_peer_pool_used_bytes", "Published pool bytes in use (pages and quarantined ranges).", "pool_used_bytes"),
    ("kvdepot_peer_pool_capacity_bytes", "Published pool capacity.", "pool_capacity_bytes"),
    ("kvdepot_peer_pool_pages", "Pages in the published pool.", "pool_pages"),
    ("kvdepot_peer_disk_used_bytes", "Disk tier bytes (0 without one).", "disk_used_bytes"),
    ("kvdepot_peer_disk_pages", "Pages on the disk tier.", "disk_pages"),
    ("kvdepot_peer_members", "Members of the cluster as this node sees it.", "members"),
    ("kvdepot_peer_directory_records", "Records in this node's directory shard.", "directory_records"),
    ("kvdepot_peer_publish_owed", "Keys whose location record some owner missed (a failed or skipped publish), "
     "to be sent again on the next heartbeat.", "publish_owed"),
    ("kvdepot_peer_unpublish_owed", "Removals of location records some owner missed (an evicted or deleted page), "
     "to be sent again on the next heartbeat.", "unpublish_owed"),
)
_PEER_STATE_COUNTERS = (
    ("kvdepot_peer_evictions", "Pages evicted from the published pool.", "evictions"),
    ("kvdepot_peer_promotes", "Pages promoted from disk into the pool.", "promotes"),
    ("kvdepot_peer_served_pages", "Pages this node's data plane sent to readers.", "served_pages"),
    ("kvdepot_peer_served_bytes", "Bytes this node's data plane sent to readers.", "served_bytes"),
    ("kvdepot_peer_refused_connections", "Data-plane connections refused (no cluster secret).", "refused"),
    ("kvdepot_peer_dropped_connections", "Data-plane connections this node closed after a failed read.", "dropped"),
    ("kvdepot_peer_publish_repaid", "Location records sent again after some owner missed them.", "publish_repaid"),
    ("kvdepot_peer_unpublish_dropped", "Owed removals given up past the bound (the owner keeps a stale record until the "
     "page's key is written again or the node leaves: a reader's wasted round trip, never wrong bytes).", "unpublish_dropped"),
)


class PeerMetrics:
    """A peer node's counters, latencies and (at each scrape) states; ``text`` is /metrics, ``summary``
    what the node's HTML page shows. Counters are incremented by the node's threads."""

    def __init__(self, state: Callable[[], Mapping[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reads = Counter("kvdepot_peer_reads", "Pages asked to be read, by outcome (hit, miss, corrupt).", ["outcome"], registry=r)
        self.read_bytes = Counter("kvdepot_peer_read_bytes", "Bytes read into callers' buffers (hits).", registry=r)
        self.writes = Counter("kvdepot_peer_writes", "Pages set, by outcome (stored, refused).", ["outcome"], registry=r)
        self.write_bytes = Counter("kvdepot_peer_write_bytes", "Bytes copied into the pool.", registry=r)
        self.lookups = Counter("kvdepot_peer_lookups", "Keys looked up in the directory, by result (found, missing).", ["result"], registry=r)
        self.decisions = Counter("kvdepot_peer_pull_decisions", "Pull-or-recompute decisions, by decision and reason.", ["decision", "reason"],
                                 registry=r)  # fmt: skip
        self.remembered_locations = Counter("kvdepot_peer_remembered_locations",
                                            "Keys read from where this node found them shortly before, without a directory lookup.",
                                            registry=r)  # fmt: skip
        self.local_lookups = Counter("kvdepot_peer_local_lookups",
                                     "Keys found in this node's own directory shard (it is one of their owners): no round trip.",
                                     registry=r)  # fmt: skip
        self.relookups = Counter("kvdepot_peer_relookups", "Located pages their owner no longer served (evicted, rewritten or promoted "
                                 "meanwhile, or a remembered location gone stale): looked up again.", registry=r)  # fmt: skip
        self.hints = Counter("kvdepot_peer_hints", "Pages asked of a router's hinted node, by result (found, missing).", ["result"], registry=r)
        self.read_seconds = Histogram("kvdepot_peer_read_seconds", "One batched read (lookup excluded).", registry=r,
                                      buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))  # fmt: skip
        self.write_seconds = Histogram("kvdepot_peer_write_seconds", "One batched set (copy and publish).", registry=r,
                                       buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2))  # fmt: skip
        for outcome in ("hit", "miss", "corrupt"):
            self.reads.labels(outcome)
        for outcome in ("stored", "refused"):
            self.writes.labels(outcome)
        for result in ("found", "missing"):
            self.lookups.labels(result)
        self._windows = {"read": deque(maxlen=LATENCY_WINDOW), "write": deque(maxlen=LATENCY_WINDOW)}
        self._state = state
        r.register(_PeerStateCollector(self))

    def read_done(self, seconds: float, hits: int, misses: int, corrupt: int, nbytes: int) -> None:
        self.reads.labels("hit").inc(hits)
        self.reads.labels("miss").inc(misses)
        if corrupt:
            self.reads.labels("corrupt").inc(corrupt)
        self.read_bytes.inc(nbytes)
        self.read_seconds.observe(seconds)
        self._windows["read"].append(seconds)

    def write_done(self, seconds: float, stored: int, refused: int, nbytes: int) -> None:
        self.writes.labels("stored").inc(stored)
        if refused:
            self.writes.labels("refused").inc(refused)
        self.write_bytes.inc(nbytes)
        self.write_seconds.observe(seconds)
        self._windows["write"].append(seconds)

    def decided(self, pull: bool, reason: str) -> None:
        self.decisions.labels("pull" if pull else "recompute", reason).inc()

    def hinted(self, found: int, missing: int) -> None:
        self.hints.labels("found").inc(found)
        self.hints.labels("missing").inc(missing)

    def remembered(self, n: int) -> None:
        self.remembered_locations.inc(n)

    def directory_local(self, n: int) -> None:
        self.local_lookups.inc(n)

    def stale(self, n: int) -> None:
        self.relookups.inc(n)

    def looked_up(self, found: int, missing: int) -> None:
        self.lookups.labels("found").inc(found)
        self.lookups.labels("missing").inc(missing)

    def quantiles(self, op: str) -> dict[str, float]:
        """p50/p90/p99 and the mean (seconds) of the latest ``LATENCY_WINDOW`` operations of ``op``."""
        values = sorted(self._windows[op])
        if not values:
            return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "avg": 0.0, "n": 0}
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "avg": sum(values) / len(values), "n": len(values)}

    def summary(self) -> dict[str, Any]:
        reads = counts(self.reads)
        asked = sum(reads.values())
        return {
            "state": dict(self._state()),
            "reads": reads,
            "read_hit_rate": reads.get("hit", 0) / asked if asked else 0.0,
            "read_bytes": counts(self.read_bytes).get("", 0),
            "writes": counts(self.writes),
            "write_bytes": counts(self.write_bytes).get("", 0),
            "lookups": counts(self.lookups),
            "pull_decisions": {f"{d['decision']}/{d['reason']}": v for d, v in labelled(self.decisions)},
            "hints": counts(self.hints),
            "remembered_locations": counts(self.remembered_locations).get("", 0),
            "local_lookups": counts(self.local_lookups).get("", 0),
            "relookups": counts(self.relookups).get("", 0),
            "read_latency_s": self.quantiles("read"),
            "write_latency_s": self.quantiles("write"),
        }

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _PeerStateCollector:
    def __init__(self, metrics: PeerMetrics) -> None:
        self._m = metrics

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        state = self._m._state()
        for name, doc, field in _PEER_STATE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=state.get(field, 0))
        for name, doc, field in _PEER_STATE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=state.get(field, 0))
        for op in ("read", "write"):
            q = GaugeMetricFamily(f"kvdepot_peer_{op}_latency_seconds", f"{op.title()} latency over the latest {LATENCY_WINDOW} operations.",
                                  labels=["quantile"])  # fmt: skip
            for label, value in self._m.quantiles(op).items():
                if label.startswith("p"):
                    q.add_metric([f"0.{label[1:]}"], value)
            yield q
