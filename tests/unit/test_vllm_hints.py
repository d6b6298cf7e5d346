"""The vLLM connector's lookup hints: a router's source from kv_transfer_params, the measured prefill rate."""

from __future__ import annotations

import pytest

from kvdepot.connectors.vllm.hints import MIN_PREFILL_TOKENS, PrefillRate, agent_session, source_hint


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (None, ""),
        ({}, ""),
        ({"kv_cache_source": "10.0.0.5:8000"}, "10.0.0.5:8000"),  # llm-d's x-kv-cache-source-host-port, passed along
        ({"kv_cache_source_host_port": "10.0.0.5:8000"}, "10.0.0.5:8000"),
        ({"remote_host": "10.0.0.7", "remote_port": 5600}, "10.0.0.7:5600"),  # what P/D routers set for the decode side
        ({"remote_host": "10.0.0.7"}, "10.0.0.7"),
        ({"do_remote_prefill": True}, ""),
    ],
)
def test_source_hint_from_kv_transfer_params(params, want):
    assert source_hint(params) == want


@pytest.mark.parametrize(
    ("params", "want"),
    [
        (None, ""),
        ({}, ""),
        ({"kvdepot_agent_session": "conv-42"}, "conv-42"),
        ({"kvdepot_agent_session": 42}, ""),  # not a name: no session rather than a failed lookup
        ({"kvdepot_agent_session": "x" * 257}, ""),  # longer than the server accepts
    ],
)
def test_agent_session_from_kv_transfer_params(params, want):
    assert agent_session(params) == want


def test_prefill_rate_is_learned_from_prefill_steps_only():
    rate = PrefillRate()
    rate.step(4096, now=0.0)
    assert rate.tokens_per_s == 0.0  # one step: nothing to time yet
    rate.step(8, now=1.0)  # the 4096-token step took 1 s
    assert rate.tokens_per_s == pytest.approx(4096.0)
    rate.step(2048, now=1.01)  # the decode step before it says nothing about prefill
    assert rate.tokens_per_s == pytest.approx(4096.0)
    rate.step(0, now=1.51)  # 2048 tokens in 0.5 s: 4096/s again, averaged in
    assert rate.tokens_per_s == pytest.approx(4096.0)
    rate.step(MIN_PREFILL_TOKENS, now=2.0)
    rate.step(0, now=100.0)  # 98 s after it: an idle engine, not a slow step
    assert rate.tokens_per_s == pytest.approx(4096.0)
