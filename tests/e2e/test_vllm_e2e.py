"""vLLM with the kvdepot connector, end to end: real engines in their own processes, one real server.

Greedy decoding throughout, so a load is right exactly when the tokens match the cold run's. Engines
report their hit as ``num_cached_tokens`` (a fresh engine has nothing of its own cached, so all of it
came from kvdepot). Times are printed, never asserted.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.bench.engines.vllm_engines import BLOCK, ApiServer, Engine, connector_config, engine_model_id, expected_hit, make_prompts

pytestmark = pytest.mark.timeout(600)  # engine start-ups count against the test that needs them

LENGTHS = [700, 1000, 1024, 100]  # 5, 7 and 8 complete chunks (the last one never claimed), and none
MAX_TOKENS = 16


def stored_chunks(prompt_len: int, max_tokens: int = MAX_TOKENS) -> int:
    """Chunks an engine stores for a request: every complete chunk of the KV it wrote (the prompt and
    all generated tokens but the last, which is never fed back)."""
    return (prompt_len + max_tokens - 1) // BLOCK


def tokens(result: dict) -> list[list[int]]:
    return [o["token_ids"] for o in result["outputs"]]


def hits(result: dict) -> list[int]:
    return [o["num_cached_tokens"] for o in result["outputs"]]


def ttft(result: dict) -> list[float]:
    return [round(o["ttft_s"] or 0.0, 3) for o in result["outputs"]]


def warm_up(engine: Engine) -> None:
    """A first request pays one-time costs (kernel set-up, allocations): keep them out of the
    timings. Under one chunk, so it stores nothing."""
    engine.generate(make_prompts(seed=99, lengths=[BLOCK - 28]), 2)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(seed=1, lengths=LENGTHS)


@pytest.fixture(scope="module")
def cold_run(tiny_model, server, workdir, prompts) -> dict:
    """Engine A computes every prompt with an empty server, stores it, and exits. It saves layer by
    layer (each layer copied once vLLM's save_kv_layer says it is written): the hits of a fresh engine
    generating the cold tokens are the check that every layer it stored is the right one."""
    with Engine(tiny_model, connector_config(server.url, layerwise_saves=True), workdir, name="A-cold") as a:
        warm_up(a)
        result = a.generate(prompts, MAX_TOKENS)
    print(f"\ncold run: {result['seconds']:.2f}s, ttft {ttft(result)}")
    return result


@pytest.fixture(scope="module")
def hit_engine(tiny_model, server, workdir, cold_run):
    """Engine B: a fresh process started after A exited (layerwise loading)."""
    with Engine(tiny_model, connector_config(server.url, layerwise=True), workdir, name="B-hit") as b:
        warm_up(b)
        yield b


def test_cold_run_fills_the_server(cold_run, server):
    assert hits(cold_run) == [0] * len(LENGTHS)
    st = server.status()
    assert st["l1"]["objects"] == sum(stored_chunks(n) for n in LENGTHS)
    assert st["leases"] == 0 and st["sessions"] == 0


def test_fresh_engine_hits_all_but_the_last_block_and_generates_the_same_tokens(cold_run, hit_engine, server):
    result = hit_engine.generate(make_prompts(seed=1, lengths=LENGTHS), MAX_TOKENS)
    print(f"\nhit run: {result['seconds']:.2f}s (cold {cold_run['seconds']:.2f}s), ttft {ttft(result)} (cold {ttft(cold_run)})")
    assert hits(result) == [expected_hit(n) for n in LENGTHS] == [640, 896, 896, 0]
    assert tokens(result) == tokens(cold_run)
    st = server.status()
    assert st["leases"] == 0 and st["sessions"] == 0  # locks released, sessions ended
    assert st["l1"]["objects"] == sum(stored_chunks(n) for n in LENGTHS)  # nothing stored twice


def test_tampered_chunks_change_the_tokens(tiny_model, cold_run, hit_engine, server, prompts):
    """Negative control: the same prompt whose stored chunks hold another prompt's KV is served with
    the same hit, and different tokens -- so the loaded KV really is what the engine attends to."""
    layout = KVLayout(tiny_model.num_layers, tiny_model.num_kv_heads, tiny_model.head_dim, tiny_model.dtype)
    victim, donor = prompts[1], prompts[2]  # 1000 tokens (7 chunks are loaded), 1024 tokens
    with KVClient(server.url, engine_model_id(tiny_model), layout, options=ClientOptions(chunk_size=BLOCK)) as c:
        other = c.retrieve(donor)
        n = len(c.hashes(victim))
        assert other.shape[2] >= n * BLOCK
        # Store the donor's KV under the victim's keys, in a namespace of its own (the salt), so the
        # genuine chunks stay as they are.
        assert c.store(victim[: n * BLOCK], other[:, :, : n * BLOCK], cache_salt="tampered") == n * BLOCK
        genuine = c.retrieve(victim)
        assert not np.array_equal(genuine[:, :, : n * BLOCK], other[:, :, : n * BLOCK])
    tampered = hit_engine.generate([victim], MAX_TOKENS, salt="tampered")
    assert hits(tampered) == [expected_hit(len(victim))]
    assert tokens(tampered)[0] != tokens(cold_run)[1]


def test_two_engines_share_one_server(tiny_model, server, workdir):
    """An offline engine (asynchronous loading) and vLLM's OpenAI server (the connector given as
    JSON, synchronous loading) alive together: each serves, with a hit, what the other computed."""
    first, second = make_prompts(seed=2, lengths=[900, 520]), make_prompts(seed=3, lengths=[777])
    with (
        Engine(tiny_model, connector_config(server.url, load_async=True), workdir, name="D-async") as d,
        ApiServer(tiny_model, connector_config(server.url), workdir, name="E-api") as e,
    ):
        objects = server.status()["l1"]["objects"]
        computed = d.generate(first, MAX_TOKENS)
        assert hits(computed) == [0, 0]
        # A request's output comes back while its saves may still run on the saver thread (async saves,
        # the default): the other engine looks it up once they have all landed.
        want = objects + stored_chunks(900) + stored_chunks(520)
        assert server.wait_status(lambda st: st["l1"]["objects"] >= want)["l1"]["objects"] == want
        served = [e.complete(p, MAX_TOKENS) for p in first]
        assert [s["num_cached_tokens"] for s in served] == [expected_hit(900), expected_hit(520)] == [896, 512]
        assert [s["token_ids"] for s in served] == tokens(computed)

        computed = [e.complete(p, MAX_TOKENS) for p in second]
        assert [s["num_cached_tokens"] for s in computed] == [0]
        want += stored_chunks(777)
        assert server.wait_status(lambda st: st["l1"]["objects"] >= want)["l1"]["objects"] == want
        served = d.generate(second, MAX_TOKENS)
        assert hits(served) == [expected_hit(777)] == [768]
        assert tokens(served) == [s["token_ids"] for s in computed]
    st = server.status()
    assert st["leases"] == 0 and st["sessions"] == 0


def test_killed_engine_leaves_no_lease(tiny_model, server, workdir, prompts, cold_run):
    """An engine killed while it holds locks (its load is held up on purpose) leaves none behind once
    the server sees it gone."""
    before = server.status()
    engine = Engine(
        tiny_model, connector_config(server.url, debug_load_delay_s=120), workdir, name="F-killed", single_process=True
    )
    engine.start()
    try:
        engine.send({"op": "generate", "prompts": [{"ids": prompts[1], "salt": ""}], "max_tokens": MAX_TOKENS})
        # The scheduler's lookup locks and the worker's retrieve lease are both held during the load.
        held = server.wait_status(lambda st: st["leases"] >= 2 and st["sessions"] >= 1, timeout_s=60)
        assert held["leases"] >= 2 and held["l1"]["read_locked"] >= 7, held
    finally:
        engine.kill()
    t0 = time.monotonic()
    after = server.wait_status(lambda st: st["leases"] == 0 and st["sessions"] == 0 and st["contexts"] <= before["contexts"])
    print(f"\nlocks of the killed engine released {time.monotonic() - t0:.2f}s after the kill")
    assert after["leases"] == 0 and after["sessions"] == 0 and after["l1"]["read_locked"] == 0
    assert after["contexts"] == before["contexts"]
    assert after["l1"]["objects"] == before["l1"]["objects"]  # nothing lost, nothing half-written


def test_preempted_requests_resume_from_their_own_chunks(tiny_model, server, workdir):
    """Chunked prefill (256 tokens a step) on a KV cache of 11 usable blocks: three prompts fill it,
    and the first block that decoding needs makes vLLM preempt. Chunks are saved step by step, so a
    preempted request is looked up again on re-admission and loads what it had saved. Its tokens are
    those it gets alone, without contention (vLLM's own prefix cache is off: nothing is reused
    behind kvdepot's back).

    Every save is held up on the saver thread (async saves, the default), so blocks a preempted or
    finished request frees would be reused while its save still has to read them: the saves must be
    let through first (``handle_preemptions``, ``get_finished``), or a resumed request loads another
    request's KV and its tokens differ. With 12 blocks, each request alone also needs the blocks the
    one before it held until its last save ran: the engine must not stall meanwhile."""
    batch = make_prompts(seed=4, lengths=[500, 500, 380])
    engine = Engine(
        tiny_model,
        connector_config(server.url, debug_save_delay_s=0.3),
        workdir,
        name="G-preempt",
        single_process=True,  # engine core and worker in one process (vLLM's "uni" executor)
        max_model_len=11 * BLOCK,  # one of the 12 blocks is vLLM's null block
        llm_kwargs={"num_gpu_blocks_override": 12, "max_num_batched_tokens": 2 * BLOCK, "enable_prefix_caching": False},
    )
    with engine:
        objects = server.status()["l1"]["objects"]
        alone = [engine.generate([p], 32, salt="alone")["outputs"][0] for p in batch]
        assert [o["num_preemptions"] for o in alone] == [0, 0, 0]
        # Start the batch with every block free: the last saves land, then one small step lets vLLM
        # learn of them (get_finished) and free the blocks they read.
        want = objects + sum(stored_chunks(len(p), 32) for p in batch)
        assert server.wait_status(lambda st: st["l1"]["objects"] >= want)["l1"]["objects"] == want
        warm_up(engine)
        before = server.status()["requests"]
        together = engine.generate(batch, 32, salt="together")
        after = server.status()
    preemptions = [o["num_preemptions"] for o in together["outputs"]]
    loads = after["requests"].get("PREPARE_RETRIEVE", 0) - before.get("PREPARE_RETRIEVE", 0)
    print(f"\npreemptions {preemptions}, loads {loads}")
    assert sum(preemptions) > 0
    assert loads > 0  # a resumed prefix came from kvdepot
    assert tokens(together) == [o["token_ids"] for o in alone]
    # generate() returns with the last request's saves maybe still held up (0.3 s each): they end, and
    # nothing stays (a leak would stay for the lease TTL, a minute: far past this wait).
    end = server.wait_status(lambda st: st["leases"] == 0 and st["sessions"] == 0, timeout_s=10)
    assert (end["leases"], end["sessions"]) == (0, 0)


def test_compiled_engine_waits_for_each_layer(tiny_model, server, workdir, prompts, cold_run):
    """torch.compile'd model, layerwise loading held up for a second before any layer lands: the
    tokens still match the cold run's, so attention of every layer waited for that layer's load
    (the hooks fire inside the compiled graph too). Without the wait they differ."""
    engine = Engine(
        tiny_model, connector_config(server.url, layerwise=True, debug_load_delay_s=1), workdir, name="H-compiled", compiled=True
    )
    with engine:
        result = engine.generate(prompts[:2], MAX_TOKENS)
    assert hits(result) == [expected_hit(n) for n in LENGTHS[:2]]
    assert tokens(result) == tokens(cold_run)[:2]
