"""Runs inside .venv-sglang (real SGLang): drives SGLang's own storage paths over kvdepot without an
SGLang server, and prints one JSON object of findings for the test in the main venv to check.

    python inproc_worker.py SCENARIO URL [ARGS_JSON]

What is SGLang's and what is ours here: the device and host KV pools are SGLang's
(``MHATokenToKVPool`` + ``MHATokenToKVPoolHost``, ``MLATokenToKVPool`` + ``MLATokenToKVPoolHost``), the
backend is built by SGLang's ``StorageBackendFactory`` from the extra-config JSON, page keys come from
SGLang's ``get_storage_hash_str``, and pages move through HiCacheController's own page functions
(``_page_set_zero_copy`` / ``_generic_page_set`` / ``_page_get_zero_copy`` / ``_generic_page_get``),
called on a minimal controller holding only what they read (the backend, the host pool, the page size).
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvdepot.bench.engines.sglang_engines import PAGE, backend_config  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 2, 2, 64
MLA_RANK, MLA_ROPE = 64, 16
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def host_pool(kind: str, layout: str, dtype: str):
    if kind == "mla":
        dev = MLATokenToKVPool(1024, PAGE, DTYPES[dtype], MLA_RANK, MLA_ROPE, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
        return MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
            device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, target_layer_num=LAYERS,
        )
    dev = MHATokenToKVPool(1024, PAGE, DTYPES[dtype], HEADS, HEAD_DIM, LAYERS, "cpu", False, v_head_dim=HEAD_DIM, start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
        device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS, write_back_staging=dev.hicache_write_back_staging,
    )


def backend(url: str, host, *, interface_v1: int = 1, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model: str = "inproc-model",
            pp_rank: int = 0, pp_size: int = 1, **more):  # fmt: skip
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=host.layout != "layer_first", model_name=model,
        extra_config=backend_config(url, interface_v1, **more),
    )
    b = StorageBackendFactory.create_backend("dynamic", config, host)
    b.register_mem_pool_host(host)
    return b


def controller(b, host) -> SimpleNamespace:
    """What HiCacheController's page functions read of ``self``."""
    return SimpleNamespace(storage_backend=b, storage_host_pool=host, page_size=PAGE)


def page_set(b, host, keys, indices, interface_v1: int) -> bool:
    fn = HiCacheController._page_set_zero_copy if interface_v1 else HiCacheController._generic_page_set
    return bool(fn(controller(b, host), keys, indices))


def page_get(b, host, keys, indices, interface_v1: int) -> int:
    fn = HiCacheController._page_get_zero_copy if interface_v1 else HiCacheController._generic_page_get
    op = SimpleNamespace(request_id="inproc", is_terminated=lambda: False)
    return int(fn(controller(b, host), op, keys, indices))


def fill_random(host, indices: torch.Tensor, seed: int) -> None:
    """Random bits in every page at ``indices`` (NaN patterns included: only a byte-exact copy matches)."""
    g = torch.Generator().manual_seed(seed)
    for start in indices[::PAGE].tolist():
        page = host.get_data_page(start, flat=False).view(torch.uint8)  # the last axis is contiguous
        page.copy_(torch.randint(0, 256, page.shape, generator=g, dtype=torch.uint8))


def canonical_pages(b, host, indices: torch.Tensor) -> list[bytes]:
    """Each page's bytes in kvdepot's chunk order (so pools of different layouts compare)."""
    return [b.codec.host_page(s).tobytes() for s in indices[::PAGE].tolist()]


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g).tolist()


def roundtrip(url: str, kind: str, layout: str, dtype: str, interface_v1: int, seed: int) -> dict:
    """Store 4 pages from one host pool, read them into other slots of a second pool of the same
    geometry, and compare byte for byte; also repeat the store (a no-op) and time nothing."""
    host = host_pool(kind, layout, dtype)
    b = backend(url, host, interface_v1=interface_v1, mla=kind == "mla", model=f"inproc-{kind}-{dtype}")
    keys = get_storage_hash_str(tokens(4 * PAGE, seed), None, page_size=PAGE)
    src = torch.arange(0, 4 * PAGE, dtype=torch.int64)
    dst = torch.arange(8 * PAGE, 12 * PAGE, dtype=torch.int64)
    fill_random(host, src, seed)
    stored = page_set(b, host, keys, src, interface_v1)
    exists = b.batch_exists(keys)
    again = page_set(b, host, keys, src, interface_v1)
    got = page_get(b, host, keys, dst, interface_v1)
    same = canonical_pages(b, host, src) == canonical_pages(b, host, dst)
    # A pool of another layout of the same model reads the same objects (kvdepot's chunk is layout-free).
    other_layout = {"layer_first": "page_first", "page_first": "layer_first", "page_first_direct": "layer_first", "page_head": "layer_first"}[layout]
    host2 = host_pool(kind, other_layout, dtype)
    b2 = backend(url, host2, interface_v1=interface_v1, mla=kind == "mla", model=f"inproc-{kind}-{dtype}")
    got2 = page_get(b2, host2, keys, dst, interface_v1)
    cross = canonical_pages(b, host, src) == canonical_pages(b2, host2, dst)
    # Another model never meets these pages.
    b3 = backend(url, host, interface_v1=interface_v1, mla=kind == "mla", model="another-model")
    foreign = b3.batch_exists(keys)
    partial = b.batch_exists(keys[:2] + get_storage_hash_str(tokens(2 * PAGE, seed + 1), keys[1], page_size=PAGE))
    for x in (b, b2, b3):
        x.close()
    return {
        "stored": stored, "exists": exists, "again": again, "got": got, "same": same, "other_layout": other_layout,
        "got_other_layout": got2, "same_other_layout": cross, "foreign": foreign, "partial": partial,
        "failures": b.failures(),
    }


def scenario_roundtrips(url: str, args: dict) -> dict:
    out = {}
    for i, (kind, layout, dtype, v1) in enumerate(args["cases"]):
        out[f"{kind}/{layout}/{dtype}/v{v1}"] = roundtrip(url, kind, layout, dtype, v1, seed=100 + i)
    return out


def scenario_hashes(url: str, args: dict) -> dict:
    """SGLang's page keys next to kvdepot's chunk hashes of the same tokens, and one chunk stored by a
    plain KVClient (as the vLLM connector stores it) read back through SGLang's page path."""
    import numpy as np

    from kvdepot import ClientOptions, KVClient, KVLayout
    from kvdepot.hashing import chunk_hashes

    toks = tokens(4 * PAGE, 7)
    sglang_keys = get_storage_hash_str(toks, None, page_size=PAGE)
    ours = [h.hex() for h in chunk_hashes(toks, PAGE)]
    host = host_pool("mha", "layer_first", "bfloat16")
    b = backend(url, host, model="shared-model")
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, dtype="bfloat16")
    kv = np.random.default_rng(3).integers(0, 2**16, size=layout.chunk_shape(4 * PAGE), dtype=np.uint16)
    with KVClient(url, "shared-model", layout, options=ClientOptions(chunk_size=PAGE)) as c:
        c.store(toks, kv, raw=True)
    dst = torch.arange(4 * PAGE, 8 * PAGE, dtype=torch.int64)
    got = page_get(b, host, sglang_keys, dst, 1)
    read = np.concatenate([b.codec.host_page(s) for s in dst[::PAGE].tolist()], axis=2)
    b.close()
    return {"sglang": sglang_keys, "kvdepot": ours, "got": got, "same_bytes": bool(np.array_equal(read, kv))}


def scenario_dead(url: str, args: dict) -> dict:
    """A kvdepot that is not there (or stops answering): every call answers at once, as a miss."""
    host = host_pool("mha", "layer_first", "bfloat16")
    b = backend(url, host, timeout_s=args.get("timeout_s", 0.5), retry_after_s=args.get("retry_after_s", 5.0))
    keys = get_storage_hash_str(tokens(4 * PAGE, 9), None, page_size=PAGE)
    idx = torch.arange(0, 4 * PAGE, dtype=torch.int64)
    out = {}
    for name, call in (
        ("exists", lambda: b.batch_exists(keys)),
        ("get_v1", lambda: b.batch_get_v1(keys, idx)),
        ("set_v1", lambda: b.batch_set_v1(keys, idx)),
        ("get", lambda: b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])),
        ("set", lambda: b.batch_set(keys, [host.get_data_page(0) for _ in keys])),
        ("exists_again", lambda: b.batch_exists(keys)),
    ):
        t0 = time.monotonic()
        try:
            value = call()
            out[name] = {"value": [v if isinstance(v, (bool, int)) or v is None else "tensor" for v in value] if isinstance(value, list) else value,
                         "seconds": time.monotonic() - t0}
        except Exception as exc:  # the test fails on this
            out[name] = {"raised": repr(exc), "seconds": time.monotonic() - t0}
    out["failures"] = b.failures()
    b.close()
    return out


def scenario_config_errors(url: str, args: dict) -> dict:
    """What a user's typo or an unsupported set-up does: a clear error at SGLang's start-up, naming it."""
    out = {}
    host = host_pool("mha", "layer_first", "bfloat16")
    for name, target, more in (("unknown_key", url, {"urll": "x"}), ("bad_url", "http://nope", {}), ("chunk_size", url, {"chunk_size": 128})):
        try:
            backend(target, host, **more)
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def scenario_mla_replicas(url: str, args: dict) -> dict:
    """MLA: every TP rank holds the same latent; only SGLang's designated writer stores it, and every
    rank reads the one copy."""
    host = host_pool("mla", "layer_first", "bfloat16")
    keys = get_storage_hash_str(tokens(2 * PAGE, 21), None, page_size=PAGE)
    src = torch.arange(0, 2 * PAGE, dtype=torch.int64)
    fill_random(host, src, 21)
    reader = backend(url, host, mla=True, tp_rank=1, tp_size=2, model="mla-tp2")
    skipped = reader.batch_set_v1(keys, src)
    before = reader.batch_exists(keys)
    writer = backend(url, host, mla=True, tp_rank=0, tp_size=2, model="mla-tp2")
    stored = writer.batch_set_v1(keys, src)
    after = reader.batch_exists(keys)
    for x in (reader, writer):
        x.close()
    return {"non_writer_set": skipped, "before": before, "writer_set": stored, "after": after}


def wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP is delivered asynchronously: wait until every thread of ``pid`` is really stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise RuntimeError(f"process {pid} did not stop")


def scenario_stalled(url: str, args: dict) -> dict:
    """A kvdepot that stops answering (SIGSTOP: alive, connected, silent): lookups and loads are misses
    inside SGLang's prefetch budget for them (the backend's default ``timeout_s``, 2 s, is longer than
    that budget here), saves within ``timeout_s``, then at once while the breaker is open; after SIGCONT
    and ``retry_after_s`` (3 s) the pages are there again."""
    import signal

    host = host_pool("mha", "layer_first", "bfloat16")
    b = backend(url, host, model="stalled-model", retry_after_s=3.0)
    keys = get_storage_hash_str(tokens(2 * PAGE, 31), None, page_size=PAGE)
    idx = torch.arange(0, 2 * PAGE, dtype=torch.int64)
    fill_random(host, idx, 31)
    out = {"stored": b.batch_set_v1(keys, idx), "budget_s": b.runtime.prefetch_budget_s(2 * PAGE, PAGE), "deadline_s": b.deadline_s(2)}
    out["timeout_s"] = b.settings.timeout_s
    os.kill(args["pid"], signal.SIGSTOP)
    wait_stopped(args["pid"])
    try:
        for name, call in (("exists", lambda: b.batch_exists(keys)), ("get_v1", lambda: b.batch_get_v1(keys, idx + 4 * PAGE)),
                           ("set_v1", lambda: b.batch_set_v1(keys, idx)), ("exists_again", lambda: b.batch_exists(keys))):  # fmt: skip
            t0 = time.monotonic()
            try:
                out[name] = {"value": call(), "seconds": time.monotonic() - t0}
            except Exception as exc:  # the test fails on this
                out[name] = {"raised": repr(exc), "seconds": time.monotonic() - t0}
    finally:
        os.kill(args["pid"], signal.SIGCONT)
    time.sleep(b.settings.retry_after_s + 0.5)  # the lookup direction's breaker lets a probe through again
    out["after"] = b.batch_exists(keys)
    out["failures"] = b.failures()
    b.close()
    return out


def scenario_whatif_attention(url: str, args: dict) -> dict:
    """The benchmark's what-if attention (``sglang_probe``, new queries only) against SGLang's own
    ``torch_native`` extend on the same batch: two requests, one with a cached prefix, grouped heads."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from kvdepot.bench.engines.sglang_probe import _new_queries_only

    class WhatIf(TorchNativeAttnBackend):
        pass

    _new_queries_only(WhatIf)
    gen = torch.Generator().manual_seed(5)
    prefix, new = torch.tensor([128, 0]), torch.tensor([64, 40])
    seq = prefix + new
    heads, kv_heads, dim, slots = 8, 4, 32, 512
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(2))
    req_to_token = torch.zeros(2, 256, dtype=torch.int64)
    req_to_token[0, : seq[0]] = torch.randperm(slots, generator=gen)[: seq[0]]
    req_to_token[1, : seq[1]] = torch.randperm(slots, generator=gen)[: seq[1]]
    query = torch.randn(int(new.sum()), heads, dim, generator=gen)
    backend = object.__new__(TorchNativeAttnBackend)
    outs = {}
    for name, fn in (("sglang", TorchNativeAttnBackend._run_sdpa_forward_extend), ("whatif", WhatIf._run_sdpa_forward_extend)):
        outs[name] = fn(backend, query, torch.zeros_like(query), k_cache, v_cache, req_to_token, torch.tensor([0, 1]), seq, prefix, new,
                        scaling=dim**-0.5, enable_gqa=True, causal=True)  # fmt: skip
    return {"max_abs_diff": float((outs["sglang"] - outs["whatif"]).abs().max()), "patched": WhatIf._run_sdpa_forward_extend
            is not TorchNativeAttnBackend._run_sdpa_forward_extend}  # fmt: skip


def peer_backend(host, extra: dict, model: str = "inproc-peer", interface_v1: int = 1, pp_rank: int = 0, pp_size: int = 1):
    """SGLang's loader building kvdepot's peer-tier backend (no kvdepot server: a peer node in this process)."""
    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=host.layout != "layer_first", model_name=model,
        extra_config={"backend_name": "kvdepot-peer", "module_path": "kvdepot.connectors.sglang.peer_backend",
                      "class_name": "PeerHiCacheStorage", "interface_v1": interface_v1, **extra},
    )
    b = StorageBackendFactory.create_backend("dynamic", config, host)
    b.register_mem_pool_host(host)
    return b


def scenario_peer(url: str, args: dict) -> dict:
    """Two peer nodes in one process (as two SGLang processes would be): pages A's SGLang backs up are
    read by B's, from A's pool over the data plane, in each layout and interface."""
    fast = {"secret": "inproc-peer", "heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "pool_size_mb": 16, "metrics_port": 0}
    out = {}
    for i, (layout, v1) in enumerate([("layer_first", 1), ("page_first", 1), ("layer_first", 0)]):
        host_a, host_b = host_pool("mha", layout, "bfloat16"), host_pool("mha", layout, "bfloat16")
        a = peer_backend(host_a, fast, interface_v1=v1)
        b = peer_backend(host_b, {**fast, "discovery": a.store.node_id}, interface_v1=v1)
        other = peer_backend(host_b, {**fast, "discovery": a.store.node_id}, model="another-model", interface_v1=v1)
        deadline = time.monotonic() + 10
        while len(b.store.status()["members"]) < 3 or len(a.store.status()["members"]) < 3:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        keys = get_storage_hash_str(tokens(4 * PAGE, 500 + i), None, page_size=PAGE)
        src = torch.arange(0, 4 * PAGE, dtype=torch.int64)
        dst = torch.arange(8 * PAGE, 12 * PAGE, dtype=torch.int64)
        fill_random(host_a, src, 500 + i)
        stored = page_set(a, host_a, keys, src, v1)
        out[f"{layout}/v{v1}"] = {
            "members": len(b.store.status()["members"]),
            "stored": stored,
            "exists": b.batch_exists(keys),
            "got": page_get(b, host_b, keys, dst, v1),
            "same": canonical_pages(a, host_a, src) == canonical_pages(b, host_b, dst),
            "foreign": other.batch_exists(keys),
            "partial": b.batch_exists(keys[:2] + get_storage_hash_str(tokens(2 * PAGE, 900 + i), keys[1], page_size=PAGE)),
            "from_a": a.store.node_id, "b": b.store.node_id,
            "failures": a.failures + b.failures,
        }
        for x in (other, b, a):
            x.close()
    return out


def scenario_pipeline_stages(url: str, args: dict) -> dict:
    """Two pipeline stages of one model, the same number of layers each: the same page keys and layout,
    other layers' bytes. Neither stage reads the other's pages, over a server or the peer tier."""
    host = host_pool("mha", "layer_first", "bfloat16")
    keys = get_storage_hash_str(tokens(2 * PAGE, 31), None, page_size=PAGE)
    src = torch.arange(0, 2 * PAGE, dtype=torch.int64)
    fill_random(host, src, 31)
    first, second = (backend(url, host, model="stages", pp_rank=r, pp_size=2) for r in (0, 1))
    out = {"server": {"stored": first.batch_set_v1(keys, src), "first": first.batch_exists(keys), "second": second.batch_exists(keys)}}
    for x in (first, second):
        x.close()
    fast = {"secret": "inproc-stages", "heartbeat_interval_s": 0.3, "member_ttl_s": 1.5, "pool_size_mb": 16, "metrics_port": 0}
    a = peer_backend(host, fast, model="stages", pp_rank=0, pp_size=2)
    b = peer_backend(host_pool("mha", "layer_first", "bfloat16"), {**fast, "discovery": a.store.node_id}, model="stages", pp_rank=1, pp_size=2)
    same = peer_backend(host_pool("mha", "layer_first", "bfloat16"), {**fast, "discovery": a.store.node_id}, model="stages", pp_rank=0, pp_size=2)
    deadline = time.monotonic() + 10
    while len(b.store.status()["members"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    out["peer"] = {"stored": page_set(a, host, keys, src, 1), "same_stage": same.batch_exists(keys), "other_stage": b.batch_exists(keys)}
    for x in (same, b, a):
        x.close()
    return out


def scenario_all(url: str, args: dict) -> dict:
    """Every scenario in one process (SGLang's imports take seconds): the dead one against ``dead_url``."""
    out = {name: fn(url, args) for name, fn in SCENARIOS.items() if name not in ("all", "dead", "stalled")}
    out["dead"] = scenario_dead(args["dead_url"], args)
    out["stalled"] = scenario_stalled(url, args)  # last: it stops the server for a moment
    return out


SCENARIOS = {
    "roundtrips": scenario_roundtrips,
    "hashes": scenario_hashes,
    "dead": scenario_dead,
    "config_errors": scenario_config_errors,
    "mla_replicas": scenario_mla_replicas,
    "pipeline_stages": scenario_pipeline_stages,
    "stalled": scenario_stalled,
    "whatif_attention": scenario_whatif_attention,
    "peer": scenario_peer,
    "all": scenario_all,
}

if __name__ == "__main__":
    name, url = sys.argv[1], sys.argv[2]
    args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    result = SCENARIOS[name](url, args)
    print("RESULT " + json.dumps(result, default=str))
