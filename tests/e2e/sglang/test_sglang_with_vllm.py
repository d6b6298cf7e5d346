"""SGLang and vLLM engines on one kvdepot server at the same time.

- Different models: each engine stores and hits its own pages, neither sees the other's, and neither
  slows the other into errors.
- The same model, named alike, with SGLang's page = vLLM's chunk (128 tokens), the same KV layout
  (float32 here) and vLLM's ``cpu_kv_layout="shared"``: a prefix computed by one engine is loaded by the
  other. The page keys and chunk hashes agree, and so do the objects.
"""

from __future__ import annotations

import random
import threading

import pytest

from kvdepot.bench.engines.sglang_engines import PAGE, SGLangServer, backend_config, storage_tokens
from kvdepot.bench.engines.vllm_engines import BLOCK, FIRST_WORD, MODEL_NAME, VOCAB, Engine, connector_config, expected_hit, make_prompts

from support.servers import wait_until


@pytest.fixture(scope="module")
def vllm(server, tiny_model, workdir):
    # cpu_kv_layout=shared: per-token K/V, the objects SGLang reads (the default, native, is vLLM's own layout)
    with Engine(tiny_model, connector_config(server.url, cpu_kv_layout="shared"), workdir, name="vllm-beside-sglang") as engine:
        yield engine


def test_sglang_and_vllm_side_by_side(server, sglang_model, vllm, workdir):
    rng = random.Random(11)
    sg_prompts = [[rng.randrange(FIRST_WORD, VOCAB) for _ in range(768)] for _ in range(3)]
    vl_prompts = make_prompts(seed=12, lengths=[1000, 700, 1200])
    objects_before = server.status()["l1"]["objects"]
    sglang = SGLangServer(sglang_model.path, workdir, name="sglang-beside-vllm", extra=backend_config(server.url)).start()
    try:
        cold_sg: list[dict] = []
        t = threading.Thread(target=lambda: cold_sg.extend(sglang.generate(p) for p in sg_prompts))
        t.start()
        cold_vl = [vllm.one(p) for p in vl_prompts]  # both engines store at once
        t.join()
        assert len(cold_sg) == 3
        vllm_chunks = sum(len(p) // BLOCK for p in vl_prompts)
        wait_until(lambda: server.status()["l1"]["objects"] >= objects_before + 3 * 768 // PAGE + vllm_chunks, timeout_s=60,
                   what="both engines' saves")  # fmt: skip
        sglang.flush_cache()

        hits_sg: list[dict] = []
        t = threading.Thread(target=lambda: hits_sg.extend(sglang.generate(p) for p in sg_prompts))
        t.start()
        hits_vl = [vllm.one(p) for p in vl_prompts]  # vLLM's own prefix cache is reset before each
        t.join()
        for cold, hit in zip(cold_sg, hits_sg):
            assert storage_tokens(hit) == (768 - 1) // PAGE * PAGE
            assert hit["output_ids"] == cold["output_ids"]
        for p, cold, hit in zip(vl_prompts, cold_vl, hits_vl):
            assert hit["num_cached_tokens"] == expected_hit(len(p), BLOCK)
            assert hit["token_ids"] == cold["token_ids"]
        # Another model's pages are never served: SGLang sends the start of vLLM's prompt.
        sglang.flush_cache()
        assert storage_tokens(sglang.generate(vl_prompts[0][:768])) == 0
        # nothing leaked (the L2 push of the last pages may still hold its read lease for a moment)
        assert server.wait_status(lambda st: st["leases"] == 0)["leases"] == 0
        log = sglang.log_text()
        assert "HiCache storage query failed" not in log and "HiCache backup failed" not in log
    finally:
        sglang.stop()


def test_one_model_in_both_engines_shares_the_same_objects(server, tiny_model, vllm, workdir):
    sglang = SGLangServer(
        tiny_model.path, workdir, name="sglang-same-model", dtype="float32", page_size=BLOCK,
        extra=backend_config(server.url, model_name=MODEL_NAME),
    ).start()  # fmt: skip
    try:
        by_vllm, by_sglang = make_prompts(seed=21, lengths=[1000, 900])
        # vLLM computes a prompt; SGLang, which never saw it, loads vLLM's chunks as its pages.
        cold_vl = vllm.one(by_vllm)
        from_vllm = wait_until(lambda: sglang_from_l3(sglang, by_vllm), timeout_s=60, interval_s=1.0, what="vLLM's chunks, in SGLang")
        # SGLang computes a prompt; vLLM, which never saw it, loads SGLang's pages as its chunks.
        cold_sg = sglang.generate(by_sglang, max_new_tokens=4)
        assert storage_tokens(cold_sg) == 0
        want = expected_hit(len(by_sglang), BLOCK)
        from_sglang = wait_until(lambda: vllm_hit(vllm, by_sglang, want), timeout_s=60, interval_s=1.0, what="SGLang's pages, in vLLM")
        # Same model, same float32 KV: greedy tokens agree whichever engine computed the prefix.
        assert from_vllm["output_ids"][:4] == cold_vl["token_ids"][:4]
        assert from_sglang["token_ids"][:4] == cold_sg["output_ids"][:4]
    finally:
        sglang.stop()


def sglang_from_l3(sglang: SGLangServer, tokens: list[int]) -> dict | None:
    """Flush SGLang's own tiers and send ``tokens``: its reply once every complete page came from kvdepot."""
    sglang.flush_cache()
    r = sglang.generate(tokens, max_new_tokens=4)
    return r if storage_tokens(r) == (len(tokens) - 1) // BLOCK * BLOCK else None


def vllm_hit(vllm: Engine, tokens: list[int], want: int) -> dict | None:
    r = vllm.one(tokens)
    return r if r["num_cached_tokens"] == want else None
