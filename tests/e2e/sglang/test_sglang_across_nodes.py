"""Two SGLang servers on two hosts (network namespaces on a bridge), each with kvdepot's peer-tier
backend (``PeerHiCacheStorage``: no kvdepot server; each SGLang process is a node). Host A serves a prompt
and backs its pages up into its pool; host B, which never saw it, serves the same prompt with its prefix
read from host A's pool (SGLang's L3 hit) and the same greedy output."""

from __future__ import annotations

import os

import httpx

from kvdepot.bench.engines.sglang_engines import PAGE, SGLangServer, storage_tokens

from support import netns
from support.servers import wait_until

from .test_sglang_e2e import FROM_L3, prompt

SECRET = "sglang-across-nodes"


def peer_backend(address: str, discovery: str = "") -> dict:
    return {
        "backend_name": "kvdepot-peer", "module_path": "kvdepot.connectors.sglang.peer_backend", "class_name": "PeerHiCacheStorage",
        "interface_v1": 1, "host": address, "port": 31995, "data_port": 31996, "metrics_port": 31997, "secret": SECRET,
        "heartbeat_interval_s": 0.5, "member_ttl_s": 3.0, "pool_size_mb": 128, **({"discovery": discovery} if discovery else {}),
    }  # fmt: skip


def test_host_b_reads_the_pages_host_a_backed_up(sglang_model, workdir):
    why = netns.available()
    assert not why, f"network namespaces are needed: {why}"
    net = netns.Network(subnet=(os.getpid() % 200) + 20)
    engines: list[SGLangServer] = []
    try:
        ns_a, addr_a = net.add_host(1)
        ns_b, addr_b = net.add_host(2)
        a = SGLangServer(sglang_model.path, workdir, name="sglang-host-a", extra=peer_backend(addr_a), host=addr_a, port=30000,
                         prefix=["ip", "netns", "exec", ns_a])  # fmt: skip
        engines.append(a.start())
        b = SGLangServer(sglang_model.path, workdir, name="sglang-host-b", extra=peer_backend(addr_b, f"{addr_a}:31995"), host=addr_b,
                         port=30000, prefix=["ip", "netns", "exec", ns_b])  # fmt: skip
        engines.append(b.start())
        # A first request on each: SGLang JIT-builds its page hasher on first use (once per venv, tens of
        # seconds on a fresh one), and a request's prefetch that waits for that build times out before it
        # looks anything up. Go on once B's prefetch thread has looked its warm-up prompt up.
        a.generate(prompt(29, 300))
        b.generate(prompt(30, 300))
        wait_until(lambda: "SGLang looked up" in b.log_text(), timeout_s=240, what="host B's first L3 lookup (after SGLang's hasher build)")

        def written() -> float:
            text = httpx.get(f"http://{addr_a}:31997/metrics", timeout=5).text
            line = next((x for x in text.splitlines() if x.startswith('kvdepot_peer_writes_total{outcome="stored"}')), "")
            return float(line.split()[-1]) if line else 0.0

        wait_until(lambda: written() >= 300 // PAGE, timeout_s=120, what="host A's backup of the warm-up prompt")
        before = written()
        tokens = prompt(31)
        cold = a.generate(tokens)
        assert storage_tokens(cold) == 0
        # A's backup thread writes the prompt's pages into A's pool (its metrics page counts them).
        wait_until(lambda: written() >= before + FROM_L3 // PAGE, timeout_s=60, what="host A's backup of the prompt into its pool")
        hit = b.generate(tokens)
        details = hit["meta_info"]["cached_tokens_details"]
        assert details["storage"] == FROM_L3 and details["storage_backend"] == "PeerHiCacheStorage", details
        assert hit["output_ids"] == cold["output_ids"]
        log = b.log_text()
        assert f"loaded {FROM_L3 // PAGE} of {FROM_L3 // PAGE} pages from the peer cluster" in log, log[-3000:]
        print(f"\nSGLang across nodes: cold {cold['seconds']:.3f}s, hit from host A's pool {hit['seconds']:.3f}s")
    finally:
        for e in engines:
            e.stop()
        net.close()
