"""A kvdepot server restarted under a serving vLLM engine (bfloat16): while it is gone the engine serves
uncached, and once it is back the engine stores and hits again, without a restart of its own.

One engine, its own server (restarted here, so shared with no other module). vLLM's own prefix cache is
emptied before each request, so every cached token came from kvdepot. bf16 greedy tokens are compared
on the first token only (``test_vllm_real_conditions``: later ones may differ with any cache).
"""

from __future__ import annotations

import time

import pytest

from kvdepot.bench.engines.vllm_engines import Engine, connector_config, expected_hit, make_prompts

from support.servers import start_server, stop_server

from .conftest import VLLM_SERVER

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 4
RETRY_S = 0.5  # retry_after_s: how long a failing direction leaves the server alone
TRIES = 12  # requests of the same prompt, a retry interval apart, before giving up on a hit


@pytest.fixture
def own_server(tmp_path):
    s = start_server(tmp_path, "server", ["--log-level", "info"], ipc=False, base=VLLM_SERVER)
    yield s
    stop_server(s)


def test_an_engine_hits_again_once_a_restarted_server_is_back(tiny_model, own_server, workdir):
    seen, fresh, later = make_prompts(seed=71, lengths=[600, 700, 900])
    config = connector_config(own_server.url, timeout_s=1, retry_after_s=RETRY_S)
    with Engine(tiny_model, config, workdir, name="restart-bf16", dtype="bfloat16") as engine:
        assert engine.one(seen, MAX_TOKENS)["num_cached_tokens"] == 0  # connected: a miss, stored
        own_server.stop()
        # The lookup times out: served uncached, lookups off for RETRY_S (the saves fail the same way).
        down = engine.one(fresh, MAX_TOKENS)
        assert down["num_cached_tokens"] == 0 and len(down["token_ids"]) == MAX_TOKENS
        own_server.start_again()
        # The new server holds nothing of before. The engine's next requests probe it, store ``later``
        # and, asked again, hit it.
        outs = []
        for _ in range(TRIES):
            outs.append(engine.one(later, MAX_TOKENS))
            if outs[-1]["num_cached_tokens"]:
                break
            time.sleep(RETRY_S)
        print(f"\nhits after the restart: {[o['num_cached_tokens'] for o in outs]}")
        assert outs[-1]["num_cached_tokens"] == expected_hit(len(later)), "the engine never hit again after the server came back"
        assert outs[-1]["token_ids"][0] == outs[0]["token_ids"][0]
        log = engine.tail(200_000)
    st = own_server.wait_status(lambda s: s["leases"] == 0 and s["sessions"] == 0)
    assert st["leases"] == 0 and st["sessions"] == 0
    assert "Traceback" not in log, log[-3000:]
