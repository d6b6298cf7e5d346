"""The SGLang backend's settings and key mapping, without SGLang (the backend itself is tested against
real SGLang in tests/e2e/sglang)."""

from __future__ import annotations

import hashlib

import pytest

from kvdepot.connectors.sglang.pages import page_hash, supported_layouts
from kvdepot.connectors.sglang.settings import SGLangSettings
from kvdepot.hashing import chunk_hashes

SGLANG_KEYS = {"backend_name": "kvdepot", "module_path": "kvdepot.connectors.sglang", "class_name": "KVDepotHiCacheStorage"}


def test_the_json_a_user_writes_is_accepted_with_sglang_defaults():
    s = SGLangSettings.from_extra({**SGLANG_KEYS, "interface_v1": 1, "url": "tcp://10.0.0.5:5555"})
    assert s.interface_v1 == 1 and s.url == "tcp://10.0.0.5:5555"
    assert s.timeout_s == 2.0 and s.budget_share == 0.4  # a call's deadline: see test_sglang_runtime.py
    assert SGLangSettings.from_extra({"interface_v1": "1"}).interface_v1 == 1  # strings as SGLang's CLI may pass them


@pytest.mark.parametrize(
    "extra, words",
    [({"urll": "x"}, ["unknown", "'urll'"]), ({"interface_v1": 2}, ["interface_v1"]), ({"url": "http://x"}, ["url"]), ({"timeout_s": 0}, ["timeout_s"])],
)
def test_a_bad_key_or_value_is_named(extra, words):
    with pytest.raises(ValueError) as err:
        SGLangSettings.from_extra({**SGLANG_KEYS, **extra})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_sglang_page_keys_map_to_chunk_hashes_unchanged():
    tokens = list(range(3, 3 + 128))
    hashes = chunk_hashes(tokens, 64)
    assert [page_hash(h.hex()) for h in hashes] == hashes  # SGLang's keys are these hex strings
    other = page_hash("not-a-sha256-key.mamba")  # another key scheme still names exactly one object
    assert other == hashlib.sha256(b"not-a-sha256-key.mamba").digest() and len(other) == 32


def test_supported_layouts():
    assert supported_layouts(mla=False) == ["layer_first", "page_first", "page_first_direct", "page_head"]
    assert supported_layouts(mla=True) == ["layer_first", "page_first", "page_first_direct"]
