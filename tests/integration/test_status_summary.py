"""``kvdepot status``'s summary for people names the tiers and their health, each tenant's use against
its quota, and what is quarantined (and by whom), read from a live server."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
from support.servers import CHUNK, LAYOUT, make_kv, make_tokens

from kvdepot.protocol import messages as m


def _status(srv) -> str:
    r = subprocess.run([sys.executable, "-m", "kvdepot.cli", "status", "--url", srv.http], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_summary_lists_tiers_tenants_and_quarantine(make_server, seed):
    srv = make_server("--lease-ttl-s", "1", "--eviction-policy", "isolated_lru", "--l2", "memory:name=ram,size_gb=0.01")
    out = _status(srv)
    assert "tier       ram (memory): up" in out and "tenants    none in L1" in out and "quarantine none" in out, out

    chunk = LAYOUT.chunk_bytes(CHUNK)
    assert httpx.put(f"{srv.http}/quota/acme", json={"quota_bytes": 64 * chunk}, timeout=10).status_code == 200
    with srv.client() as c:
        for i, (salt, n) in enumerate([("acme", 4), (None, 2)]):
            t = make_tokens(n * CHUNK, seed + i)
            assert c.store(t, make_kv(LAYOUT, len(t), seed + i), cache_salt=salt) == n * CHUNK
        # A store that is prepared and never committed: its lease expires while this client still
        # maps the slots, so their space is quarantined (see test_liveness).
        abandoned = c.hashes(make_tokens(3 * CHUNK, seed + 9))
        assert c.link.request(m.PrepareStoreRequest(context_id=0, keys=abandoned)).lease_id != 0
        st = srv.wait_status(lambda st: st["quarantine"]["leases"] == 1 and st["tiers"][0]["objects"] == 6)
        assert st["quarantine"]["leases"] == 1, st["quarantine"]
        out = _status(srv)
    lines = out.splitlines()
    tier_bytes = st["tiers"][0]["used_bytes"]  # the objects and the tier's own framing
    assert tier_bytes >= 6 * chunk and f"  tier       ram (memory): up, {tier_bytes / 1024:.1f} KiB, 6 objects" in lines, out
    assert f"  tenant     acme: 32.0 KiB of {64 * chunk / 1024:.1f} KiB quota (6%), 4 objects" in lines, out
    assert "  tenant     __default__: 16.0 KiB, no quota, 2 objects" in lines, out
    assert "  quarantine 1 leases, 24.0 KiB held back from reuse" in lines, out
    client_line = next(line for line in lines if line.startswith("    client "))
    assert f"pid {os.getpid()}" in client_line and "1 leases, 24.0 KiB" in client_line, client_line
