"""Metrics move as a workload runs: a scrape before and after a known workload, and the deltas are what
the workload did (bytes per transfer path, latency observations per request type, removals by reason,
per-tenant use, each tier's task latency), and the lookup log has one exact line per engine lookup."""

from __future__ import annotations

import json

from support.servers import CHUNK, LAYOUT, make_kv, make_tokens, wait_until


def test_a_workload_moves_each_metric_by_what_it_did(make_server, tmp_path, seed):
    log = tmp_path / "lookups.jsonl"
    server = make_server("--lookup-log", str(log), "--l2", "memory:name=mem,size_gb=0.01")
    chunk_bytes = LAYOUT.chunk_bytes(CHUNK)
    m = server.metric
    before = {
        (path, d): m("kvdepot_transfer_bytes_total", path=path, direction=d) for path in ("shm", "inline") for d in ("store", "retrieve")
    }
    lookups_before = m("kvdepot_request_seconds_count", type="LOOKUP", outcome="ok")
    cleared_before = m("kvdepot_l1_removed_objects_total", reason="cleared")

    shm_tokens, inline_tokens = make_tokens(3 * CHUNK, seed), make_tokens(2 * CHUNK, seed + 1)
    with server.client(server.ipc_url, transport="shm") as shm, server.client(server.url, transport="inline") as inline:
        assert shm.transport == "shm" and inline.transport == "inline"
        assert shm.store(shm_tokens, make_kv(LAYOUT, len(shm_tokens), seed), cache_salt="tenant-a") == 3 * CHUNK
        assert inline.store(inline_tokens, make_kv(LAYOUT, len(inline_tokens), seed + 1)) == 2 * CHUNK
        assert shm.retrieve(shm_tokens, cache_salt="tenant-a").shape[2] == 3 * CHUNK
        assert inline.retrieve(inline_tokens).shape[2] == 2 * CHUNK
        assert shm.lookup(shm_tokens, cache_salt="tenant-a") == 3 * CHUNK  # a full hit
        assert inline.lookup(make_tokens(4 * CHUNK, seed + 2)) == 0  # a miss
        # The per-tenant tally follows L1 through the event bus: the two stores may be drained in two ticks.
        wait_until(lambda: m("kvdepot_tenant_objects", cache_salt="tenant-a") == 3 and m("kvdepot_tenant_objects", cache_salt="") == 2,
                   what="tenant-a's and the salt-less tenant's objects in /metrics")  # fmt: skip
        assert m("kvdepot_tenant_used_bytes", cache_salt="tenant-a") == 3 * chunk_bytes
        assert m("kvdepot_tenant_objects", cache_salt="") == 2

    moved = {k: m("kvdepot_transfer_bytes_total", path=k[0], direction=k[1]) - v for k, v in before.items()}
    assert moved == {
        ("shm", "store"): 3 * chunk_bytes, ("shm", "retrieve"): 3 * chunk_bytes,
        ("inline", "store"): 2 * chunk_bytes, ("inline", "retrieve"): 2 * chunk_bytes,
    }  # fmt: skip
    # Each client's store and retrieve look up first (probes, not counted as engine lookups, but answered
    # LOOKUP requests all the same), then the two engine lookups: the histogram saw every one.
    wait_until(lambda: m("kvdepot_request_seconds_count", type="LOOKUP", outcome="ok") - lookups_before >= 2, what="LOOKUP latencies")
    # The tier's writes were timed, each one's outcome named.
    wait_until(lambda: m("kvdepot_l2_task_seconds_count", tier="mem", task="store", outcome="ok") >= 1, what="the tier's store latencies")
    assert m("kvdepot_l2_task_seconds_count", tier="mem", task="store", outcome="failed") == 0
    assert server.clear()["removed"] == 5
    wait_until(lambda: m("kvdepot_l1_removed_objects_total", reason="cleared") - cleared_before == 5, what="5 removals, cleared")

    def engine_lookups():
        lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        return lines if len(lines) == 2 else None

    hit, miss = wait_until(engine_lookups, what="two lines in the lookup log")
    assert (hit["salt"], hit["chunks"], hit["found"], hit["hit_tokens"]) == ("tenant-a", 3, 3, 3 * CHUNK)
    assert (miss["salt"], miss["chunks"], miss["found"], miss["requested_tokens"]) == ("", 4, 0, 4 * CHUNK)
    assert hit["model"] == miss["model"] and hit["ms"] >= 0 and (log.stat().st_mode & 0o777) == 0o600
