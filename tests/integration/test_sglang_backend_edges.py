"""Edges of the SGLang HiCache backends that SGLang meets in production, driven in process against a real
kvdepot server (no SGLang server: too slow). SGLang itself lives in .venv-sglang; where it is not
importable here, a stand-in of the two things the backends take from it (``hicache_storage``'s base class
and config, as SGLang 0.5.23 defines them) and a layer-first host pool of SGLang's shape are used."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch

from support.servers import pause, wait_until
from support.tiers import start_tier_server, valkey_spec

PAGE = 16
LAYERS, HEADS, HEAD_DIM = 2, 2, 32


def _sglang_stand_in() -> dict[str, types.ModuleType]:
    """``sglang.srt.mem_cache.hicache_storage`` as far as the backends use it."""

    @dataclass
    class HiCacheStorageConfig:
        tp_rank: int
        tp_size: int
        pp_rank: int
        pp_size: int
        attn_cp_rank: int
        attn_cp_size: int
        is_mla_model: bool
        enable_storage_metrics: bool
        is_page_first_layout: bool
        model_name: str | None
        tp_lcm_size: int | None = None
        should_split_heads: bool = False
        dp_rank: int = 0
        extra_config: dict | None = None
        dcp_size: int = 1
        dcp_rank: int = 0
        logical_page_size: int | None = None

        @property
        def is_storage_writer(self) -> bool:
            return not self.is_mla_model or self.tp_rank == self.dcp_rank

    @dataclass
    class HiCacheStorageExtraInfo:
        prefix_keys: list[str] | None = None
        extra_info: dict | None = field(default=None)

    class HiCacheStorage:
        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

    names = ["sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.hicache_storage"]
    modules = {n: types.ModuleType(n) for n in names}
    for parent, child in zip(names, names[1:]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    hs = modules["sglang.srt.mem_cache.hicache_storage"]
    hs.HiCacheStorage, hs.HiCacheStorageConfig, hs.HiCacheStorageExtraInfo = HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
    return modules


@pytest.fixture
def sglang(monkeypatch):
    """SGLang's ``hicache_storage`` module (the real one where importable), with the backend modules
    imported against it (and dropped again afterwards, so no other test sees the stand-in)."""
    try:
        import sglang.srt.mem_cache.hicache_storage as hs  # noqa: F401
    except ImportError:
        for name, module in _sglang_stand_in().items():
            monkeypatch.setitem(sys.modules, name, module)
    for name in ("kvdepot.connectors.sglang.backend", "kvdepot.connectors.sglang.peer_backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield sys.modules["sglang.srt.mem_cache.hicache_storage"]
    for name in ("kvdepot.connectors.sglang.backend", "kvdepot.connectors.sglang.peer_backend"):
        sys.modules.pop(name, None)


class LayerFirstHostPool:
    """SGLang's MHA host pool with ``--hicache-mem-layout layer_first``, as the backends see it."""

    layout = "layer_first"

    def __init__(self, pages: int = 8, dtype: torch.dtype = torch.bfloat16) -> None:
        self.page_size, self.size = PAGE, pages * PAGE
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim, self.dtype = LAYERS, HEADS, HEAD_DIM, HEAD_DIM, dtype
        self.kv_buffer = torch.zeros((2, LAYERS, self.size, HEADS, HEAD_DIM), dtype=dtype)

    def get_data_page(self, index, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size, :, :]
        return page.flatten() if flat else page


def sglang_keys(tokens: list[int], prior: str | None = None) -> list[str]:
    """SGLang's page keys: a sha256 chain over each page's token ids (uint32, little-endian)."""
    keys = []
    for i in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        digest = hashlib.sha256(bytes.fromhex(prior) if prior else b"")
        digest.update(b"".join(t.to_bytes(4, "little") for t in tokens[i : i + PAGE]))
        prior = digest.hexdigest()
        keys.append(prior)
    return keys


def make_backend(sglang, url: str, host=None, *, model: str = "edges-model", **extra):
    from kvdepot.connectors.sglang.backend import KVDepotHiCacheStorage

    config = sglang.HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=False, model_name=model,
        extra_config={"backend_name": "kvdepot", "module_path": "kvdepot.connectors.sglang", "class_name": "KVDepotHiCacheStorage",
                      "interface_v1": 1, "url": url, **extra},
    )  # fmt: skip
    b = KVDepotHiCacheStorage(config)
    if host is not None:
        b.register_mem_pool_host(host)
    return b


def test_sglangs_own_file_storage_path_key_does_not_fail_the_start(sglang, server):
    """With ``--file-storage-path`` set (a launch script shared with the file backend), SGLang adds
    ``file_storage_path`` to every backend's extra-config itself (``unified_radix_cache``); the backend
    must take it as it takes SGLang's other keys, not refuse SGLang's start over a key the user never
    wrote in the JSON."""
    b = make_backend(sglang, server.url, LayerFirstHostPool(), file_storage_path="/tmp/sglang-file-tier")
    try:
        assert b.batch_exists(sglang_keys(list(range(2 * PAGE)))) == 0
    finally:
        b.close()
    from kvdepot.connectors.sglang.peer_backend import split_settings

    own, _ = split_settings({"backend_name": "kvdepot-peer", "file_storage_path": "/tmp/sglang-file-tier"})
    assert own.backend_name == "kvdepot-peer"


def test_a_slow_l2_prefetch_is_that_lookups_miss_and_lookups_of_l1_go_on(sglang, own_valkey, make_server):
    """A prompt whose pages only a hung L2 tier holds misses (SGLang recomputes it); the server itself
    works, so the next lookup, of pages in L1, must hit: the lookup direction must not be switched off
    for ``retry_after_s`` as if kvdepot were unreachable."""
    srv = start_tier_server(
        make_server, valkey_spec(own_valkey.url, name="slow", socket_timeout_s=30),
        chunk=PAGE, extra=("--l2-placement", "skip_l1"),
    )  # fmt: skip
    host = LayerFirstHostPool()
    b = make_backend(sglang, srv.url, host, prefetch_timeout_base=0.5, retry_after_s=30.0)
    try:
        gone, kept = sglang_keys(list(range(3 * PAGE))), sglang_keys(list(range(1000, 1000 + 2 * PAGE)))
        assert b.batch_set_v1(gone, torch.arange(3 * PAGE)) == [True] * 3
        wait_until(lambda: srv.status()["l1"]["objects"] == 0, timeout_s=30)  # only the tier holds them now
        pause(own_valkey.proc.pid)
        try:
            assert b.batch_exists(gone) == 0  # past its share of SGLang's budget: a miss
            assert b.batch_set_v1(kept, torch.arange(2 * PAGE)) == [True] * 2  # skip_l1 keeps these in L1 while the tier hangs
            assert b.batch_exists(kept) == 2, f"lookups were switched off after one slow prefetch: {b.failures()}"
        finally:
            os.kill(own_valkey.proc.pid, signal.SIGCONT)
    finally:
        b.close()



class WideLayerFirstHostPool(LayerFirstHostPool):
    """A layer-first pool with pages of 2 MiB (16 layers x 16 heads x 128 x 16 tokens x K/V x bf16), a
    real model's size: a backup of SGLang's batch of 128 such pages keeps the inline transport busy for
    longer than a lookup's share of SGLang's prefetch budget (0.4 s)."""

    def __init__(self, pages: int) -> None:
        self.page_size, self.size = PAGE, pages * PAGE
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim, self.dtype = 16, 16, 128, 128, torch.bfloat16
        self.kv_buffer = torch.zeros((2, 16, self.size, 16, 128), dtype=torch.bfloat16)


def test_a_backup_in_flight_does_not_switch_lookups_off(sglang, make_server):
    """SGLang's backup thread saves while its prefetch thread looks pages up (one backend, one client,
    whose connection carries one exchange at a time). A lookup that comes while a long save holds the
    connection is a miss inside its budget, as SGLang wants; but kvdepot answered everything, so lookups
    must go on once the save is done, not be switched off for ``retry_after_s`` as if kvdepot were
    unreachable (``Direction``: saves busy on a server do not stop lookups)."""
    import threading
    import time

    srv = make_server("--l1-size-gb", "0.5")
    host = WideLayerFirstHostPool(pages=132)
    # inline: SGLang on another host than kvdepot. Over loopback 256 MiB go in about 0.1 s (a real model's
    # 128 pages are GBs, over a network): the budget is scaled to match, 0.4 x 0.1 s a lookup.
    b = make_backend(sglang, srv.url, host, transport="inline", retry_after_s=60.0, prefetch_timeout_base=0.1,
                     prefetch_timeout_per_ki_token=0.0)  # fmt: skip
    try:
        g = torch.Generator().manual_seed(5)
        host.kv_buffer[:, :, 128 * PAGE :].view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, host.kv_buffer[:, :, 128 * PAGE :].shape, generator=g, dtype=torch.int16)
        )
        hot = sglang_keys(list(range(50_000, 50_000 + 2 * PAGE)))
        assert b.batch_set_v1(hot, torch.arange(128 * PAGE, 130 * PAGE)) == [True] * 2
        assert b.batch_exists(hot) == 2
        big = sglang_keys(list(range(60_000, 60_000 + 128 * PAGE)))  # SGLang's STORAGE_BATCH_SIZE
        saved: list = []
        backup = threading.Thread(target=lambda: saved.append(b.batch_set_v1(big, torch.arange(128 * PAGE))))
        backup.start()
        during = []
        while backup.is_alive():  # SGLang's prefetch thread meanwhile: hits, or misses within its budget
            t0 = time.monotonic()
            during.append((b.batch_exists(hot), time.monotonic() - t0))
        backup.join()
        assert saved == [[True] * 128]
        assert all(s < 0.5 for _, s in during), during
        assert b.batch_exists(hot) == 2, f"lookups were switched off by a save in flight ({during}): {b.failures()}"
        # the bytes read back are the bytes written
        assert b.batch_get_v1(hot, torch.arange(130 * PAGE, 132 * PAGE)) == [True] * 2
        kv = host.kv_buffer.view(torch.int16)  # bits: random bfloat16 holds NaNs
        assert torch.equal(kv[:, :, 128 * PAGE : 130 * PAGE], kv[:, :, 130 * PAGE : 132 * PAGE])
    finally:
        b.close()


def make_peer_backend(sglang, host, *, tp_rank: int = 0, tp_size: int = 1, **extra):
    from kvdepot.connectors.sglang.peer_backend import PeerHiCacheStorage

    config = sglang.HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=False, model_name="edges-peer",
        extra_config={"backend_name": "kvdepot-peer", "module_path": "kvdepot.connectors.sglang.peer_backend",
                      "class_name": "PeerHiCacheStorage", "interface_v1": 1, "metrics_port": 0, "heartbeat_interval_s": 0.3,
                      "member_ttl_s": 1.5, "pool_size_mb": 4, **extra},
    )  # fmt: skip
    b = PeerHiCacheStorage(config)
    b.register_mem_pool_host(host)
    return b


def test_every_tp_rank_of_the_peer_backend_keeps_its_disk_tier(sglang, tmp_path):
    """SGLang hands every TP rank the same extra-config JSON, and every rank is a node of its own. With
    ``disk_path`` set, each rank's node must get a disk tier (its pages evicted from its pool are kept
    there and come back after a restart), not only the first rank that takes the folder, the others
    serving with no disk tier at all after one warning."""
    ranks = []
    try:
        for rank in range(2):
            extra = {"discovery": ranks[0].store.node_id} if ranks else {}
            ranks.append(make_peer_backend(sglang, LayerFirstHostPool(), tp_rank=rank, tp_size=2, disk_path=str(tmp_path / "l4"), **extra))
        assert [b.store.status()["disk"] is not None for b in ranks] == [True, True], "a TP rank runs with no disk tier"
        for rank, b in enumerate(ranks):  # each rank's pages reach its own disk
            keys = sglang_keys(list(range(100 * rank, 100 * rank + 2 * PAGE)))
            assert b.batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
            wait_until(lambda b=b: b.store.status()["disk"]["written"] == 2, timeout_s=10)
    finally:
        for b in reversed(ranks):
            b.close()


def _two_free_ports() -> int:
    """A port P with P and P + 1 both free on loopback."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def test_every_tp_rank_of_the_peer_backend_serves_its_metrics_page(sglang):
    """One JSON for every rank, one ``metrics_port`` in it: every rank tried that port and all but the
    first served no metrics page (a warning each). The first rank serves on it, the next on the port after."""
    from urllib.request import urlopen

    port = _two_free_ports()
    ranks = []
    try:
        for rank in range(2):
            extra = {"discovery": ranks[0].store.node_id} if ranks else {}
            ranks.append(make_peer_backend(sglang, LayerFirstHostPool(), tp_rank=rank, tp_size=2, **{**extra, "metrics_port": port}))
        for rank, b in enumerate(ranks):
            with urlopen(f"http://127.0.0.1:{port + rank}/", timeout=5) as page:
                assert b.store.node_id in page.read().decode(), f"rank {rank}'s metrics page is not its own"
    finally:
        for b in reversed(ranks):
            b.close()


def test_the_peer_backends_lookup_counts_only_the_pages_worth_pulling(sglang):
    """With ``prefill_tokens_per_s``, the load declined other nodes' pages that would take longer to pull
    than to prefill, but the lookup before it counted them: SGLang planned a load that then failed
    ("failed to retrieve page") and recomputed anyway. The lookup weighs them as the load did."""
    a = make_peer_backend(sglang, LayerFirstHostPool())
    b = None
    try:
        b = make_peer_backend(sglang, LayerFirstHostPool(), discovery=a.store.node_id, prefill_tokens_per_s=1e12)
        wait_until(lambda: len(b.store.status()["members"]) == 2, timeout_s=10)
        first, later = sglang_keys(list(range(70_000, 70_000 + 2 * PAGE))), sglang_keys(list(range(80_000, 80_000 + 2 * PAGE)))
        assert a.batch_set_v1(first + later, torch.arange(4 * PAGE)) == [True] * 4
        assert b.batch_exists(first) == 2  # no estimate of a's link yet: pulled
        assert b.batch_get_v1(first, torch.arange(2 * PAGE)) == [True] * 2
        # What a read of pages this small cannot teach (it measures latency): a's link, as a 1 GB/s one.
        b.store.node.planner.read_measured(a.store.node_id, 1 << 30, 1.0)
        assert b.batch_exists(later) == 0  # a prefill of 1e12 tokens/s beats any pull
        assert b.store.status()["pull_decisions"].get("recompute/pull_slower") == 1
        assert a.batch_exists(later) == 2  # its own pages: never weighed
    finally:
        if b is not None:
            b.close()
        a.close()


def test_a_head_given_its_ports_in_the_shared_json_starts_every_rank_as_one_cluster(sglang):
    """The docstring asks a head node for its ports; SGLang gives every rank the same JSON. Every rank
    after the first tried the head's ports and failed to start (and, with no discovery, each would have
    been the head of a cluster of its own). The first rank is the head; the others join it."""
    from kvdepot.bench.serverproc import free_port

    port, data_port = free_port(), free_port()
    ranks = []
    try:
        for rank in range(2):
            ranks.append(make_peer_backend(sglang, LayerFirstHostPool(), tp_rank=rank, tp_size=2, port=port, data_port=data_port))
        assert ranks[0].store.node_id == f"127.0.0.1:{port}"
        wait_until(lambda: all(len(b.store.status()["members"]) == 2 for b in ranks), timeout_s=10)
        keys = sglang_keys(list(range(90_000, 90_000 + 2 * PAGE)))
        assert ranks[1].batch_set_v1(keys, torch.arange(2 * PAGE)) == [True, True]
        assert ranks[0].store.batch_exists(ranks[1]._keys(keys)) == 2  # one cluster: rank 1's pages found from rank 0
    finally:
        for b in reversed(ranks):
            b.close()


def test_every_rank_of_a_pipeline_parallel_engine_gets_its_own_ports(sglang):
    """``metrics_port`` is the first rank's and every other rank's follows it, one per rank; a head's
    ``port`` and ``data_port`` are the first rank's alone. The rank index took each rank kind in turn, but
    dp (whose size SGLang does not give) restarted it from its own rank, dropping the pipeline stage: with
    PP, each stage's first rank took index 0, so it also took the head's ports (and failed to start), and
    every stage's ranks took the first stage's metrics ports (no metrics page, a warning each)."""
    from kvdepot.connectors.sglang.peer_backend import per_rank
    from kvdepot.peer.config import PeerConfig

    node = PeerConfig(metrics_port=9000, port=31000, data_port=31001, disk_path="/kv/l4")
    ports: dict[int, str] = {}
    heads = []
    for dp in range(2):
        for pp in range(2):
            for tp in range(2):
                config = sglang.HiCacheStorageConfig(
                    tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2, attn_cp_rank=0, attn_cp_size=1, dp_rank=dp, is_mla_model=False,
                    enable_storage_metrics=False, is_page_first_layout=False, model_name="m",
                )  # fmt: skip
                mine = per_rank(node, config)
                if mine.port == node.port:
                    heads.append(mine.disk_path)
                assert mine.metrics_port not in ports, f"{mine.disk_path} and {ports.get(mine.metrics_port)} share port {mine.metrics_port}"
                ports[mine.metrics_port] = mine.disk_path
    assert heads == ["/kv/l4/pp0-tp0"], f"ranks given the head's port and data_port: {heads}"
    assert sorted(ports) == list(range(9000, 9008)), ports  # one per rank, from the configured port on
    assert ports[9000] == "/kv/l4/pp0-tp0"  # the first rank keeps the configured port
