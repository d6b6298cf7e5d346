"""Real SGLang (CPU, bfloat16, SGLang's default prefetch policy ``timeout``) with kvdepot as its HiCache
L3, following SGLang's own storage-backend test: a 768-token prompt, ``POST /flush_cache``, the same
prompt again served from L3 with the same greedy output. Then SGLang restarted, kvdepot restarted (its
fs tier keeps the pages), runtime detach/attach, kvdepot stalled (SIGSTOP) inside SGLang's prefetch
budget, and kvdepot killed under a running SGLang. The tests run in order on one SGLang."""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from kvdepot.bench.engines.sglang_engines import PAGE, SGLangServer, backend_config, storage_tokens
from kvdepot.bench.engines.vllm_engines import FIRST_WORD, VOCAB

from support.servers import never, pause, wait_until

PROMPT_TOKENS = 768  # 12 pages; SGLang always computes the last token, so 11 pages can come from L3
FROM_L3 = (PROMPT_TOKENS - 1) // PAGE * PAGE
ADMIN_KEY = "kvdepot-e2e-admin"


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def sglang(server, sglang_model, workdir):
    s = SGLangServer(
        sglang_model.path, workdir, extra=backend_config(server.url, retry_after_s=2.0), admin_api_key=ADMIN_KEY
    ).start()
    yield s
    s.stop()


def stored_pages(server) -> int:
    return server.status()["l1"]["objects"]


def cold_then_l3(sglang, server, tokens: list[int]) -> tuple[dict, dict]:
    """Serve ``tokens`` cold, wait for its pages to reach kvdepot, flush SGLang's own tiers, serve again."""
    before = stored_pages(server)
    cold = sglang.generate(tokens)
    assert storage_tokens(cold) == 0
    wait_until(lambda: stored_pages(server) >= before + PROMPT_TOKENS // PAGE, timeout_s=60, what="SGLang's backup of the prompt")
    sglang.flush_cache()
    return cold, sglang.generate(tokens)


def test_a_flushed_prompt_comes_back_from_kvdepot_with_the_same_output(sglang, server):
    cold, hit = cold_then_l3(sglang, server, prompt(1))
    details = hit["meta_info"]["cached_tokens_details"]
    assert details["storage"] == FROM_L3 and details["storage_backend"] == "KVDepotHiCacheStorage", details
    assert hit["meta_info"]["cached_tokens"] > 700
    assert hit["output_ids"] == cold["output_ids"]
    status = server.status()
    assert status["errors"] == {} or not any(status["errors"].values()), status["errors"]
    assert status["leases"] == 0, "a lease outlived SGLang's reads and writes"
    assert status["lookups"]["hit_tokens"] >= FROM_L3  # the server counted the hit too
    log = sglang.log_text()
    assert "HiCache storage query failed" not in log and "HiCache backup failed" not in log
    # the backend says at INFO what SGLang asked for and what it loaded
    assert f"{FROM_L3 // PAGE} stored" in log and f"loaded {FROM_L3 // PAGE} of {FROM_L3 // PAGE} pages ({FROM_L3} tokens)" in log, log[-3000:]
    # ... and which of SGLang's settings it read from SGLang itself (they set each call's deadline)
    assert "prefetch policy timeout (budget 1 s + 0.25 s per 1,024 tokens), io backend direct, from SGLang's configuration" in log


def test_a_restarted_sglang_and_a_restarted_kvdepot_still_hit(sglang, server):
    tokens = prompt(2)
    cold, _ = cold_then_l3(sglang, server, tokens)
    # A new SGLang process (nothing of it survives) on the same kvdepot: L3 hit from kvdepot's L1.
    sglang.stop()
    sglang.start()
    again = sglang.generate(tokens)
    assert storage_tokens(again) == FROM_L3 and again["output_ids"] == cold["output_ids"]
    # kvdepot restarted (its L1 is gone, its fs tier is not) under the running SGLang.
    server.restart()
    sglang.flush_cache()
    after = sglang.generate(tokens)
    assert storage_tokens(after) == FROM_L3, after["meta_info"]
    assert after["output_ids"] == cold["output_ids"]


def test_detach_and_attach_at_run_time(sglang, server):
    r = sglang.admin("DELETE", "/hicache/storage-backend")  # SGLang 0.5.23's runtime detach
    assert r.status_code == 200, r.text
    before = stored_pages(server)
    tokens = prompt(3)
    cold = sglang.generate(tokens)
    never(lambda: stored_pages(server) != before, within_s=3, what="a page reaching kvdepot while it was detached")
    sglang.flush_cache()  # (waits out any backup still pending)
    assert stored_pages(server) == before, "pages reached kvdepot while it was detached"
    assert storage_tokens(sglang.generate(tokens)) == 0
    body = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config_json": sglang.extra_json(),
            "hicache_storage_prefetch_policy": sglang.prefetch_policy}  # fmt: skip
    r = sglang.admin("PUT", "/hicache/storage-backend", body)  # ... and attach
    assert r.status_code == 200, r.text
    sglang.flush_cache()
    _, hit = cold_then_l3(sglang, server, prompt(4))
    assert storage_tokens(hit) == FROM_L3
    assert sglang.generate(tokens)["output_ids"] == cold["output_ids"]


def sglang_budget_s(pages: int) -> float:
    """SGLang 0.5.23's prefetch budget for ``pages`` (policy timeout, its default keys)."""
    return 1.0 + pages * PAGE / 1024 * 0.25


def back_from_l3(sglang, tokens: list[int]) -> dict:
    """The next requests once kvdepot is usable again (after ``retry_after_s``): served from L3."""

    def from_l3() -> dict | None:
        sglang.flush_cache()
        r = sglang.generate(tokens)
        return r if storage_tokens(r) == FROM_L3 else None

    return wait_until(from_l3, timeout_s=60, interval_s=1.0, what="SGLang hitting kvdepot again")


def test_a_stalled_kvdepot_is_a_miss_inside_sglangs_prefetch_budget(sglang, server):
    """kvdepot alive, connected and silent (SIGSTOP): the request is served by recompute, the backend's
    lookup gave up inside the budget SGLang gives the prefetch (so SGLang never waited on kvdepot past
    it, and its prefetch thread was free again), and once kvdepot resumes requests hit again."""
    tokens = prompt(7)
    cold, hit = cold_then_l3(sglang, server, tokens)
    assert storage_tokens(hit) == FROM_L3
    sglang.flush_cache()
    seen = len(sglang.log_text())
    pause(server.proc.proc.pid)
    try:
        miss = sglang.generate(tokens)
        assert storage_tokens(miss) == 0 and miss["output_ids"] == cold["output_ids"]
        failed = re.findall(r"a lookup of (\d+) pages \(ended after (\d+) ms\) failed", sglang.log_text()[seen:])
        assert failed, f"no failed lookup logged while kvdepot was stopped:\n{sglang.log_text()[seen:][-3000:]}"
        pages, ms = map(int, failed[0])
        assert ms / 1000 < sglang_budget_s(pages), f"a lookup of {pages} pages took {ms} ms, past SGLang's budget"
    finally:
        os.kill(server.proc.proc.pid, signal.SIGCONT)
    assert back_from_l3(sglang, tokens)["output_ids"] == cold["output_ids"]
    sglang.check_alive()


def test_kvdepot_killed_under_a_running_sglang(sglang, server):
    tokens = prompt(5)
    cold, hit = cold_then_l3(sglang, server, tokens)
    assert storage_tokens(hit) == FROM_L3
    server.proc.stop(sig=9)
    sglang.flush_cache()
    t0 = time.monotonic()
    miss = sglang.generate(tokens)  # recomputed, not hung
    assert storage_tokens(miss) == 0 and miss["output_ids"] == cold["output_ids"]
    fresh = sglang.generate(prompt(6))
    assert storage_tokens(fresh) == 0
    assert time.monotonic() - t0 < 60, "SGLang stalled on a dead kvdepot"
    # kvdepot back on the same port (its fs tier kept the pages): after retry_after_s SGLang uses it again.
    server.start_again()
    assert back_from_l3(sglang, tokens)["output_ids"] == cold["output_ids"]
    assert "HiCache storage query failed" not in sglang.log_text()  # misses, never exceptions in its threads
    sglang.check_alive()
