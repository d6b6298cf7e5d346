"""SGLang's own settings as the backend reads them (``connectors.sglang.runtime``), without SGLang: the
prefetch budget a call must end inside, and the settings that keep L3 hits from working. (Inside a real
SGLang the same values come from its published configuration: tests/e2e/sglang.)"""

from __future__ import annotations

import json

import pytest

from kvdepot.connectors.sglang.runtime import SGLangRuntime, _budget_keys


def test_the_budget_is_sglangs_for_the_installed_version():
    rt = SGLangRuntime()  # SGLang 0.5.23's defaults: policy timeout, 1 s + 0.25 s per 1,024 tokens
    assert rt.prefetch_policy == "timeout"
    assert rt.prefetch_budget_s(4096, 64) == pytest.approx(2.0)
    assert rt.prefetch_budget_s(1000, 64) == pytest.approx(1.0 + 15 * 64 / 1024 * 0.25)  # whole pages only
    assert rt.prefetch_budget_s(0, 64) == pytest.approx(1.0)


def test_a_call_gets_its_share_of_the_budget_and_never_more_than_timeout_s():
    rt = SGLangRuntime()
    assert rt.call_deadline_s(4096, 64, share=0.4, timeout_s=2.0) == pytest.approx(0.8)
    assert rt.call_deadline_s(64, 64, share=0.4, timeout_s=2.0) < 1.0 * 0.5  # a short prompt: under half its 1 s budget
    assert rt.call_deadline_s(1 << 20, 64, share=0.4, timeout_s=2.0) == 2.0  # a long one: timeout_s caps it
    for tokens in (64, 1024, 8192, 65536):  # always inside the budget, whatever the prompt
        assert rt.call_deadline_s(tokens, 64, 0.4, 2.0) < rt.prefetch_budget_s(tokens, 64)


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort"])
def test_without_a_budget_timeout_s_is_the_deadline(policy):
    rt = SGLangRuntime(prefetch_policy=policy)
    assert rt.call_deadline_s(4096, 64, 0.4, 2.0) == 2.0
    assert rt.prefetch_budget_s(4096, 64) == (None if policy == "wait_complete" else 0.0)


def test_budget_keys_from_the_backend_settings_replace_what_was_read():
    rt = SGLangRuntime().with_budget(3.0, None)
    assert (rt.timeout_base_s, rt.timeout_per_ki_token_s) == (3.0, 0.25)
    assert SGLangRuntime().with_budget(None, None) == SGLangRuntime()


def test_budget_keys_are_read_from_sglangs_extra_config_as_sglang_reads_it(tmp_path):
    assert _budget_keys(None) == (1.0, 0.25, "")
    assert _budget_keys(json.dumps({"prefetch_timeout_base": 4, "url": "tcp://x:1"})) == (4.0, 0.25, "")
    assert _budget_keys({"prefetch_timeout_per_ki_token": 0.5}) == (1.0, 0.5, "")
    (tmp_path / "c.json").write_text(json.dumps({"prefetch_timeout_base": 2.5}))
    (tmp_path / "c.toml").write_text("prefetch_timeout_per_ki_token = 1.5\n")
    assert _budget_keys(f"@{tmp_path / 'c.json'}") == (2.5, 0.25, "")
    assert _budget_keys(f"@{tmp_path / 'c.toml'}") == (1.0, 1.5, "")
    base, per_ki, why = _budget_keys(f"@{tmp_path / 'missing.json'}")  # SGLang itself fails on this; we say so and assume defaults
    assert (base, per_ki) == (1.0, 0.25) and "unreadable" in why
    assert "unreadable" in _budget_keys("{not json")[2]


def test_settings_that_load_nothing_are_named_with_their_flag():
    assert SGLangRuntime().problems() == []  # the defaults, device unknown
    best_effort = SGLangRuntime(prefetch_policy="best_effort").problems()
    assert len(best_effort) == 1 and "--hicache-storage-prefetch-policy best_effort" in best_effort[0]
    kernel_cpu = SGLangRuntime(io_backend="kernel", device="cpu").problems()
    assert len(kernel_cpu) == 1 and "--hicache-io-backend direct" in kernel_cpu[0]
    assert SGLangRuntime(io_backend="kernel", device="cuda").problems() == []
    assert SGLangRuntime(io_backend="direct", device="cpu", prefetch_policy="wait_complete").problems() == []


def test_outside_sglang_the_defaults_are_used_and_the_reason_kept():
    rt = SGLangRuntime.read()  # the main venv has no SGLang
    assert rt.prefetch_policy == "timeout" and rt.source.startswith("SGLang 0.5.23")
    assert rt.notes and "not importable" in rt.notes[0]
    assert "budget 1 s + 0.25 s per 1,024 tokens" in rt.describe()
