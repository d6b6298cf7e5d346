"""L2 tiers through a real server (ARCHITECTURE.md §6): write-through to every tier, prefetch of what
L1 evicted, ``skip_l1`` placement, a corrupt object read as a miss, and the ``--l2`` command line.

Tiers are real: fs in a temporary directory, the contract suite's valkey-server and SeaweedFS S3.
Bytes are compared bit for bit; counts in /status are compared exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from kvdepot.bench.serverproc import free_port

from support.servers import CHUNK, LAYOUT, as_bits, wait_until
from support.tiers import (
    BIG_CHUNK,
    TINY_L1_GB,
    assert_consistent,
    assert_no_loss_counters,
    assert_prefix_bytes,
    assert_served_whole,
    extend_prompt,
    fs_object_file,
    fs_spec,
    make_prompt,
    prefetch_stats,
    s3_spec,
    start_tier_server,
    store_full,
    store_stats,
    tier_of,
    valkey_spec,
    wait_prefetch,
    wait_store_idle,
)


# --- write-through ----------------------------------------------------------------------------------


def test_write_through_reaches_every_tier(make_server, tmp_path, valkey_server, s3_server, seed):
    srv = start_tier_server(
        make_server, fs_spec(tmp_path / "disk"), valkey_spec(valkey_server.url), s3_spec(s3_server.endpoint)
    )
    names = ["disk", "kv", "obj"]
    status = srv.status()
    assert [(t["name"], t["kind"], t["healthy"], t["objects"]) for t in status["tiers"]] == [
        ("disk", "fs", True, 0),
        ("kv", "valkey", True, 0),
        ("obj", "s3", True, 0),
    ]
    prompts = [make_prompt(n, seed + i) for i, n in enumerate([1, 2, 3, 5, 7])]
    with srv.client() as c:
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv)
        total = 18
        for name in names:
            t = tier_of(status, name)
            assert (t["healthy"], t["objects"], t["stored"], t["failures"], t["corrupt"]) == (True, total, total, 0, 0), t
        s = store_stats(status)
        assert (s["submitted"], s["stored"]) == (total, 3 * total)  # ``stored`` counts per tier
        assert_no_loss_counters(status)

        # Storing a prompt again pushes nothing; extending one pushes only its new chunks.
        store_full(c, prompts[2])
        longer = extend_prompt(prompts[4], 2, seed + 100)
        store_full(c, longer)
        status = wait_store_idle(srv)
        total += 2
        assert [tier_of(status, n)["objects"] for n in names] == [total] * 3
        assert store_stats(status)["submitted"] == total

        # From an empty L1 everything comes back, from the first tier in --l2 order that has it.
        srv.clear()
        assert srv.status()["l1"]["objects"] == 0
        for p in [*prompts[:4], longer]:
            assert_served_whole(c, p)
        status = srv.status()
        assert [tier_of(status, n)["loaded"] for n in names] == [total, 0, 0]
        assert prefetch_stats(status)["chunks_loaded"] == total
        assert store_stats(status)["submitted"] == total, "objects loaded from L2 must not be pushed back"
        assert status["leases"] == 0


@pytest.mark.parametrize("kind", ["fs", "valkey", "valkey_cluster", "s3", "memory"])
def test_each_tier_kind_serves_an_emptied_l1(kind, request, make_server, tmp_path, seed):
    if kind == "fs":
        spec = fs_spec(tmp_path / "disk", name="t")
    elif kind == "valkey":
        spec = valkey_spec(request.getfixturevalue("valkey_server").url, name="t")
    elif kind == "valkey_cluster":  # the same tier type: it finds the cluster out itself
        spec = valkey_spec(request.getfixturevalue("valkey_cluster").url, name="t")
    elif kind == "s3":
        spec = s3_spec(request.getfixturevalue("s3_server").endpoint, name="t")
    else:
        spec = "memory:size_gb=0.25,name=t"
    srv = start_tier_server(make_server, spec)
    prompts = [make_prompt(n, seed + i) for i, n in enumerate([2, 4, 6])]
    with srv.client() as c, srv.client(transport="inline") as ci:
        assert (c.transport, ci.transport) == ("shm", "inline")
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv)
        assert_no_loss_counters(status)
        assert tier_of(status, "t")["objects"] == 12

        srv.clear()
        assert_served_whole(c, prompts[0])
        assert_served_whole(ci, prompts[1])
        assert_served_whole(ci, prompts[2])
        t = tier_of(srv.status(), "t")
        assert (t["kind"], t["healthy"], t["loaded"], t["corrupt"], t["failures"]) == (kind.removesuffix("_cluster"), True, 12, 0, 0)


def test_clear_empties_l1_the_tiers_or_both(make_server, tmp_path, seed):
    import httpx

    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk", name="disk"), "memory:size_gb=0.25,name=mem")
    a, b = make_prompt(3, seed), make_prompt(2, seed + 1)
    with srv.client() as c:
        store_full(c, a)
        store_full(c, b)
        wait_store_idle(srv)

        def clear(scope: str) -> dict:
            r = httpx.post(f"{srv.http}/cache/clear", json={"scope": scope}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        assert clear("tiers") == {"removed": 0, "tiers_removed": {"disk": 5, "mem": 5}}
        assert srv.status()["l1"]["objects"] == 5  # L1 untouched
        assert_served_whole(c, a)
        status = srv.status()
        assert tier_of(status, "disk")["objects"] == 0 and tier_of(status, "mem")["objects"] == 0
        assert clear("l1") == {"removed": 5, "tiers_removed": {}}
        assert c.lookup(a.tokens) == 0  # in no tier either: a miss, never stale bytes

        store_full(c, a)
        wait_store_idle(srv)
        assert c.clear("all") == 3 + 3 + 3  # L1 and both tiers, through the client
        assert c.lookup(a.tokens) == 0


def test_a_clear_or_delete_a_tier_could_not_do_is_not_answered_200(make_server, own_valkey, seed):
    """A clear (README: after new weights under one model name, POST /cache/clear {"scope": "all"}) or a
    DELETE /cache/prefix that a tier could not carry out (down, or hung past its wait) answered 200, its
    failure only a -1 in the body that README never mentions: a script (curl -f) took it as done, and once
    the tier answered again it served the very KV the operator had cleared."""
    import signal

    import httpx

    from support.servers import pause

    srv = start_tier_server(make_server, valkey_spec(own_valkey.url, name="kv", socket_timeout_s=1))
    p = make_prompt(4, seed)
    with srv.client() as c:
        store_full(c, p)
        wait_until(lambda: tier_of(wait_store_idle(srv), "kv")["objects"] >= 4, what="the prompt in the tier")
        pause(own_valkey.proc.pid)
        try:
            r = httpx.request("DELETE", f"{srv.http}/cache/prefix", json={"token_ids": p.tokens.tolist()}, timeout=60)
            assert r.status_code == 502 and "kv" in r.json()["detail"], r.text
            assert r.json()["l1_removed"] == 4 and r.json()["tiers_removed"] == {"kv": -1}  # what was done is still said
            r = httpx.post(f"{srv.http}/cache/clear", json={"scope": "all"}, timeout=60)
            assert r.status_code == 502 and "kv" in r.json()["detail"], r.text
            assert r.json()["tiers_removed"] == {"kv": -1}
        finally:
            own_valkey.proc.send_signal(signal.SIGCONT)
        # Why it matters: the tier kept the prefix, and serves it again.
        wait_until(lambda: c.lookup(p.tokens) == len(p.tokens), what="the tier to serve the prefix again")
        r = httpx.post(f"{srv.http}/cache/clear", json={"scope": "all"}, timeout=60)
        assert r.status_code == 200 and r.json()["tiers_removed"] == {"kv": 4}, r.text
        assert c.lookup(p.tokens) == 0


# --- prefetch ---------------------------------------------------------------------------------------


def test_prefetch_brings_back_prompts_evicted_from_a_small_l1(make_server, tmp_path, seed):
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), chunk=BIG_CHUNK, l1_gb=TINY_L1_GB)
    l1_chunks = srv.status()["l1"]["capacity_bytes"] // LAYOUT.chunk_bytes(BIG_CHUNK)
    assert 250 < l1_chunks < 400
    per_prompt = 8
    prompts = [make_prompt(per_prompt, seed * 1000 + i, BIG_CHUNK) for i in range(3 * l1_chunks // per_prompt + 1)]
    total = len(prompts) * per_prompt  # three times what L1 holds
    with srv.client() as c, srv.client(transport="inline") as ci:
        for i, p in enumerate(prompts):
            store_full(c, p)
            if i % 8 == 7:
                # 64 chunks between waits, well under L1: L2 keeps up, so eviction never has to take
                # an object still waiting for its push (a writer a whole L1 ahead of the tier would
                # lose some: see the next test)
                wait_store_idle(srv)
        status = wait_store_idle(srv)
        assert_no_loss_counters(status)
        assert tier_of(status, "disk")["objects"] == total
        assert status["l1"]["objects"] < total
        assert status["l1"]["evicted_objects"] >= total - l1_chunks

        # The raw session API on the oldest prompt, long gone from L1: hits=None while the prefetch
        # runs, then QUERY_PREFETCH_STATUS reports the full hit, and the retrieve reads L1.
        oldest = prompts[0]
        hashes = c.hashes(oldest.tokens)
        sid = "evicted-session"
        assert c.lookup_chunks(hashes, session_id=sid) is None, "not in L1: a prefetch must run"
        assert wait_prefetch(c, sid) == per_prompt
        with c.prepare_retrieve(hashes, session_id=sid) as views:
            assert len(views) == per_prompt
            for k, view in enumerate(views):
                want = oldest.kv[:, :, k * BIG_CHUNK : (k + 1) * BIG_CHUNK]
                assert np.array_equal(as_bits(view), as_bits(want)), f"chunk {k} differs"
        c.end_session(sid)
        pf = prefetch_stats(srv.status())
        assert (pf["jobs"], pf["lookups_hit"], pf["chunks_loaded"], pf["chunks_failed"], pf["running"]) == (1, 1, per_prompt, 0, 0)

        # The simple API, every prompt oldest first, twice over: each pass evicts the prompts it
        # passed from L1 again, and L2 serves them every time (eviction never loses what L2 holds).
        for _ in range(2):
            for i, p in enumerate(prompts):
                assert_served_whole(c if i % 2 else ci, p)
        status = srv.status()
        t = tier_of(status, "disk")
        assert (t["objects"], t["corrupt"], t["failures"]) == (total, 0, 0)
        assert store_stats(status)["submitted"] == total, "objects loaded from L2 must not be pushed back"
        assert prefetch_stats(status)["chunks_failed"] == 0
        assert status["leases"] == 0
        wait_until(lambda: srv.status()["sessions"] == 0, what="every session to end")


def test_a_writer_faster_than_the_tier_loses_only_counted_pushes(make_server, tmp_path, seed):
    """No pacing: the writer fills a small L1 three times over faster than the fs tier takes it. Every
    object is accounted for (pushed, or evicted before its turn: ``skipped_gone``, each one a last-resort
    eviction of an object awaiting its push, counted in /status), the tier holds exactly what was
    pushed, and whatever a lookup then reports retrieves bit-exact."""
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), chunk=BIG_CHUNK, l1_gb=TINY_L1_GB)
    l1_chunks = srv.status()["l1"]["capacity_bytes"] // LAYOUT.chunk_bytes(BIG_CHUNK)
    prompts = [make_prompt(8, seed * 1000 + i, BIG_CHUNK) for i in range(3 * l1_chunks // 8)]
    total = 8 * len(prompts)
    with srv.client() as c:
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv, accounted=total)
        s = store_stats(status)
        assert s["submitted"] + s["skipped_gone"] + s["dropped"] == total
        assert s["skipped_gone"] == status["l1"]["evicted_awaiting_l2"] == status["request_failures"]["lost_before_l2"]
        assert (s["stored"], s["failed"], s["dropped"]) == (s["submitted"], 0, 0)
        assert tier_of(status, "disk")["objects"] == s["submitted"]
        found = sum(assert_consistent(c, p) for p in prompts) // BIG_CHUNK
        # at most what was pushed (nothing unpushed survived in L1 three fills later); at least some
        assert 0 < found <= s["submitted"]
        assert tier_of(srv.status(), "disk")["corrupt"] == 0


def test_a_lookup_falls_through_to_the_next_tier(make_server, tmp_path, seed):
    """The first tier is too small for the working set; what it lost comes from the second."""
    srv = start_tier_server(make_server, "memory:size_gb=0.0001,name=small", fs_spec(tmp_path / "disk"))
    prompts = [make_prompt(4, seed + i) for i in range(6)]
    with srv.client() as c:
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv)
        assert tier_of(status, "disk")["objects"] == 24
        assert 4 <= tier_of(status, "small")["objects"] < 24  # ~100 KiB of 8 KiB objects: the newest
        assert store_stats(status)["failed"] == 0

        srv.clear()
        assert_served_whole(c, prompts[-1])  # the newest: still in the first tier
        assert_served_whole(c, prompts[0])  # the oldest: only the second tier has it
        status = srv.status()
        assert (tier_of(status, "small")["loaded"], tier_of(status, "disk")["loaded"]) == (4, 4)


def test_a_partial_hit_in_one_tier_continues_in_the_next(make_server, tmp_path, seed):
    """Tier ``small`` (about 12 objects) keeps a prompt's first two chunks but has evicted its last
    two; tier ``disk`` has all four. The whole prompt is in L2, so the whole prompt is a hit."""
    srv = start_tier_server(make_server, "memory:size_gb=0.0001,name=small", fs_spec(tmp_path / "disk"))
    p = make_prompt(4, seed)
    with srv.client() as c:
        store_full(c, p)
        wait_store_idle(srv)
        srv.clear()
        assert_served_whole(c, p.head(2))  # read out of ``small``: its two most recently used objects
        for i in range(10):  # newer objects push the two chunks that were not just read out of ``small``
            store_full(c, make_prompt(1, seed + 1 + i))
        status = wait_store_idle(srv)
        assert (tier_of(status, "small")["objects"], tier_of(status, "disk")["objects"]) == (12, 14), "setup"
        srv.clear()
        assert c.lookup(p.tokens) == p.n_tokens, "chunks 2-3 are in tier disk"
        assert_prefix_bytes(c.retrieve(p.tokens), p, p.n_tokens)
        status = srv.status()
        assert (tier_of(status, "small")["loaded"], tier_of(status, "disk")["loaded"]) == (2 + 2, 2)


# --- placement ----------------------------------------------------------------------------------------


def test_skip_l1_placement_leaves_objects_only_in_l2(make_server, tmp_path, seed):
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), extra=("--l2-placement", "skip_l1"))
    prompts = [make_prompt(n, seed + i) for i, n in enumerate([3, 4, 5])]
    with srv.client() as c, srv.client(transport="inline") as ci:
        for p in prompts:
            store_full(c, p)
        status = wait_store_idle(srv)
        assert_no_loss_counters(status)
        assert tier_of(status, "disk")["objects"] == 12
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, what="L1 to drop the pushed objects")

        assert_served_whole(c, prompts[0])
        assert_served_whole(ci, prompts[1])
        hashes = c.hashes(prompts[2].tokens)
        assert c.lookup_chunks(hashes, session_id="skip") is None
        assert wait_prefetch(c, "skip") == 5
        with c.prepare_retrieve(hashes, session_id="skip") as views:
            assert len(views) == 5
            got = np.concatenate([np.asarray(v) for v in views], axis=2)
            assert_prefix_bytes(got, prompts[2], prompts[2].n_tokens)
        c.end_session("skip")
        status = srv.status()
        assert tier_of(status, "disk")["loaded"] == 12
        assert store_stats(status)["submitted"] == 12
        assert status["leases"] == 0


# --- integrity ----------------------------------------------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        at = f.tell()
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_corrupt_fs_object_is_a_miss_never_bad_bytes(make_server, tmp_path, seed):
    tier_dir = tmp_path / "disk"
    srv = start_tier_server(make_server, fs_spec(tier_dir))
    flipped_payload, flipped_header, torn = (make_prompt(4, seed + i) for i in range(3))
    with srv.client() as c:
        for p in (flipped_payload, flipped_header, torn):
            store_full(c, p)
        status = wait_store_idle(srv)
        assert tier_of(status, "disk")["objects"] == 12

        damaged = [fs_object_file(tier_dir, c, flipped_payload, 2), fs_object_file(tier_dir, c, flipped_header, 0)]
        _flip_byte(damaged[0], -1)  # the payload's last byte
        _flip_byte(damaged[1], 0)  # the header's magic
        damaged.append(fs_object_file(tier_dir, c, torn, 1))
        os.truncate(damaged[2], damaged[2].stat().st_size // 2)  # a torn write

        srv.clear()
        for _ in range(2):  # asked again, the same answer (the corrupt files are gone by then)
            assert c.lookup(flipped_payload.tokens) == 2 * CHUNK
            assert_prefix_bytes(c.retrieve(flipped_payload.tokens), flipped_payload, 2 * CHUNK)
            assert c.lookup(flipped_header.tokens) == 0
            assert_prefix_bytes(c.retrieve(flipped_header.tokens), flipped_header, 0)
            assert c.lookup(torn.tokens) == 1 * CHUNK
            assert_prefix_bytes(c.retrieve(torn.tokens), torn, 1 * CHUNK)
        status = srv.status()
        t = tier_of(status, "disk")
        assert (t["corrupt"], t["objects"], t["healthy"]) == (3, 9, True)
        assert [f.exists() for f in damaged] == [False] * 3
        assert prefetch_stats(status)["chunks_failed"] == 3

        # Storing the prompt again repairs the tier: only the missing chunk is written.
        store_full(c, flipped_payload)
        status = wait_store_idle(srv)
        assert tier_of(status, "disk")["objects"] == 10
        assert damaged[0].exists()
        srv.clear()
        assert_served_whole(c, flipped_payload)
        assert tier_of(srv.status(), "disk")["corrupt"] == 3


# --- the --l2 command line ----------------------------------------------------------------------------


def _server_cli(*args: str, shm_dir: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvdepot.cli", "server", "--port", str(free_port()), "--http-port", "0", *args]
    if shm_dir:
        cmd += ["--shm-dir", shm_dir]
    env = dict(os.environ, COLUMNS="200")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    "spec, named",
    [
        ("nosuch:path=/x", "unknown tier type 'nosuch'"),
        ('{"type": "warp"}', "unknown tier type 'warp'"),
        ("fs:path=/tmp/x,bogus=1", "unknown field `bogus`"),
        ('{"type": "s3", "bucket": "b", "endpoint": "http://x"}', "unknown field `endpoint`"),
        ("fs:size_gb=1", "missing required field `path`"),
        ("fs:path=/tmp/x,size_gb=lots", "size_gb"),
        ("valkey:url", "'url' is not key=value"),
    ],
)
def test_a_bad_l2_spec_exits_non_zero_naming_the_problem(spec, named):
    with tempfile.TemporaryDirectory() as shm_dir:
        r = _server_cli("--l2", spec, shm_dir=shm_dir)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert named in r.stderr
        assert os.listdir(shm_dir) == []  # rejected before anything was created
    if "unknown tier type" in named:
        assert "['fs', 'memory', 'peer', 's3', 'valkey']" in r.stderr  # and the known ones are listed


@pytest.mark.parametrize(
    "spec, named, secret",
    [
        # a generated (base64) password with a '/' that was not percent-encoded: the URL's host part ends there
        ("valkey:url=redis://:Zm9v+YmFy/cXV4@127.0.0.1:6379/0", "url", "Zm9v+YmFy"),
        ("valkey:url=redis://:12#34@127.0.0.1:6379/0", "url", "12#34"),  # a '#': the rest is a fragment
        ("valkey:url=redis://127.0.0.1:99999/0", "url", None),
        ("valkey:url=redis://127.0.0.1:6379/one", "url", None),  # the client took it for database 0
        ("s3:bucket=b,endpoint_url=http://127.0.0.1:99999", "endpoint_url", None),
        ("s3:bucket=my bucket,endpoint_url=http://127.0.0.1:9000", "bucket", None),
    ],
)
def test_a_tier_address_its_client_can_never_use_stops_the_start(spec, named, secret):
    """Such a server started, and its tier failed every operation for good (down in /status, the log
    warning about it), with the first part of the password in both; now it is one error at start."""
    with tempfile.TemporaryDirectory() as shm_dir:
        cmd = [sys.executable, "-m", "kvdepot.cli", "server", "--port", str(free_port()), "--http-port", "0",
               "--l1-size-gb", "0.01", "--no-prefault", "--shm-dir", shm_dir, "--l2", spec]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            _, stderr = proc.communicate(timeout=30)
            pytest.fail(f"the server started with --l2 {spec!r}: {stderr[-1500:]}")
    assert proc.returncode == 2, (proc.returncode, stderr[-2000:])
    assert named in stderr and "Traceback" not in stderr
    if secret:
        assert secret not in stderr


@pytest.mark.parametrize("spec", ["fs:path=/tmp/kvd-never,size_gb=-1", "valkey:prefix=", "s3:bucket=b,part_size_mib=1"])
def test_a_tier_that_fails_to_build_leaves_no_arena_behind(spec):
    """A value only the adapter checks (not the spec's types) fails start-up before the arena exists."""
    with tempfile.TemporaryDirectory() as shm_dir:
        r = _server_cli("--l2", spec, shm_dir=shm_dir)
        assert r.returncode != 0
        assert "tier" in r.stderr
        assert os.listdir(shm_dir) == []


def test_server_help_lists_tier_types_and_their_options():
    r = subprocess.run(
        [sys.executable, "-m", "kvdepot.cli", "server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, COLUMNS="200"),
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps lines
    for kind in ("fs:", "memory:", "s3:", "valkey:"):
        assert kind in text
    for option in (
        "path=(required)",
        "size_gb=",
        "fsync=",
        "url=",
        "socket_timeout_s=",
        "bucket=(required)",
        "endpoint_url=",
        "create_bucket=",
        "--l2-placement",
        "write_through",
        "skip_l1",
        "--l2-queue-limit",
    ):
        assert option in text, f"--help does not mention {option}"


def test_a_lookup_without_a_lock_never_counts_chunks_its_own_prefetch_evicted(make_server, tmp_path, seed):
    """A lookup (no lock: the client's, SGLang's, vLLM's tier's) whose prompt's head is in L1 and tail in
    L2: its prefetch made room for the tail by evicting the head, so it counted chunks past a gap and
    the retrieve that followed got less than the lookup said (here 34 chunks said, 32 got)."""
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), chunk=BIG_CHUNK, l1_gb="0.0009765625")
    room = srv.status()["l1"]["capacity_bytes"] // LAYOUT.chunk_bytes(BIG_CHUNK)
    p = make_prompt(room + 4, seed, BIG_CHUNK)
    with srv.client() as c:
        hashes = c.hashes(p.tokens)
        for i in range(0, len(hashes), 4):  # the whole prompt reaches the tier, 4 chunks at a time
            with c.prepare_store(hashes[i : i + 4]) as slots:
                for k, s in enumerate(slots):
                    if s is not None:
                        s[...] = p.kv[:, :, (i + k) * BIG_CHUNK : (i + k + 1) * BIG_CHUNK].view(s.dtype)
            wait_store_idle(srv)
        srv.clear()  # L1 only
        with c.prepare_store(hashes[:2]) as slots:  # the head is back in L1
            for k, s in enumerate(slots):
                s[...] = p.kv[:, :, k * BIG_CHUNK : (k + 1) * BIG_CHUNK].view(s.dtype)
        wait_store_idle(srv)
        said = c.lookup(p.tokens)
        got = c.retrieve(p.tokens)
        assert got.shape[2] >= said, f"lookup said {said // BIG_CHUNK} chunks, the retrieve got {got.shape[2] // BIG_CHUNK}"
        assert np.array_equal(as_bits(got), as_bits(p.kv[:, :, : got.shape[2]]))


def test_a_short_retrieve_keeps_the_run_it_locked_while_it_probes_the_tiers(make_server, tmp_path, seed, monkeypatch):
    """A shm retrieve that L1 holds only part of locks that part, probes the tiers, and locks again. It
    used to release its first lock before the probe: the run L1 held was evictable until the second
    lock, and what evicted it there (the watermark controller trimming an L1 the lookup's prefetch had
    filled, LRU, a prompt's tail first) made a retrieve right after a lock-free lookup get less than
    the lookup said (test above: 32 said, 27 got, about 1 run in 15). Here a store of another prompt
    needs all of L1 inside that window, every time: the retrieve still gets the run it locked."""
    srv = start_tier_server(make_server, fs_spec(tmp_path / "disk"), chunk=BIG_CHUNK, l1_gb="0.0009765625")
    room = srv.status()["l1"]["capacity_bytes"] // LAYOUT.chunk_bytes(BIG_CHUNK)
    head = room // 4
    p = make_prompt(head + 4, seed, BIG_CHUNK)  # its last 4 chunks are stored nowhere: a short run
    q = make_prompt(room, seed + 1, BIG_CHUNK)  # another prompt, as large as L1
    with srv.client() as c, srv.client() as other:
        assert c.transport == "shm"
        with c.prepare_store(c.hashes(p.tokens)[:head]) as slots:
            for k, s in enumerate(slots):
                s[...] = p.kv[:, :, k * BIG_CHUNK : (k + 1) * BIG_CHUNK].view(s.dtype)
        wait_store_idle(srv)  # in the tier too: nothing of it is held for L2
        probe = c.link.stored_chunks
        probes = []

        def probe_then_pressure(*args, **kwargs):
            found = probe(*args, **kwargs)
            probes.append(found)
            other.store(q.tokens, q.kv)  # needs every slot of L1: evicts whatever nobody has locked
            return found

        monkeypatch.setattr(c.link, "stored_chunks", probe_then_pressure)
        got = c.retrieve(p.tokens)
        assert probes == [head], "the retrieve did not lock a short run, then probe the tiers"
        assert got.shape[2] == head * BIG_CHUNK, f"the retrieve locked {head} chunks, then got {got.shape[2] // BIG_CHUNK}"
        assert_prefix_bytes(got, p, head * BIG_CHUNK)
        c.ping()
        wait_store_idle(srv)  # the push of q to the tier holds leases of its own until then
        assert srv.status()["leases"] == 0  # the first lock was released too (behind, after the second)
