"""A model whose layers mix sliding-window and full attention (Gemma 2 and 3, gpt-oss), through the
kvdepot connector: one real engine and a real server.

The connector does not take vLLM's hybrid KV-cache manager, so vLLM allocates every layer's blocks as
full attention (the sliding-window layers still attend over their window only) and frees none while a
request runs: one KV-cache group, whose chunks hold every layer's KV at every position. Once vLLM's own
prefix cache is emptied, a hit from kvdepot must give the cold run's tokens. (A model whose every layer
slides is refused at start: vLLM frees the blocks that leave its window while a save may still read them.)
"""

from __future__ import annotations

import pytest

from kvdepot.bench.engines.vllm_engines import Engine, connector_config, expected_hit, make_prompts, make_tiny_sliding_model, require_vllm

pytestmark = pytest.mark.timeout(600)

WINDOW = 128
PROMPT_LEN = 5 * 128 + 40  # prompts longer than the window: the window layers' early KV is still saved and loaded
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory):
    require_vllm()
    return make_tiny_sliding_model(tmp_path_factory.mktemp("tiny-gemma2"), window=WINDOW)


def test_a_mixed_sliding_window_model_hits_with_the_same_tokens(sliding_model, server, workdir):
    prompts = make_prompts(seed=61, lengths=[PROMPT_LEN])
    with Engine(sliding_model, connector_config(server.url), workdir, name="swa-cold") as cold_engine:
        cold = cold_engine.generate(prompts, MAX_TOKENS)["outputs"][0]
        cold_engine.call({"op": "reset_prefix_cache"})
        hit = cold_engine.generate(prompts, MAX_TOKENS)["outputs"][0]
    assert cold["num_cached_tokens"] == 0
    assert hit["num_cached_tokens"] == expected_hit(PROMPT_LEN)
    assert hit["token_ids"] == cold["token_ids"]
    st = server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0 and st["l1"]["objects"] >= PROMPT_LEN // 128
