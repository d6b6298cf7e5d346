"""The ``/status`` document (and ``kvdepot status``): storage's snapshot, the clients and the counters.

Built on the HTTP thread from things safe to read there: the storage snapshot (its own locks), the
liveness tracker's published snapshot, and the metric registry. The keys are the public contract in
ARCHITECTURE §10 plus what README's HTTP API section lists.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict

from kvdepot import __version__
from kvdepot.config import ServerConfig
from kvdepot.observability.metrics import Metrics, counts, labelled
from kvdepot.observability.tenants import TenantUsage
from kvdepot.server.liveness import LivenessSnapshot
from kvdepot.storage.manager import StorageHealth, StorageSnapshot


def status_document(
    config: ServerConfig,
    snap: StorageSnapshot,
    clients: LivenessSnapshot,
    metrics: Metrics,
    contexts: int,
    sessions: int,
    tenants: list[dict] | None = None,
    plugins: list[dict] | None = None,
    gpu: dict | None = None,
) -> dict:
    l1, pf = snap.l1, snap.prefault
    errors = {k: v for k, v in counts(metrics.errors).items() if v}
    failures = counts(metrics.request_failures)
    blocks = counts(metrics.engine_blocks)
    return {
        "version": __version__,
        "chunk_size": config.storage.chunk_size,
        "hash_algorithm": config.storage.hash_algorithm.value,
        "endpoints": config.rpc.endpoints,
        "l1": {
            "capacity_bytes": l1.capacity_bytes,
            "used_bytes": l1.used_bytes,
            "objects": l1.objects,
            "ready": l1.ready,
            "writing": l1.writing,
            "read_locked": l1.read_locked,
            "fragmentation": round(l1.fragmentation, 4),
            "largest_free_bytes": l1.largest_free_bytes,
            "evicted_objects": l1.evicted_objects,
            "quota_refused": l1.quota_refused,
            "awaiting_l2": l1.awaiting_l2,
            "evicted_awaiting_l2": l1.evicted_awaiting_l2,
            "eviction_policy": snap.eviction_policy.value,
            "shm_path": snap.shm_path,
            "prefault": {
                "state": pf.state,
                "progress": round(pf.progress, 4),
                "finished": pf.finished,
                "supported": pf.supported,
                "error": pf.error,
            },
        },
        "quarantine": quarantine_document(snap, clients),
        "leases": l1.leases,
        "expired_leases": l1.expired_leases,
        "contexts": contexts,
        "sessions": sessions,
        "clients": clients.active,
        "clients_gone": {how: int(n) for how, n in counts(metrics.clients_gone).items()},  # exited, revoked (went silent)
        "requests": {k: v for k, v in counts(metrics.requests).items() if v},
        "errors": errors,
        "request_failures": {
            # Per-request problems by class: each made one request recompute what it lacked, and
            # none stops anyone from caching (transport failures never reach the server).
            "lease_expired": errors.get("LEASE_EXPIRED", 0) + failures.get("lease_expired_frees", 0),
            "lease_revoked": errors.get("LEASE_REVOKED", 0),
            "short_retrieves": failures.get("short_retrieves", 0),
            "sessions_expired": failures.get("sessions_expired", 0),  # lookups nobody ended (their lock ended)
            "over_quota": l1.quota_refused,
            "lost_before_l2": l1.evicted_awaiting_l2,
            "corrupt_in_l2": sum(t.corrupt for t in snap.tiers),
        },
        "lookups": lookups_document(metrics),
        "stores": transfers_document(metrics.stored_chunks, metrics.stored_bytes, metrics),
        "retrieves": transfers_document(metrics.retrieved_chunks, metrics.retrieved_bytes, metrics),
        "block_events": {"allocated": blocks.get("allocated", 0), "freed": blocks.get("freed", 0)},
        "tiers": [asdict(t) for t in snap.tiers],
        "tenants": tenants or [],
        "l2_controllers": {"store": asdict(snap.store), "prefetch": asdict(snap.prefetch)} if snap.store and snap.prefetch else {},
        "plugins": plugins or [],  # name, module, state, pid, restarts, last_exit_code, restart_delays_s
        # the server-driven path: transfer, devices, host_files, arena_pinned, caches (id, context, path, state, ...)
        "gpu": gpu or {},
    }


def lookups_document(metrics: Metrics) -> dict:
    """What engines asked for and found, in tokens, in all and per model (hits also per place: ``l1``
    or the L2 tier that supplied them). A lookup still prefetching from L2 counts as asked, not yet as
    found or missed. The totals include models whose labels went to others (their series are gone), so
    they never go back."""
    with metrics.labels_lock():
        return _lookups_document(metrics)


def _lookups_document(metrics: Metrics) -> dict:
    models: dict[str, dict] = {}

    def model(name: str) -> dict:
        return models.setdefault(
            name, {"requests": 0, "requested_tokens": 0, "hit_tokens": 0, "missed_tokens": 0, "hit_tokens_by_tier": {}}
        )

    for labels, v in labelled(metrics.lookups):
        model(labels["model"])["requests"] += v
    for labels, v in labelled(metrics.requested_tokens):
        model(labels["model"])["requested_tokens"] += v
    for labels, v in labelled(metrics.missed_tokens):
        model(labels["model"])["missed_tokens"] += v
    for labels, v in labelled(metrics.hit_tokens):
        m = model(labels["model"])
        m["hit_tokens"] += v
        m["hit_tokens_by_tier"][labels["tier"]] = m["hit_tokens_by_tier"].get(labels["tier"], 0) + v
    total = {k: sum(m[k] for m in models.values()) for k in ("requests", "requested_tokens", "hit_tokens", "missed_tokens")}
    for k, counter in (("requests", metrics.lookups), ("requested_tokens", metrics.requested_tokens), ("missed_tokens", metrics.missed_tokens)):
        total[k] += metrics.forgotten.get(counter, 0)
    total["hit_tokens"] += sum(metrics.forgotten_hits.values())
    by_tier: dict[str, int] = dict(metrics.forgotten_hits)
    for m in models.values():
        for tier, v in m["hit_tokens_by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + v
    answered = total["hit_tokens"] + total["missed_tokens"]
    return {
        **total,
        "hit_rate": round(total["hit_tokens"] / answered, 4) if answered else 0.0,
        "hit_tokens_by_tier": by_tier,
        "by_model": models,
    }


def transfers_document(chunks, nbytes, metrics: Metrics | None = None) -> dict:
    """Chunks and bytes, in all and per model; the totals include models whose labels went to others."""
    by_model: dict[str, dict] = {}
    forgotten = (0, 0)
    with metrics.labels_lock() if metrics is not None else contextlib.nullcontext():
        for labels, v in labelled(chunks):
            by_model.setdefault(labels["model"], {"chunks": 0, "bytes": 0})["chunks"] += v
        for labels, v in labelled(nbytes):
            by_model.setdefault(labels["model"], {"chunks": 0, "bytes": 0})["bytes"] += v
        if metrics is not None:
            forgotten = (metrics.forgotten.get(chunks, 0), metrics.forgotten.get(nbytes, 0))
    return {
        "chunks": sum(m["chunks"] for m in by_model.values()) + forgotten[0],
        "bytes": sum(m["bytes"] for m in by_model.values()) + forgotten[1],
        "by_model": by_model,
    }


DEFAULT_SALT_NAME = "__default__"  # as the /quota endpoints name the salt-less tenant
MAX_TENANTS_SHOWN = 64


def tenants_document(usage: dict[str, TenantUsage], quotas: dict[str, int]) -> list[dict]:
    """Each ``cache_salt`` that holds L1 objects or has a quota: what it holds, and its quota (None: none),
    the largest first (at most ``MAX_TENANTS_SHOWN``)."""
    salts = set(usage) | set(quotas)
    rows = [
        {
            "cache_salt": salt or DEFAULT_SALT_NAME,
            "objects": usage[salt].objects if salt in usage else 0,
            "used_bytes": usage[salt].bytes if salt in usage else 0,
            "quota_bytes": quotas.get(salt),
        }
        for salt in salts
    ]
    rows.sort(key=lambda r: (-r["used_bytes"], r["cache_salt"]))
    return rows[:MAX_TENANTS_SHOWN]


def quarantine_document(snap: StorageSnapshot, clients: LivenessSnapshot) -> dict:
    """Arena space held back because a client that was given it may still be running."""
    out = []
    for q in snap.quarantine:
        view = clients.clients.get(q.owner)
        out.append(
            {
                "client": q.owner.hex()[:12],
                "pid": view.pid if view is not None else 0,
                "hostname": view.hostname if view is not None else "",
                "state": view.state.value if view is not None else "server",
                "leases": q.leases,
                "bytes": q.bytes,
                "since": q.since,
                "why": q.why,
            }
        )
    return {"leases": snap.l1.quarantined_leases, "bytes": snap.l1.quarantined_bytes, "clients": out}


def degraded_reasons(health: StorageHealth) -> list[str]:
    """Why the server serves less than it was configured to (empty: it serves everything)."""
    reasons = [f"L2 tier {t.name} ({t.kind}) is down: {t.last_error or 'unknown error'}" for t in health.tiers if not t.healthy]
    if health.prefault.state == "failed":
        reasons.append(f"the L1 prefault failed: {health.prefault.error}")
    return reasons
