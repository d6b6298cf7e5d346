"""States that used to mislead an operator or a client: each now says what is true, at once, in words
that name the thing to fix."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import msgspec
import pytest

from kvdepot import ClientOptions, KVClient
from kvdepot.bench.serverproc import free_port
from kvdepot.errors import BadRequest, ErrorCode, KVDepotError
from kvdepot.protocol import messages as m
from kvdepot.types import SlotStatus

from support.servers import CHUNK, LAYOUT, MODEL, RawPeer, make_kv, make_tokens, pause, wait_until
from support.tiers import (
    BIG_CHUNK,
    fs_spec,
    make_prompt,
    start_tier_server,
    store_full,
    store_stats,
    tier_of,
    valkey_spec,
    wait_store_idle,
)

CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


# --- health and counters -----------------------------------------------------------------------------


def test_healthcheck_says_degraded_with_the_reason_while_the_only_tier_is_down(make_server, seed):
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    srv = start_tier_server(make_server, valkey_spec(dead, name="cache-kv", socket_timeout_s=1))
    with srv.client() as c:
        tokens = make_tokens(2 * CHUNK, seed)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK  # L1 takes it

        def degraded() -> dict | None:
            r = httpx.get(f"{srv.http}/healthcheck", timeout=10)
            return r.json() if r.json()["status"] == "degraded" else None

        doc = wait_until(degraded, what="/healthcheck to report the dead tier")
        assert "cache-kv" in doc["reason"] and "valkey" in doc["reason"] and "down" in doc["reason"]
        assert httpx.get(f"{srv.http}/healthcheck", timeout=10).status_code == 200  # L1 still serves
        assert c.retrieve(tokens).shape[2] == 2 * CHUNK


def test_healthcheck_answers_within_a_probe_timeout_while_the_tiers_hang(make_server, own_valkey, seed):
    """/healthcheck asked every tier's backend for its usage (waiting up to 0.5 s each) only to read its
    health: with three tiers on a Valkey that stopped answering, every probe took 1.5 s, past a kubelet's
    default 1 s timeout, so a liveness probe restarted a server that still served from L1."""
    specs = [valkey_spec(own_valkey.url, name=f"kv{i}", socket_timeout_s=1) for i in range(3)]
    srv = start_tier_server(make_server, *specs)
    pause(own_valkey.proc.pid)
    for _ in range(3):
        r = httpx.get(f"{srv.http}/healthcheck", timeout=1.0)  # a kubelet's default timeoutSeconds
        assert r.status_code == 200, r.text
    with srv.client() as c:
        tokens = make_tokens(2 * CHUNK, seed)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed)) == 2 * CHUNK  # L1 takes it; the pushes fail

        def degraded() -> dict | None:
            doc = httpx.get(f"{srv.http}/healthcheck", timeout=1.0).json()
            return doc if doc["status"] == "degraded" and all(f"kv{i}" in doc["reason"] for i in range(3)) else None

        wait_until(degraded, what="/healthcheck to report the hung tiers")
        assert c.retrieve(tokens).shape[2] == 2 * CHUNK


def test_a_tier_and_its_store_controller_count_the_same_objects(make_server, small_tmpfs, seed):
    """A tier that fills up in the middle of a batch: the objects it stored before are counted as
    stored by both, never stored by one and failed by the other."""
    srv = start_tier_server(make_server, fs_spec(small_tmpfs), chunk=BIG_CHUNK)  # 1 MiB of disk
    with srv.client(chunk_size=BIG_CHUNK) as c:
        store_full(c, make_prompt(48, seed, BIG_CHUNK))  # 48 objects of 32 KiB: 1.5 MiB
        status = wait_store_idle(srv, accounted=48)
    tier, ctl = tier_of(status, "disk"), store_stats(status)
    assert ctl["failed"] > 0 and tier["stored"] > 0, (tier, ctl)  # the disk filled up midway
    assert tier["stored"] == ctl["stored"], (tier, ctl)
    assert ctl["stored"] + ctl["failed"] == ctl["submitted"] == 48


# --- quotas ------------------------------------------------------------------------------------------


@pytest.fixture
def quota_server(make_server):
    return make_server("--eviction-policy", "isolated_lru")


def put_quota(srv, salt: str, body) -> httpx.Response:
    return httpx.put(f"{srv.http}/quota/{salt}", content=msgspec.json.encode(body), headers={"Content-Type": "application/json"}, timeout=10)


def test_a_quota_below_one_chunk_is_warned_and_its_stores_refused_visibly(quota_server, seed):
    srv = quota_server
    with srv.client() as c:
        r = put_quota(srv, "tiny", {"quota_bytes": CHUNK_BYTES - 1})
        assert r.status_code == 200 and "below one chunk" in r.json()["warning"]
        tokens = make_tokens(3 * CHUNK, seed)
        with c.prepare_store(tokens, cache_salt="tiny") as slots:
            assert slots.statuses == [SlotStatus.OVER_QUOTA] * 3 and all(s is None for s in slots)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed), cache_salt="tiny") == 0
        assert srv.status()["l1"]["quota_refused"] >= 6
        assert put_quota(srv, "tiny", {"quota_bytes": 3 * CHUNK_BYTES}).json().get("warning") is None
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed), cache_salt="tiny") == 3 * CHUNK


def test_a_lowered_quota_answers_with_its_trim_done_and_warns_of_pins_above_it(quota_server, seed):
    """PUT /quota answered with the tenant's use before the trim (8 chunks against a quota of 2: the trim
    ran a moment later on the eviction thread), though a quota change is "enforced at once"; and a quota
    lowered below what the tenant has pinned was accepted without a word, while every store of that
    tenant is then refused (OVER_QUOTA) until it is unpinned, as a quota below one chunk is, which warns."""
    srv = quota_server
    tokens = make_tokens(8 * CHUNK, seed)
    with srv.client() as c:
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed), cache_salt="t") == 8 * CHUNK
        r = put_quota(srv, "t", {"quota_bytes": 2 * CHUNK_BYTES})
        assert r.status_code == 200 and r.json()["used_bytes"] == 2 * CHUNK_BYTES, r.text
        assert r.json().get("warning") is None
        assert c.lookup(tokens, cache_salt="t") == 2 * CHUNK  # the prefix's head is what stays

        pin = httpx.post(f"{srv.http}/cache/pin", json={"token_ids": tokens.tolist(), "cache_salt": "t"}, timeout=10)
        assert pin.status_code == 200 and pin.json()["pinned"] == 2, pin.text
        r = put_quota(srv, "t", {"quota_bytes": CHUNK_BYTES})
        assert r.status_code == 200 and r.json()["used_bytes"] == 2 * CHUNK_BYTES  # pinned: not trimmed
        assert "pinned" in r.json().get("warning", ""), r.text
        more = make_tokens(2 * CHUNK, seed + 1)
        assert c.store(more, make_kv(LAYOUT, len(more), seed + 1), cache_salt="t") == 0  # what the warning says


@pytest.mark.parametrize("bad", [True, "123", 10**26, -1, 1.5, None])
def test_quota_values_are_strict_integers_in_range(quota_server, bad):
    r = put_quota(quota_server, "t", {"quota_bytes": bad})
    assert r.status_code == 422, r.text
    assert httpx.get(f"{quota_server.http}/quota/t", timeout=10).json()["quota_bytes"] is None


def test_a_salt_with_a_slash_can_be_addressed(quota_server, seed):
    srv = quota_server
    salt = "tenant/a b"
    encoded = "tenant%2Fa%20b"
    assert put_quota(srv, encoded, {"quota_bytes": 5 * CHUNK_BYTES}).status_code == 200
    with srv.client() as c:
        tokens = make_tokens(2 * CHUNK, seed)
        assert c.store(tokens, make_kv(LAYOUT, len(tokens), seed), cache_salt=salt) == 2 * CHUNK
    doc = httpx.get(f"{srv.http}/quota/{encoded}", timeout=10).json()
    assert doc == {"cache_salt": salt, "quota_bytes": 5 * CHUNK_BYTES, "used_bytes": 2 * CHUNK_BYTES}
    assert httpx.delete(f"{srv.http}/quota/{encoded}", headers={"Content-Type": "application/json"}, timeout=10).status_code == 200


# --- what clients are told ---------------------------------------------------------------------------


def test_a_goodbye_is_not_logged_like_a_dropped_connection(make_server, seed):
    srv = make_server()
    # The start-up probes' bare PINGs close without a goodbye (true): on a loaded machine there may be
    # several (each sends one PING), so wait until every probe that pinged has been seen to go.
    # The counter moves just before the log line is written: wait for both, or a probe's line written
    # a moment late reads as the client's.
    def probes_gone() -> bool:
        gone = srv.metric("kvdepot_disconnects_total", kind="no_goodbye")
        logged = srv.log_text().count("without a goodbye")
        return gone >= 1 and gone == srv.metric("kvdepot_requests_total", type="PING") and logged == gone

    wait_until(probes_gone, what="the probes' disconnects")
    start = len(srv.log_text())
    with srv.client() as c:
        c.ping()
    wait_until(lambda: srv.metric("kvdepot_disconnects_total", kind="goodbye") == 1, what="the client's disconnect to be seen")
    assert "without a goodbye" not in srv.log_text()[start:]
    child = subprocess.Popen(
        [sys.executable, "-c", f"import time; from kvdepot import KVClient, KVLayout; c = KVClient({srv.url!r}, 'm', KVLayout(2, 2, 32)); print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "1"
    child.kill()
    child.wait(10)
    wait_until(lambda: "without a goodbye" in srv.log_text(), what="the crash to be logged as one")


def test_connecting_to_nothing_says_so_quickly():
    url = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(KVDepotError) as exc_info:
        KVClient(url, MODEL, LAYOUT, options=ClientOptions(connect_timeout_s=0.5))
    assert time.monotonic() - t0 < 3
    assert exc_info.value.code == ErrorCode.CONNECTION
    assert f"no kvdepot server answered at {url}" in str(exc_info.value) and "connect_timeout_s" in str(exc_info.value)


@pytest.mark.parametrize("url", ["127.0.0.1:5555", "localhost", "http://127.0.0.1:5555", "tcp://127.0.0.1", "tcp://:5555", ""])
def test_a_malformed_url_is_a_value_error_showing_the_form(url):
    with pytest.raises(ValueError, match="tcp://HOST:PORT or ipc://PATH"):
        KVClient(url, MODEL, LAYOUT)


@pytest.mark.parametrize("field, value", [("pid", 2**40), ("pid", -3), ("pid_namespace", -5)])
def test_register_with_an_impossible_client_info_is_a_bad_request(server, field, value):
    with RawPeer(server.url) as peer:
        req = m.RegisterContextRequest(
            protocol_version=m.PROTOCOL_VERSION,
            model=MODEL,
            layout=m.LayoutSpec(num_layers=2, num_kv_heads=2, head_dim=32),
            client=m.ClientInfo(**{field: value}),
        )
        with pytest.raises(BadRequest, match=field):
            peer.call(req)
        assert peer.ping()
    assert "Traceback" not in server.log_text()


@pytest.mark.parametrize("field", ["allocated_blocks", "freed_blocks"])
@pytest.mark.parametrize("value", [2**63, -1])
def test_block_reports_are_range_checked(server, field, value):
    before = server.status()["block_events"]
    with RawPeer(server.url) as peer:
        peer.register()
        with pytest.raises(BadRequest, match=field):
            peer.call(m.ReportBlockAllocationRequest(context_id=peer.context_id, **{field: value}))
    assert server.status()["block_events"] == before


# --- start-up --------------------------------------------------------------------------------------


def server_cli(*args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="kvd-") as d:
        cmd = [sys.executable, "-m", "kvdepot.cli", "server", "--port", "0", "--http-port", "0", "--ipc-path", os.path.join(d, "s"),
               "--shm-dir", d, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert [n for n in os.listdir(d) if n.startswith("kvdepot-")] == [], "a refused start left an arena"
        return r


@pytest.mark.parametrize("args, words", [
    (["--l1-size-gb", "0.000001"], ["--l1-size-gb"]),
    (["--chunk-size", "5000000"], ["--chunk-size"]),
])
def test_settings_no_client_could_use_are_refused_at_start(args, words):
    r = server_cli(*args)
    assert r.returncode == 2, r.stderr
    assert all(w in r.stderr for w in words) and "Traceback" not in r.stderr


BAD_TIERS = [
    ("fs:", "fs0", "path"),
    ("fs:path=/tmp/x,size_gb=-1", "fs0", "size_gb"),
    ("fs:path=/tmp/x,size_gb=abc", "fs0", "size_gb"),
    ("fs:path=/tmp/x,workers=0,name=disk", "disk", "workers"),
    ("fs:path=/proc/kvdepot/cannot", "fs0", "/proc/kvdepot"),
    ("valkey:url=notaurl", "valkey0", "url"),
    ("valkey:pool_size=0", "valkey0", "pool_size"),
    ("valkey:max_value_mib=9999", "valkey0", "max_value_mib"),
    ("s3:", "s30", "bucket"),
    ("s3:bucket=b,part_size_mib=1", "s30", "part_size_mib"),
    ("s3:bucket=b,endpoint_url=nota url", "s30", "endpoint_url"),
    ("s3:bucket=b,access_key_id=x", "s30", "secret_access_key"),
    ("memory:size_gb=0", "memory0", "size_gb"),
    ("memory:workers=0", "memory0", "workers"),
    ('{"type": "memory", "size_gb": "big"}', "memory0", "size_gb"),
    ("memory:color=red", "memory0", "color"),
]


@pytest.mark.parametrize("spec, tier, key", BAD_TIERS, ids=[b[0] for b in BAD_TIERS])
def test_every_bad_tier_spec_exits_2_naming_the_tier_and_the_key(spec, tier, key):
    r = server_cli("--l1-size-gb", "0.01", "--l2", spec)
    assert r.returncode == 2, (r.returncode, r.stderr)
    last = r.stderr.strip().splitlines()[-1]
    assert tier in last and key in last, last
    assert "Traceback" not in r.stderr


def test_demo_with_a_bad_setting_prints_the_servers_reason_and_leaves_nothing(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "demo", "--synthetic", "--l1-size-gb", "100000"], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "the server did not start" in r.stderr and "--l1-size-gb" in r.stderr
    assert list(tmp_path.iterdir()) == [], "the demo left its temporary directory behind"
