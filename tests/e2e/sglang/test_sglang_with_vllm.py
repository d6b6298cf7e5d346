"""An SGLang engine and a vLLM engine on one kvdepot server at the same time: each stores and hits its
own pages, neither sees the other's (different models: different objects), and neither slows the other
into errors."""

from __future__ import annotations

import random
import threading

from support.servers import wait_until
from support.sglang_engines import PAGE, SGLangServer, backend_config, storage_tokens
from support.vllm_engines import BLOCK, FIRST_WORD, VOCAB, Engine, connector_config, expected_hit, make_prompts


def test_sglang_and_vllm_side_by_side(server, sglang_model, tiny_model, workdir):
    rng = random.Random(11)
    sg_prompts = [[rng.randrange(FIRST_WORD, VOCAB) for _ in range(768)] for _ in range(3)]
    vl_prompts = make_prompts(seed=12, lengths=[1000, 700, 1200])
    with Engine(tiny_model, connector_config(server.url), workdir, name="vllm-beside-sglang") as vllm:
        sglang = SGLangServer(sglang_model.path, workdir, name="sglang-beside-vllm", extra=backend_config(server.url)).start()
        try:
            cold_sg: list[dict] = []

            def run_sglang() -> None:
                for p in sg_prompts:
                    cold_sg.append(sglang.generate(p))

            t = threading.Thread(target=run_sglang)
            t.start()
            cold_vl = [vllm.one(p) for p in vl_prompts]  # both engines store at once
            t.join()
            assert len(cold_sg) == 3
            wait_until(lambda: server.status()["l1"]["objects"] >= 3 * 12 + 21, timeout_s=60, what="both engines' saves")
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
            # Each engine's prompts through the other model never hit: SGLang sends vLLM's prompt.
            sglang.flush_cache()
            assert storage_tokens(sglang.generate(vl_prompts[0][:768])) == 0
            status = server.status()
            assert status["leases"] == 0
            assert "HiCache storage query failed" not in sglang.log_text() and "HiCache backup failed" not in sglang.log_text()
        finally:
            sglang.stop()
