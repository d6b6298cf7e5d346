"""The dashboard in a real headless Chromium: after a small workload, the numbers the page shows are
those of ``/status`` at the same (quiesced) moment, for every number it shows."""

from __future__ import annotations

import math

import httpx
from support.browser import dump_dom, png_size, screenshot, shown_metrics
from support.servers import CHUNK, LAYOUT, RawPeer, encode_body, make_kv, make_tokens, raw_header

from kvdepot.errors import ErrorCode
from kvdepot.protocol import messages as m

SCALARS = (
    "l1.used_bytes", "l1.capacity_bytes", "l1.objects", "l1.evicted_objects", "l1.fragmentation",
    "lookups.hit_rate", "lookups.requests", "lookups.requested_tokens", "lookups.hit_tokens", "lookups.missed_tokens",
    "stores.chunks", "stores.bytes", "retrieves.chunks", "retrieves.bytes",
    "clients", "contexts", "sessions", "leases", "expired_leases", "quarantine.leases", "quarantine.bytes",
)  # fmt: skip
DERIVED = ("l1.used_fraction", "rate.hit_rate", "rate.stored_bytes_per_s", "rate.retrieved_bytes_per_s", "rate.lookups_per_s")


def _get(doc: dict, dotted: str):
    for part in dotted.split("."):
        doc = doc[part]
    return doc


def expected_numbers(st: dict) -> dict[str, float]:
    """What the page must show, by data-metric, from one /status document."""
    out = {name: _get(st, name) for name in SCALARS}
    for t in st["tiers"]:
        out[f"tiers.{t['name']}.healthy"] = 1 if t["healthy"] else 0
        out[f"tiers.{t['name']}.objects"] = t["objects"]
        out[f"tiers.{t['name']}.used_bytes"] = t["used_bytes"]
    for t in st["tenants"]:
        out[f"tenants.{t['cache_salt']}.objects"] = t["objects"]
        out[f"tenants.{t['cache_salt']}.used_bytes"] = t["used_bytes"]
        if t["quota_bytes"] is not None:
            out[f"tenants.{t['cache_salt']}.quota_bytes"] = t["quota_bytes"]
    for q in st["quarantine"]["clients"]:
        for field in ("pid", "leases", "bytes"):
            out[f"quarantine.{q['client']}.{field}"] = q[field]
    for code, n in st["errors"].items():
        out[f"errors.{code}"] = n
    return out


def _workload(srv, c, seed: int) -> list:
    """Stores for two tenants, lookups that hit and miss, a read back, and one malformed request."""
    prompts = []
    for i in range(6):
        salt = "tenant-a" if i % 2 else None
        t = make_tokens((2 + i) * CHUNK, seed + i)
        assert c.store(t, make_kv(LAYOUT, len(t), seed + i), cache_salt=salt) == len(t)
        assert c.lookup(t, cache_salt=salt) == len(t)
        assert c.lookup(make_tokens(3 * CHUNK, seed + 100 + i), cache_salt=salt) == 0
        prompts.append(t)
    assert c.retrieve(prompts[0]).shape[2] == len(prompts[0])
    with RawPeer(srv.url) as peer:  # one error reply: a request in a protocol version nobody speaks
        code, _, _ = peer.error_of([raw_header(m.PROTOCOL_VERSION + 1, 7, int(m.RequestType.PING)), encode_body(m.PingRequest())])
        assert code == ErrorCode.VERSION_MISMATCH
    return prompts


def test_the_dashboard_shows_what_status_says(make_server, seed, tmp_path):
    srv = make_server("--eviction-policy", "isolated_lru", "--l2", "memory:name=mem,size_gb=0.05")
    assert httpx.put(f"{srv.http}/quota/tenant-a", json={"quota_bytes": 4 << 20}, timeout=10).status_code == 200
    with srv.client() as c:
        prompts = _workload(srv, c, seed)
        objects = sum(len(t) // CHUNK for t in prompts)
        srv.wait_status(lambda st: st["tiers"][0]["objects"] == objects and st["l2_controllers"]["store"]["queued"] == 0
                        and st["l2_controllers"]["store"]["in_flight"] == 0)  # fmt: skip
        with c.prepare_retrieve(prompts[1], cache_salt="tenant-a") as views:  # a lease held while the page looks
            assert len(views) == len(prompts[1]) // CHUNK
            before = srv.status()
            dom = dump_dom(f"{srv.http}/dashboard", budget_ms=6000)
            after = srv.status()
            shot = screenshot(f"{srv.http}/dashboard", tmp_path / "dashboard.png", budget_ms=4000)
    print(f"dashboard screenshot: {shot}")
    assert png_size(shot) == (1400, 1000)

    want = expected_numbers(before)
    assert expected_numbers(after) == want, "the server was not quiet while the page looked"
    # The workload is in what the page is compared with (a page of zeros must not pass).
    assert want["leases"] == 1 and want["clients"] == 1 and want["lookups.hit_tokens"] > 0 and want["lookups.missed_tokens"] > 0
    assert want["errors.VERSION_MISMATCH"] == 1 and want["tiers.mem.objects"] == objects
    assert want["tenants.tenant-a.quota_bytes"] == 4 << 20 and want["tenants.tenant-a.objects"] == sum(len(t) // CHUNK for t in prompts[1::2])
    assert want["tenants.__default__.objects"] + want["tenants.tenant-a.objects"] == want["l1.objects"]

    shown, body = shown_metrics(dom)
    assert int(body.get("data-polls", "0")) >= 2, f"the page did not refresh itself: {body}"
    assert shown.pop("health") == "ok"
    rates = {name: shown.pop(name) for name in DERIVED}
    assert set(shown) == set(want), f"shown but not in /status: {set(shown) - set(want)}; missing: {set(want) - set(shown)}"
    for name, value in want.items():
        assert math.isclose(float(shown[name]), value), f"{name}: the page shows {shown[name]}, /status says {value}"
    assert math.isclose(float(rates["l1.used_fraction"]), want["l1.used_bytes"] / want["l1.capacity_bytes"])
    for name in ("rate.stored_bytes_per_s", "rate.retrieved_bytes_per_s", "rate.lookups_per_s"):
        assert float(rates[name]) == 0.0, f"{name} moved while the server was quiet: {rates[name]}"
    assert rates["rate.hit_rate"] == "", "no lookups in the last interval: no hit rate to show"
    # The error reply and the recent events are listed.
    recent_errors = dom.split('id="recent-errors"', 1)[1].split("</ol>", 1)[0]
    assert "error_reply" in recent_errors and "VERSION_MISMATCH" in recent_errors, recent_errors
    assert "l1_stored" in dom.split('id="recent-events"', 1)[1]


def test_the_dashboard_page_is_self_contained(server):
    r = httpx.get(f"{server.http}/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = r.text.lower()
    for needle in ("http://", "https://", 'src="//', "@import", "<link", "<iframe", "innerhtml"):
        assert needle not in page, f"the dashboard page contains {needle!r}"
    assert page.count("<script") == 1 and "<script src" not in page
