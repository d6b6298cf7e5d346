"""SGLang's own storage paths over a real kvdepot server, without an SGLang server (fast): the backend
built by SGLang's loader, real host pools in every layout kvdepot holds, SGLang's page keys, and
HiCacheController's page functions (``inproc_worker.py``). One worker process runs every scenario."""

from __future__ import annotations

import pytest

from kvdepot.bench.engines.sglang_engines import run_inproc

from support.servers import free_port

CASES = [
    ["mha", "layer_first", "bfloat16", 1],
    ["mha", "layer_first", "bfloat16", 0],
    ["mha", "page_first", "bfloat16", 1],
    ["mha", "page_first_direct", "float16", 1],
    ["mha", "page_head", "float32", 0],
    ["mla", "layer_first", "bfloat16", 1],
    ["mla", "page_first", "bfloat16", 0],
    ["mla", "page_first_direct", "bfloat16", 1],
]


@pytest.fixture(scope="module")
def found(server):
    args = {"cases": CASES, "dead_url": f"tcp://127.0.0.1:{free_port()}", "timeout_s": 0.5, "pid": server.proc.proc.pid}
    return run_inproc(server.url, "all", args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "/".join(map(str, c)))
def test_pages_round_trip_byte_exact_in_every_layout(found, case):
    r = found["roundtrips"]["{}/{}/{}/v{}".format(*case)]
    assert r["stored"] is True and r["again"] is True  # a repeated write is a successful no-op
    assert r["exists"] == 4 and r["got"] == 4
    assert r["same"], "the pages read back differ from those stored"
    # another host layout of the same model reads the same objects, byte for byte
    assert r["got_other_layout"] == 4 and r["same_other_layout"], r
    assert r["foreign"] == 0, "another model's backend saw these pages"
    assert r["partial"] == 2  # leading pages only
    assert r["failures"] == {}


def test_sglang_page_keys_are_kvdepot_chunk_hashes(found):
    """Same tokens, same hashes: a chunk stored by a plain KVClient (as vLLM's connector stores it,
    chunk = page = 64 tokens, same model name and layout) is the page SGLang reads."""
    h = found["hashes"]
    assert h["sglang"] == h["kvdepot"] and len(h["sglang"]) == 4
    assert h["got"] == 4 and h["same_bytes"]


def test_a_missing_kvdepot_is_a_fast_miss_and_never_an_exception(found):
    d = found["dead"]
    for name in ("exists", "get_v1", "set_v1", "get", "set", "exists_again"):
        assert "raised" not in d[name], d[name]
        assert d[name]["seconds"] < 5.0, f"{name} took {d[name]['seconds']:.1f}s (SGLang gives up on a prefetch after 1 s + ...)"
    assert d["exists"]["value"] == 0 and d["exists_again"]["value"] == 0
    assert d["get_v1"]["value"] == [False] * 4 and d["set_v1"]["value"] == [False] * 4
    assert d["get"]["value"] == [None] * 4 and d["set"]["value"] is False
    assert d["failures"] == {"connect/transport": 1}  # then the breaker answers without trying


def test_a_silent_kvdepot_is_a_miss_within_the_timeout_and_is_used_again_once_back(found):
    s = found["stalled"]
    assert s["stored"] == [True, True]
    # SGLang's budget for a 2-page prefetch (1 s + 0.25 s per 1,024 tokens) is under the backend's timeout_s
    assert s["deadline_s"] < s["budget_s"] < s["timeout_s"]
    for name in ("exists", "get_v1", "set_v1", "exists_again"):
        assert "raised" not in s[name], s[name]
    for name in ("exists", "get_v1"):  # reads end inside the budget SGLang gives them, not at timeout_s
        assert s[name]["seconds"] < s["budget_s"], f"{name} took {s[name]['seconds']:.2f} s on a stopped server, past SGLang's budget"
    assert s["set_v1"]["seconds"] < s["timeout_s"] + 1.0  # a backup has no budget: timeout_s bounds it
    assert s["exists"]["value"] == 0 and s["get_v1"]["value"] == [False, False] and s["set_v1"]["value"] == [False, False]
    assert s["exists_again"]["value"] == 0 and s["exists_again"]["seconds"] < 0.1  # the breaker answers
    assert s["failures"].get("lookup/transport", 0) >= 1
    assert s["after"] == 2, "the pages were lost, or kvdepot was not used again after retry_after_s"


def test_misconfiguration_fails_sglang_start_with_the_reason(found):
    c = found["config_errors"]
    assert "unknown kvdepot SGLang backend option" in c["unknown_key"] and "'urll'" in c["unknown_key"]
    assert "url" in c["bad_url"] and "http://nope" in c["bad_url"]
    assert "one page (64 tokens)" in c["chunk_size"]


def test_mla_is_written_once_and_read_by_every_rank(found):
    m = found["mla_replicas"]
    assert m["non_writer_set"] == [True, True] and m["before"] == 0  # a non-writer rank stores nothing
    assert m["writer_set"] == [True, True] and m["after"] == 2  # ... and reads the writer's copy


def test_pipeline_stages_never_read_each_others_pages(found):
    """Stages of one model hold other layers under the same page keys: over a kvdepot server and over
    the peer tier, a stage finds its own pages (the same stage on another node too), never another's."""
    server, peer = found["pipeline_stages"]["server"], found["pipeline_stages"]["peer"]
    assert server["stored"] == [True, True] and server["first"] == 2 and server["second"] == 0, server
    assert peer["stored"] and peer["same_stage"] == 2 and peer["other_stage"] == 0, peer


def test_the_benchmarks_what_if_attention_gives_sglangs_outputs(found):
    """``benchmarks/sglang_ttft.py --attention new-queries`` times hits with SGLang's CPU extend computed
    for the new queries only: the same numbers as SGLang's own, or its figures would not mean anything."""
    w = found["whatif_attention"]
    assert w["patched"] and w["max_abs_diff"] < 1e-5, w


@pytest.mark.parametrize("case", ["layer_first/v1", "page_first/v1", "layer_first/v0"])
def test_sglang_over_the_peer_tier_reads_another_nodes_pages(found, case):
    """No kvdepot server: SGLang's backend is a peer node; what node A's SGLang backed up, node B's
    SGLang reads from A's pool, byte for byte, in both host layouts and both interfaces."""
    r = found["peer"][case]
    assert r["members"] == 3 and r["from_a"] != r["b"]
    assert r["stored"] is True and r["exists"] == 4 and r["got"] == 4
    assert r["same"], "the pages B read differ from those A stored"
    assert r["foreign"] == 0, "another model's backend saw these pages"
    assert r["partial"] == 2
    assert r["failures"] == 0
