"""Requests whose KV is shaped by more than their token ids, through the kvdepot connector: one real
engine (``enable_lora``, ``enable_prompt_embeds``) and a real server.

- A LoRA request's KV is stored under its adapter (``connectors/vllm/adapters.py``): the same prompt
  under the base model, another adapter, or the same adapter's weights under another name and path is
  told apart by the keys, so no request is ever handed KV that another adapter computed.
- A prompt of embeddings (all its token ids 0) is stored under its rows (``connectors/vllm/embeds.py``).

vLLM's own prefix cache is reset before each request, so every cached token came from kvdepot. Greedy
decoding: a load is right exactly when the tokens match the cold run's.
"""

from __future__ import annotations

import shutil

import pytest

from kvdepot.bench.engines.vllm_engines import LORA_RANK, Engine, connector_config, expected_hit, make_prompts, make_tiny_lora

pytestmark = pytest.mark.timeout(600)

PROMPT_LEN = 3 * 128 + 40  # three complete chunks
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    x = make_tiny_lora(root / "x", "x", 1, seed=1)
    shutil.copytree(x.path, root / "x-copy")
    y = make_tiny_lora(root / "y", "y", 2, seed=2)
    return x, x.named("x-copy", 3, str(root / "x-copy")), y


@pytest.fixture(scope="module")
def engine(tiny_model, server, workdir):
    kinds = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 2, "max_cpu_loras": 3, "enable_prompt_embeds": True}
    with Engine(tiny_model, connector_config(server.url), workdir, name="kinds", llm_kwargs=kinds) as e:
        yield e


def one(engine: Engine, prompt: list[int], lora=None) -> dict:
    """vLLM's own prefix cache emptied, then ``prompt`` alone."""
    engine.call({"op": "reset_prefix_cache"})
    return engine.generate([prompt], MAX_TOKENS, lora=lora)["outputs"][0]


def test_each_adapter_reads_only_its_own_kv(engine, adapters, server):
    """Runs first: a LoRA request never reads the base model's chunks, so the server starts empty."""
    x, x_copy, y = adapters
    (prompt,) = make_prompts(seed=31, lengths=[PROMPT_LEN])

    cold = one(engine, prompt, x)
    assert cold["num_cached_tokens"] == 0
    stored = server.status()["l1"]["objects"]
    assert stored >= PROMPT_LEN // 128

    base = one(engine, prompt)  # the base model: none of x's chunks are its
    assert base["num_cached_tokens"] == 0
    assert base["token_ids"] != cold["token_ids"]  # the adapter changes what the prompt computes

    again = one(engine, prompt, x_copy)  # x's weights under another name and path: x's KV
    assert again["num_cached_tokens"] == expected_hit(PROMPT_LEN)
    assert again["token_ids"] == cold["token_ids"]

    other = one(engine, prompt, y)
    assert other["num_cached_tokens"] == 0
    assert other["token_ids"] != cold["token_ids"]

    base_again = one(engine, prompt)  # the base model's own chunks, saved by its first request
    assert base_again["num_cached_tokens"] == expected_hit(PROMPT_LEN)
    assert base_again["token_ids"] == base["token_ids"]
    st = server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0


def test_a_prompt_of_embeddings_reads_only_the_kv_of_its_rows(engine, server):
    def embedded(seed: int) -> dict:
        engine.call({"op": "reset_prefix_cache"})
        return engine.generate_embedded(seed, PROMPT_LEN, MAX_TOKENS)["outputs"][0]

    cold = embedded(seed=7)
    assert cold["num_cached_tokens"] == 0
    again = embedded(seed=7)
    assert again["num_cached_tokens"] == expected_hit(PROMPT_LEN)
    assert again["token_ids"] == cold["token_ids"]
    other = embedded(seed=8)  # other rows, the same token ids (zeros): nothing of seed 7's
    assert other["num_cached_tokens"] == 0
    assert other["token_ids"] != cold["token_ids"]
    st = server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0
