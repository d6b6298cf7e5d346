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


def test_the_model_identity_keeps_shards_and_fp8_variants_apart(caplog):
    """What keeps pages of incompatible bytes apart beyond the layout's fingerprint, over a server and
    the peer tier alike: the pipeline stage and context-parallel ranks (other layers or tokens under the
    same page keys), and the KV's own dtype where the pool holds bytes (fp8_e4m3 and fp8_e5m2 are both
    uint8); a byte pool whose dtype nobody can tell is said in the log."""
    from types import SimpleNamespace as NS

    from kvdepot.connectors.sglang.pages import model_identity
    from kvdepot.layout import KVLayout

    def config(pp_rank=0, pp_size=1, cp_rank=0, cp_size=1, dcp_rank=0, dcp_size=1):
        return NS(pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=cp_rank, attn_cp_size=cp_size, dcp_rank=dcp_rank, dcp_size=dcp_size)

    def codec(dtype="bfloat16", logical=""):
        return NS(layout=KVLayout(4, 2, 64, dtype=dtype), logical_dtype=logical)

    one = model_identity("m", config(), codec())
    assert one == "m"
    stages = {model_identity("m", config(pp_rank=r, pp_size=2), codec()) for r in (0, 1)}
    cps = {model_identity("m", config(cp_rank=r, cp_size=2), codec()) for r in (0, 1)}
    dcps = {model_identity("m", config(dcp_rank=r, dcp_size=2), codec()) for r in (0, 1)}
    assert len(stages | cps | dcps | {one}) == 7
    fp8 = {model_identity("m", config(), codec("uint8"), kv) for kv in ("fp8_e4m3", "fp8_e5m2")}
    assert fp8 == {"m|kv:fp8_e4m3", "m|kv:fp8_e5m2"}
    assert model_identity("m", config(), codec("uint8", logical="float8_e5m2"), "fp8_e4m3") == "m|kv:float8_e5m2"  # the pool's own word first
    assert model_identity("m", config(), codec(), "fp8_e4m3") == "m"  # a pool of the KV's own dtype needs nothing more
    caplog.clear()
    assert model_identity("m", config(), codec("uint8")) == "m"
    assert "fp8_e4m3 and fp8_e5m2 deployments never share pages" in caplog.text


def test_pages_start_where_sglangs_whole_pages_do():
    """Under decode context parallelism a rank's page holds part of SGLang's page, while SGLang's host
    indices count whole pages: each page starts a whole page on, not a rank's part."""
    import torch

    from kvdepot.connectors.sglang.pages import PageCodec
    from kvdepot.layout import KVLayout

    def codec(page_size, step):
        return PageCodec(None, KVLayout(2, 1, 64, dtype="bfloat16", use_mla=True), page_size, "lpt", (), (), True, index_step=step)

    indices = torch.arange(1000, 1256)
    assert codec(32, 64).page_starts(indices, 3) == [1000, 1064, 1128]  # dcp 2: a rank's page is half of SGLang's
    assert codec(64, 0).page_starts(indices, 3) == [1000, 1064, 1128]
    with pytest.raises(ValueError):
        codec(32, 64).page_starts(indices, 5)  # 5 whole pages need 320 indices
