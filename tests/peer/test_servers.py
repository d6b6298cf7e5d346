"""kvdepot servers with a ``peer`` tier: what one server stored, every other server serves.

Three real ``kvdepot server`` processes, each with ``--l2 'peer:...'`` (the first is the cluster's head),
as the README's "Running a cluster" starts them. A prompt stored through server A's engine client comes
back, bit for bit, through server C's: C's LOOKUP finds the chunks in the directory, its prefetch pulls
them from A's pool into C's L1, and C's client retrieves them as local hits.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.servers import wait_until
from support.tiers import assert_served_whole, make_prompt, store_full, tier_of, wait_prefetch, wait_store_idle

from kvdepot import KVLayout
from kvdepot.bench.serverproc import free_port

SECRET = "servers-test-secret"
FAST = "heartbeat_interval_s=0.3,member_ttl_s=1.5,control_timeout_s=0.5,metrics_port=0"


def peer_spec(port: int, discovery: str = "", name: str = "peers") -> str:
    spec = f"peer:name={name},port={port},data_port=0,pool_size_mb=32,secret={SECRET},{FAST}"
    return spec + (f",discovery={discovery}" if discovery else "")


@pytest.fixture
def cluster(make_server):
    ports = [free_port() for _ in range(3)]
    head = f"127.0.0.1:{ports[0]}"
    servers = [make_server("--l2", peer_spec(ports[0]), name="peer-a")]
    servers += [make_server("--l2", peer_spec(p, head), name=f"peer-{n}") for p, n in zip(ports[1:], "bc", strict=True)]
    return servers


def test_three_servers_share_what_each_stored_every_way(cluster, seed):
    a, b, c = cluster
    prompts = [make_prompt(3, seed + i) for i in range(len(cluster))]
    for srv, p in zip(cluster, prompts, strict=True):
        with srv.client() as client:
            store_full(client, p)
        status = wait_store_idle(srv)
        assert tier_of(status, "peers")["objects"] == 3  # in this server's published pool
    for reader in cluster:
        with reader.client() as client:
            for writer, p in zip(cluster, prompts, strict=True):
                if writer is reader:
                    continue
                # Membership spreads within a heartbeat or two: the first lookups may still miss.
                wait_until(lambda p=p: client.lookup(p.tokens) == p.n_tokens, timeout_s=15, what="the other server's chunks")
                assert_served_whole(client, p)
        t = tier_of(reader.status(), "peers")
        assert (t["healthy"], t["loaded"], t["corrupt"]) == (True, 6, 0), t


def test_a_server_that_dies_takes_only_its_own_chunks_along(cluster, seed):
    a, b, c = cluster
    pa, pb = make_prompt(2, seed), make_prompt(2, seed + 1)
    with a.client() as client:
        store_full(client, pa)
    with b.client() as client:
        store_full(client, pb)
    wait_store_idle(a)
    wait_store_idle(b)
    with c.client() as client:
        wait_until(lambda: client.lookup(pb.tokens) == pb.n_tokens, timeout_s=15, what="b's chunks on c")
    c.clear()  # c's L1 forgets; only the peers hold the chunks now
    b.proc.proc.kill()
    b.proc.proc.wait(10)
    with c.client() as client:
        wait_until(lambda: client.lookup(pa.tokens) == pa.n_tokens, timeout_s=15, what="a's chunks on c after b died")
        assert_served_whole(client, pa)
        assert client.lookup(pb.tokens) == 0  # b's chunks went with b: a clean miss
        assert client.retrieve(pb.tokens).shape[2] == 0
    assert tier_of(c.status(), "peers")["healthy"]


BIG = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128)  # 32 KiB a token: 512 KiB a 16-token chunk


def big_prompt(seed: int, chunks: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 50_000, chunks * 16, dtype=np.int64)
    return tokens, rng.standard_normal(BIG.chunk_shape(len(tokens))).astype(np.float16)


def lookup_with(client, tokens, session: str, **hints) -> int:
    reply = client.lookup_reply(client.hashes(tokens), session_id=session, **hints)
    hits = reply.hits if reply.hits is not None else wait_prefetch(client, session)
    client.end_session(session)
    return hits


def test_the_server_path_takes_a_routers_hint_and_skips_pulls_that_would_lose(cluster, seed):
    """LOOKUP carries the engine's prefill rate and a router's hint to the peer tier: with no estimate
    yet it pulls (and learns the peer's bandwidth); then a pull slower than recomputing is skipped (a
    miss), one faster is made, and a hint names the node asked first. /status counts each decision."""
    a, b, c = cluster
    prompts = [big_prompt(seed + i) for i in range(4)]
    with a.client(layout=BIG) as client:
        for tokens, kv in prompts:
            assert client.store(tokens, kv) == len(tokens)
    wait_store_idle(a)
    a_node = tier_of(a.status(), "peers")["details"]["node"]
    with b.client(layout=BIG) as client:
        (t0, kv0), (t1, _), (t2, kv2), (t3, _) = prompts
        wait_until(lambda: lookup_with(client, t0, "learn", prefill_tokens_per_s=1e12) == 4, timeout_s=15, what="a's chunks on b")
        assert np.array_equal(client.retrieve(t0), kv0)
        assert lookup_with(client, t1, "skip", prefill_tokens_per_s=1e12) == 0  # recomputing 64 tokens: ~0 s
        assert lookup_with(client, t2, "pull", prefill_tokens_per_s=1.0) == 4  # a minute to recompute: pull
        assert np.array_equal(client.retrieve(t2), kv2)
        assert lookup_with(client, t3, "hinted", source_hint=a_node) == 4
    details = tier_of(b.status(), "peers")["details"]
    decisions = details["pull_decisions"]
    assert decisions.get("pull/no_estimate", 0) >= 1 and decisions["recompute/pull_slower"] == 1 and decisions["pull/pull_faster"] == 1, decisions
    assert details["hints"]["found"] == 4, details["hints"]
    assert details["peers"][a_node]["bandwidth_bytes_per_s"] > 0
    assert set(details["publish"]) == {"owed", "repaid", "unpublish_owed", "unpublish_dropped"} and details["publish"]["owed"] >= 0


def test_a_prefill_rate_that_is_not_a_number_is_unknown_and_never_refuses_a_pull(cluster, seed):
    """0 or less says the engine does not know its prefill rate, and the pull goes ahead; NaN (what a
    rate computed as 0/0 by numpy comes to) knows no more. It was weighed as a recompute time of NaN
    seconds, which no estimate ever beats: once the peer had an estimate, every pull was refused
    ("recompute/pull_slower") and the engine recomputed KV that was a round trip away."""
    a, b, _ = cluster
    (t0, kv0), (t1, kv1) = prompts = [big_prompt(seed + i) for i in range(2)]
    with a.client(layout=BIG) as client:
        for tokens, kv in prompts:
            assert client.store(tokens, kv) == len(tokens)
    wait_store_idle(a)
    a_node = tier_of(a.status(), "peers")["details"]["node"]
    with b.client(layout=BIG) as client:
        wait_until(lambda: lookup_with(client, t0, "learn", prefill_tokens_per_s=1e12) == 4, timeout_s=15, what="a's chunks on b")
        assert np.array_equal(client.retrieve(t0), kv0)
        assert tier_of(b.status(), "peers")["details"]["peers"][a_node]["bandwidth_bytes_per_s"] > 0  # an estimate to weigh against
        assert lookup_with(client, t1, "nan", prefill_tokens_per_s=float("nan")) == 4
        assert np.array_equal(client.retrieve(t1), kv1)
    decisions = tier_of(b.status(), "peers")["details"]["pull_decisions"]
    assert not any(d.startswith("recompute/") for d in decisions), decisions


def test_a_peer_tier_that_joined_no_cluster_is_reported_down_until_it_joins(make_server):
    """A discovery head that does not answer (not there yet, or the secret differs): the tier serves this
    server's own pages only, shared with nobody, and /status, /healthcheck and /metrics say so (they said
    healthy); once the head answers, it joins and is healthy again, with no request needed."""
    import httpx

    head_port = free_port()
    head = f"127.0.0.1:{head_port}"
    b = make_server("--l2", peer_spec(free_port(), head) + ",join_timeout_s=0.5", name="peer-b")
    c = make_server("--l2", peer_spec(free_port(), head).replace(SECRET, "another-secret") + ",join_timeout_s=0.5", name="peer-c")
    for srv in (b, c):
        t = wait_until(lambda srv=srv: (t := tier_of(srv.status(), "peers")) and not t["healthy"] and t, timeout_s=10,
                       what="the tier reported down")  # fmt: skip
        assert head in t["last_error"], t
        assert httpx.get(f"{srv.http}/healthcheck", timeout=5).json()["status"] == "degraded"
        assert srv.metric("kvdepot_l2_healthy", tier="peers") == 0.0
    make_server("--l2", peer_spec(head_port), name="peer-a")
    wait_until(lambda: tier_of(b.status(), "peers")["healthy"], timeout_s=15, what="the tier healthy once joined")
    assert httpx.get(f"{b.http}/healthcheck", timeout=5).json()["status"] == "ok"
    assert not tier_of(c.status(), "peers")["healthy"]  # its secret is still wrong
