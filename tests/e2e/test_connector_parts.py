"""The connector's two halves driven directly, against a real ``kvdepot server``: vLLM's own request,
block and scheduler-output types, exact hashes, block ids and lock counts. Seconds, not minutes.

What an engine cannot show on one machine is checked here: TP ranks that hold different prefixes, the
L2 prefetch answer "not known yet", preemption, chunks that vanish between lookup and load.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pytest

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.bench.engines.vllm_engines import require_vllm
from kvdepot.bench.serverproc import free_port
from kvdepot.connectors.common import Direction
from kvdepot.hashing import chunk_hashes

from support.servers import Server
from support.vllm_objects import blocks, request, step, tokens
from support.vllm_objects import image as image_item

CS = 128  # chunk size = vLLM's CPU block size here, unless a test says otherwise
BS = 128
MODEL = "parts-model"
TTL_S = 1.0  # --lease-ttl-s of the servers that test what outlives a TTL
L, H, D = 3, 2, 64


@pytest.fixture(scope="module", autouse=True)
def vllm_present():
    require_vllm()


@pytest.fixture
def parts_server(make_server):
    """``make(*args, chunk=CS)``: a small server (256 MiB of L1) with vLLM-sized chunks."""

    def make(*args: str, chunk: int = CS) -> Server:
        return make_server(*args, ipc=False, base=("--chunk-size", str(chunk), "--l1-size-gb", "0.25", "--no-prefault"))

    return make


@pytest.fixture
def server(parts_server) -> Server:
    return parts_server()


def layout(dtype: str = "float32") -> KVLayout:
    return KVLayout(L, H, D, dtype)


def store(url: str, toks: list[int], n_chunks: int, rank: int = 0, world: int = 1, salt: str = "", chunk: int = CS) -> np.ndarray:
    lay = layout()
    kv = np.random.default_rng(rank + 7).standard_normal(lay.chunk_shape(n_chunks * chunk)).astype(np.float32)
    with KVClient(url, MODEL, lay, rank=rank, world_size=world, options=ClientOptions(chunk_size=chunk)) as c:
        assert c.store(toks[: n_chunks * chunk], kv, cache_salt=salt) == n_chunks * chunk
    return kv


# --- scheduler side ------------------------------------------------------------------------------------


def scheduler(url: str, world: int = 1, chunk: int = CS, hash_cache=None, **options):
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.scheduler import SchedulerSide

    config = ConnectorConfig(url=url, chunk_size=chunk, **{"timeout_s": 5.0, **options})
    return SchedulerSide(config, MODEL, layout(), BS, world_size=world, hash_cache=hash_cache)


def worker_meta(*loads):
    """The workers' report that these synchronous loads (``LoadOp``s) ran."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvdepot.connectors.vllm.metadata import KVDepotWorkerMetadata

    return KVConnectorOutput(kv_connector_worker_meta=KVDepotWorkerMetadata.of(loads))


def test_never_claims_the_whole_prompt(server):
    toks = tokens(3 * CS + 1)
    store(server.url, toks, 3)
    s = scheduler(server.url)
    assert s.get_num_new_matched_tokens(request("exact", toks[: 3 * CS]), 0) == (2 * CS, False)
    assert s.get_num_new_matched_tokens(request("one-more", toks), 0) == (3 * CS, False)
    assert s.get_num_new_matched_tokens(request("short", toks[:CS]), 0) == (0, False)  # nothing to claim
    # vLLM's own prefix cache already covers the hit: nothing to load.
    assert s.get_num_new_matched_tokens(request("local", toks), 3 * CS) == (0, False)
    s.shutdown()


def test_a_hit_is_the_prefix_every_tp_rank_holds(server):
    toks = tokens(4 * CS + 5)
    store(server.url, toks, 3, rank=0, world=2)
    store(server.url, toks, 2, rank=1, world=2)
    s = scheduler(server.url, world=2)
    req = request("tp", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    # rank 0's third chunk is not part of the hit: its lock is released at once.
    assert server.status()["l1"]["read_locked"] == 4
    s.update_state_after_alloc(req, blocks(list(range(10, 15))), 2 * CS)
    meta = s.build_connector_meta(step(new=[(req, range(10, 15), 2 * CS)], scheduled={"tp": 4 * CS + 5 - 2 * CS}))
    assert [(op.block_ids, op.skip_blocks) for op in meta.loads] == [([10, 11], 0)]
    # Chunks 2 and 3 are computed this step; each rank's worker stores its own shard of them.
    assert [(op.block_ids, len(op.hashes)) for op in meta.saves] == [([12, 13], 2)]
    s.update_connector_output(worker_meta(*meta.loads))
    assert server.status()["l1"]["read_locked"] == 0
    s.request_finished(req)
    assert server.status()["sessions"] == 0
    s.shutdown()


def test_load_plan_skips_what_vllm_holds_and_locks_follow_the_load(parts_server, caplog):
    caplog.set_level(logging.INFO, logger="kvdepot.connectors.vllm.scheduler")
    cs = 2 * BS  # two blocks per chunk, so vLLM's own hit can end inside a chunk
    srv = parts_server(chunk=cs)
    toks = tokens(4 * cs + 10)
    store(srv.url, toks, 4, chunk=cs)
    s = scheduler(srv.url, chunk=cs)
    req = request("r1", toks)
    hashes = chunk_hashes(toks, cs)
    local = 3 * BS  # vLLM's prefix cache holds 1.5 chunks
    assert s.get_num_new_matched_tokens(req, local) == (4 * cs - local, False)
    assert srv.status()["l1"]["read_locked"] == 4
    ids = list(range(20, 29))
    s.update_state_after_alloc(req, blocks(ids), 4 * cs - local)
    # one line at INFO tells what the request asked, found where, loaded, and had itself
    want = f"kvdepot: request r1: {4 * cs} of its {4 * cs} cacheable tokens found ({4 * cs} in L1, 0 from L2), {4 * cs - local} loaded, {local} from vLLM's own cache"
    assert want in caplog.text, caplog.text
    # Chunk 0 lies wholly in vLLM's hit: unlocked now. Chunk 1 is half vLLM's: loaded, first block skipped.
    assert srv.status()["l1"]["read_locked"] == 3
    meta = s.build_connector_meta(step(new=[(req, ids, 4 * cs)], scheduled={"r1": 10}))
    (load,) = meta.loads
    assert load.hashes == hashes[1:4] and load.block_ids == ids[2:8] and load.skip_blocks == 1 and not load.is_async
    assert meta.saves == []  # the 10 computed tokens complete no chunk
    assert s.build_connector_meta(step(cached=[(req, [], 4 * cs + 10)], scheduled={"r1": 1})).loads == []  # planned once
    s.update_connector_output(worker_meta(*meta.loads))
    st = srv.status()
    # every lock freed: the session ended with its last one (not left to the sweep, which would count it expired)
    assert st["l1"]["read_locked"] == 0 and st["sessions"] == 0
    s.request_finished(req)  # its END_SESSION finds nothing to do
    st = srv.status()
    assert st["sessions"] == 0 and st["request_failures"].get("sessions_expired", 0) == 0, st["request_failures"]
    s.shutdown()


def test_a_prefix_seen_before_is_not_hashed_again_and_hashes_the_same(server):
    from kvdepot.connectors.vllm.hash_cache import ChunkHashCache

    toks = tokens(5 * CS + 3, seed=31)
    store(server.url, toks, 5)
    cache = ChunkHashCache(CS, BS)
    s = scheduler(server.url, hash_cache=cache)
    first = request("first", toks, vllm_hashes=True)
    assert s.get_num_new_matched_tokens(first, 0) == (5 * CS, False)
    assert cache.hits == 0
    # The same prompt again, then one that shares its first 3 chunks and goes on differently.
    again = request("again", toks, vllm_hashes=True)
    assert s.get_num_new_matched_tokens(again, 0) == (5 * CS, False)
    assert cache.hits == 5 and s.states["again"].hashes == chunk_hashes(toks, CS)
    fork = toks[: 3 * CS] + tokens(2 * CS + 3, seed=32)
    forked = request("forked", fork, vllm_hashes=True)
    assert s.get_num_new_matched_tokens(forked, 0) == (3 * CS, False)
    assert cache.hits == 8 and s.states["forked"].hashes == chunk_hashes(fork, CS)  # 3 from the cache, 2 hashed
    for r in (first, again, forked):
        s.request_finished(r)
    s.shutdown()


def test_saves_carry_their_token_ids_only_when_the_connector_opts_in(server):
    toks = tokens(600)
    for opted in (False, True):
        s = scheduler(server.url, kv_events_token_ids=opted)
        req = request(f"tokens-{opted}", toks)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, blocks([5, 6]), 0)
        m1 = s.build_connector_meta(step(new=[(req, [5, 6], 0)], scheduled={f"tokens-{opted}": 256}))
        m2 = s.build_connector_meta(step(cached=[(req, [7, 8, 9], 256)], scheduled={f"tokens-{opted}": 256}))
        got = [op.token_ids for op in m1.saves + m2.saves]
        assert got == ([toks[: 2 * CS], toks[2 * CS : 4 * CS]] if opted else [[], []])
        s.request_finished(req)
        s.shutdown()


def test_saves_follow_chunked_prefill_and_decode(server):
    toks = tokens(600)
    s = scheduler(server.url)
    req = request("chunked", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks([5, 6]), 0)
    assert server.status()["sessions"] == 1  # a miss still opens a session, ended with the request
    hashes = chunk_hashes(toks, CS)
    m1 = s.build_connector_meta(step(new=[(req, [5, 6], 0)], scheduled={"chunked": 256}))
    assert [(op.hashes, op.block_ids) for op in m1.saves] == [(hashes[0:2], [5, 6])]
    m2 = s.build_connector_meta(step(cached=[(req, [7, 8, 9], 256)], scheduled={"chunked": 256}))
    assert [(op.hashes, op.block_ids) for op in m2.saves] == [(hashes[2:4], [7, 8])]
    m3 = s.build_connector_meta(step(cached=[(req, [], 512)], scheduled={"chunked": 88}))
    assert m3.saves == []
    # Decode: generated tokens complete chunk 4 once token 640 has been fed.
    gen = tokens(60, seed=5)
    req.append_output_token_ids(gen[:39])
    assert s.build_connector_meta(step(cached=[(req, [], 638)], scheduled={"chunked": 1})).saves == []
    req.append_output_token_ids(gen[39:41])
    m4 = s.build_connector_meta(step(cached=[(req, [], 639)], scheduled={"chunked": 1}))
    assert [(op.hashes, op.block_ids) for op in m4.saves] == [(chunk_hashes(toks + gen[:41], CS)[4:5], [9])]
    assert s.request_finished(req) == (True, None)  # async saves may still read its blocks: vLLM waits
    assert server.status()["sessions"] == 0
    s.shutdown()


def test_blocks_wait_for_saves_only_when_there_are_async_saves(server):
    toks = tokens(600)
    for async_saves, saved, want in ((True, False, False), (False, True, False), (True, True, True)):
        s = scheduler(server.url, async_saves=async_saves)
        req = request(f"free-{async_saves}-{saved}", toks)
        assert s.get_num_new_matched_tokens(req, 0) == (0, False)
        s.update_state_after_alloc(req, blocks([5, 6]), 0)
        m = s.build_connector_meta(step(new=[(req, [5, 6], 0)], scheduled={req.request_id: 256 if saved else 100}))
        assert len(m.saves) == int(saved)
        assert s.request_finished(req) == (want, None)
        s.shutdown()


def running_after_a_hit(server, req_id: str):
    """A request of 3 chunks + 7 tokens whose first 2 kvdepot holds: looked up, loaded into blocks
    1-4 and computing the rest (its third chunk saved) in one step. (scheduler, request, tokens, that
    step's metadata)."""
    toks = tokens(3 * CS + 7)
    store(server.url, toks, 2)
    s = scheduler(server.url)
    req = request(req_id, toks)
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 2 * CS)
    first = s.build_connector_meta(step(new=[(req, [1, 2, 3, 4], 2 * CS)], scheduled={req_id: CS + 7}))
    s.update_connector_output(worker_meta(*first.loads))
    return s, req, toks, first


def test_preemption_ends_the_session_and_the_request_is_looked_up_again(server):
    s, req, toks, _ = running_after_a_hit(server, "pre")
    # The step stored chunk 2; then vLLM preempts the request and frees its blocks.
    store(server.url, toks, 3)
    assert s.build_connector_meta(step(preempted={"pre"})).preempted == ["pre"]  # workers drain their saves
    assert server.status()["sessions"] == 0
    assert s.get_num_new_matched_tokens(req, 0) == (3 * CS, False)  # its own saved chunk now hits too
    s.update_state_after_alloc(req, blocks([9, 8, 7, 6]), 3 * CS)
    meta = s.build_connector_meta(step(cached=[(req, [9, 8, 7, 6], 3 * CS)], scheduled={"pre": 7}))
    assert [(op.block_ids, op.skip_blocks) for op in meta.loads] == [([9, 8, 7], 0)]
    s.request_finished(req)
    s.shutdown()


def test_lookup_answers_not_known_yet_while_the_server_prefetches_from_l2(parts_server, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kvdepot.connectors.vllm.scheduler")
    srv = parts_server("--l2", f"fs:path={tmp_path / 'l2'}", "--l2-placement", "skip_l1")
    toks = tokens(3 * CS + 1)
    store(srv.url, toks, 3)
    gone = srv.wait_status(lambda st: st["l1"]["objects"] == 0)
    assert gone["l1"]["objects"] == 0, gone  # only L2 holds them now
    s = scheduler(srv.url)
    req = request("l2", toks)
    answers = [s.get_num_new_matched_tokens(req, 0)]
    deadline = time.monotonic() + 30
    while answers[-1][0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
        answers.append(s.get_num_new_matched_tokens(req, 0))
    assert answers[0] == (None, False)
    assert answers[-1] == (3 * CS, False)
    assert len(answers) >= 2
    assert srv.status()["l1"]["read_locked"] == 3  # the prefetched chunks are locked for the request
    s.update_state_after_alloc(req, blocks(list(range(1, 5))), 3 * CS)
    assert f"request l2: {3 * CS} of its {3 * CS} cacheable tokens found (0 in L1, {3 * CS} from L2), {3 * CS} loaded" in caplog.text
    s.request_finished(req)
    assert srv.status()["l1"]["read_locked"] == 0
    s.shutdown()


def test_a_request_admitted_while_its_l2_lookup_runs_drops_the_lookup(parts_server, tmp_path):
    """vLLM may admit a request whose lookup still answers "not known yet": its own prefix cache came to
    cover what kvdepot could give (then the connector answers 0 before it polls), or it reads no cache
    for the request. The admission ends the lookup's session and loads nothing (it used to raise)."""
    srv = parts_server("--l2", f"fs:path={tmp_path / 'l2'}", "--l2-placement", "skip_l1")
    toks = tokens(3 * CS + 1)
    store(srv.url, toks, 3)
    srv.wait_status(lambda st: st["l1"]["objects"] == 0)
    s = scheduler(srv.url)
    req = request("racing", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)  # the server prefetches from L2
    assert s.get_num_new_matched_tokens(req, 3 * CS) == (0, False)  # vLLM's own cache holds it all now
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    assert s.build_connector_meta(step(new=[(req, [1, 2, 3, 4], 3 * CS)], scheduled={"racing": 1})).loads == []
    assert srv.wait_status(lambda st: st["sessions"] == 0)["sessions"] == 0
    assert srv.wait_status(lambda st: st["l1"]["read_locked"] == 0)["l1"]["read_locked"] == 0
    s.request_finished(req)
    s.shutdown()


def adapter_dir(path, weights: bytes):
    """A PEFT adapter directory as vLLM reads one (the scheduler hashes its files, never loads them)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


def test_requests_with_a_lora_adapter_are_cached_under_their_adapter(server, tmp_path, caplog):
    """The adapter changes the KV of the same tokens, so a LoRA request's chain starts from its adapter's
    root: it never reads the base model's chunks or another adapter's, and the same weights under
    another name and path read what it saved. Its saves send no tokens to KV events (they name no
    adapter). An adapter whose files are not here (a hub id) is served uncached, said once."""
    from vllm.lora.request import LoRARequest

    from kvdepot.connectors.vllm.adapters import ROOT_TAG, adapter_digest

    caplog.set_level(logging.INFO, logger="kvdepot.connectors.vllm.adapters")
    toks = tokens(2 * CS + 1)
    store(server.url, toks, 2)  # the base model's chunks
    x = adapter_dir(tmp_path / "x", b"x-weights" * 100)
    x_copy = adapter_dir(tmp_path / "x-copy", b"x-weights" * 100)
    y = adapter_dir(tmp_path / "y", b"y-weights" * 100)
    s = scheduler(server.url, kv_events_token_ids=True)

    def adapted(req_id: str, name: str, path: str, int_id: int):
        req = request(req_id, toks)
        req.lora_request = LoRARequest(name, int_id, path)
        return req

    first = adapted("x1", "x", x, 1)
    assert s.get_num_new_matched_tokens(first, 0) == (0, False)  # the base model's chunks are not its
    s.update_state_after_alloc(first, blocks([1, 2, 3]), 0)
    (save,) = s.build_connector_meta(step(new=[(first, [1, 2, 3], 0)], scheduled={"x1": 2 * CS + 1})).saves
    root = hashlib.sha256(ROOT_TAG + adapter_digest(x)).digest()
    assert save.hashes == chunk_hashes(toks[: 2 * CS], CS, prefix=root)
    assert not set(save.hashes) & set(chunk_hashes(toks[: 2 * CS], CS))
    assert save.token_ids == []
    s.request_finished(first)

    lay = layout()
    with KVClient(server.url, MODEL, lay, options=ClientOptions(chunk_size=CS)) as c, c.prepare_store(save.hashes) as slots:
        for slot in slots:
            slot[...] = 1.0  # what the workers would have saved
    assert s.get_num_new_matched_tokens(adapted("x2", "x-again", x_copy, 2), 0) == (2 * CS, False)
    assert s.get_num_new_matched_tokens(adapted("y1", "y", y, 3), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("plain", toks), 0) == (2 * CS, False)  # the base model's own

    hub = adapted("hub1", "hub", "some-org/some-adapter", 4)
    assert s.get_num_new_matched_tokens(hub, 0) == (0, False)
    s.update_state_after_alloc(hub, blocks([4, 5, 6]), 0)
    assert s.build_connector_meta(step(new=[(hub, [4, 5, 6], 0)], scheduled={"hub1": 2 * CS + 1})).saves == []
    assert s.get_num_new_matched_tokens(adapted("hub2", "hub", "some-org/some-adapter", 4), 0) == (0, False)
    assert caplog.text.count("is not a local directory or a downloaded hub adapter") == 1
    s.shutdown()


IMAGE_TOKEN = 7  # the placeholder id every image's positions hold


def with_placeholders(toks: list[int], *spans: tuple[int, int]) -> list[int]:
    out = list(toks)
    for offset, length in spans:
        out[offset : offset + length] = [IMAGE_TOKEN] * length
    return out


def store_chain(url: str, hashes) -> None:
    """Stores chunks under ``hashes`` as the workers would have saved them."""
    with KVClient(url, MODEL, layout(), options=ClientOptions(chunk_size=CS)) as c, c.prepare_store(list(hashes)) as slots:
        for slot in slots:
            slot[...] = 1.0


def planned_save(s, req, block_ids: list[int], n_tokens: int):
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks(block_ids), 0)
    (save,) = s.build_connector_meta(step(new=[(req, block_ids, 0)], scheduled={req.request_id: n_tokens})).saves
    s.request_finished(req)
    return save


def test_requests_with_images_are_cached_under_their_images(server):
    """Every image's placeholders are the same token id, so a chunk that holds an image's placeholders
    names the image (vLLM's identifier, its place), and every later chunk inherits it through the chain:
    the same text with another image shares the chunks before the image only, the same image hits,
    and the text alone (placeholder ids and all) never reads an image's KV."""
    toks = with_placeholders(tokens(3 * CS + 1, seed=51), (300, 64))  # an image in chunk 2
    s = scheduler(server.url, kv_events_token_ids=True)
    save = planned_save(s, request("a1", toks, media=[("image-a", 300, 64)]), [1, 2, 3, 4], 3 * CS + 1)
    plain = chunk_hashes(toks[: 3 * CS], CS)
    assert save.hashes[:2] == plain[:2] and save.hashes[2] != plain[2]  # before the image: text only
    assert save.token_ids == []  # KV events name no media: no tokens a router could index as the text's
    store_chain(server.url, save.hashes)

    assert s.get_num_new_matched_tokens(request("a2", toks, media=[("image-a", 300, 64)]), 0) == (3 * CS, False)
    assert s.get_num_new_matched_tokens(request("b", toks, media=[("image-b", 300, 64)]), 0) == (2 * CS, False)
    assert s.get_num_new_matched_tokens(request("text", toks), 0) == (2 * CS, False)
    moved = with_placeholders(tokens(3 * CS + 1, seed=51), (290, 64))
    assert s.get_num_new_matched_tokens(request("moved", moved, media=[("image-a", 290, 64)]), 0) == (2 * CS, False)
    s.shutdown()


def test_the_hash_cache_tells_images_and_adapters_apart(server, tmp_path):
    """vLLM's own prefix hashes name a request's media and adapter, so the cache of kvdepot chains
    keyed by them never hands one image's (or adapter's) chain to a request of the same tokens with
    another."""
    from vllm.lora.request import LoRARequest

    from kvdepot.connectors.vllm.hash_cache import ChunkHashCache

    toks = with_placeholders(tokens(3 * CS + 1, seed=53), (10, 64))
    s = scheduler(server.url, hash_cache=ChunkHashCache(CS, BS))
    hashes = {}
    x = LoRARequest("x", 1, adapter_dir(tmp_path / "x", b"weights"))
    for name, media, adapter in (("a", "image-a", None), ("b", "image-b", None), ("x", "image-a", x)):
        req = request(name, toks, vllm_hashes=True, media=[(media, 10, 64)], lora_request=adapter)
        s.get_num_new_matched_tokens(req, 0)
        hashes[name] = s.states[name].hashes
        s.request_finished(req)
    again = request("a-again", toks, vllm_hashes=True, media=[("image-a", 10, 64)])
    s.get_num_new_matched_tokens(again, 0)
    assert s.hash_cache.hits == 3 and s.states["a-again"].hashes == hashes["a"]
    assert len({tuple(h) for h in hashes.values()}) == 3
    s.request_finished(again)
    s.shutdown()


def test_an_image_across_a_chunk_boundary_names_both_chunks(server):
    toks = with_placeholders(tokens(3 * CS + 1, seed=52), (100, 64))  # placeholders 100..163: chunks 0 and 1
    s = scheduler(server.url)
    a = planned_save(s, request("a", toks, media=[("image-a", 100, 64)]), [1, 2, 3, 4], 3 * CS + 1)
    b = planned_save(s, request("b", toks, media=[("image-b", 100, 64)]), [5, 6, 7, 8], 3 * CS + 1)
    assert all(x != y for x, y in zip(a.hashes, b.hashes))
    assert a.hashes[0] != chunk_hashes(toks[:CS], CS)[0]
    s.shutdown()


def test_a_streaming_session_that_gains_media_keeps_saving_under_it(server):
    """A streaming-input session starts as text and gains an image later (vLLM appends to its
    mm_features and its tokens): the chunks already saved hold none of it, and the later ones are saved
    under the image. Media that landed inside chunks already hashed (no append does that) would stop
    the request's saves: its keys could not name what its KV holds."""
    toks = with_placeholders(tokens(4 * CS + 1, seed=41), (2 * CS + 10, 64))
    s = scheduler(server.url)
    req = request("streaming", toks[: 2 * CS + 1])
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks([5, 6, 7]), 0)
    (first,) = s.build_connector_meta(step(new=[(req, [5, 6, 7], 0)], scheduled={"streaming": 2 * CS + 1})).saves
    assert first.hashes == chunk_hashes(toks[: 2 * CS], CS)
    req.append_output_token_ids(toks[2 * CS + 1 :])  # the rest of the input, the image's placeholders in it
    req.mm_features = [image_item("image-a", 2 * CS + 10, 64)]
    (later,) = s.build_connector_meta(step(cached=[(req, [8, 9], 2 * CS + 1)], scheduled={"streaming": 2 * CS})).saves
    whole = planned_save(scheduler(server.url, save_decode=True), request("whole", toks, media=[("image-a", 2 * CS + 10, 64)]),
                         [1, 2, 3, 4, 10], 4 * CS + 1)  # fmt: skip
    assert first.hashes + later.hashes == whole.hashes[:4]  # as if the image had been there from the start
    assert later.hashes != chunk_hashes(toks[: 4 * CS], CS)[2:4]

    late = request("late", toks[: 2 * CS + 1])
    assert s.get_num_new_matched_tokens(late, 0) == (0, False)  # hashes its two chunks
    s.update_state_after_alloc(late, blocks([11, 12, 13]), 0)
    late.mm_features = [image_item("image-b", 10, 64)]  # inside chunk 0, hashed already
    assert s.build_connector_meta(step(new=[(late, [11, 12, 13], 0)], scheduled={"late": 2 * CS + 1})).saves == []
    s.request_finished(late)
    s.request_finished(req)
    s.shutdown()


def test_prompts_given_as_embeddings_are_cached_under_their_rows(server):
    """A prompt of embeddings has token ids 0 everywhere: each chunk names its rows (their bytes, dtype
    and width), so the same rows hit, rows that differ from some chunk on share the chunks before it,
    and the same values in another dtype are other keys."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.request import Request

    rows = torch.randn(3 * CS + 1, 32, generator=torch.Generator().manual_seed(5))

    def embedded(req_id: str, embeds):
        return Request(req_id, None, SamplingParams(max_tokens=8), None, prompt_embeds=embeds)

    s = scheduler(server.url)
    save = planned_save(s, embedded("e1", rows), [1, 2, 3, 4], 3 * CS + 1)
    assert not set(save.hashes) & set(chunk_hashes([0] * 3 * CS, CS))
    store_chain(server.url, save.hashes)
    assert s.get_num_new_matched_tokens(embedded("e2", rows.clone()), 0) == (3 * CS, False)
    changed = rows.clone()
    changed[2 * CS + 5] += 1.0
    assert s.get_num_new_matched_tokens(embedded("e3", changed), 0) == (2 * CS, False)
    assert s.get_num_new_matched_tokens(embedded("e4", rows.to(torch.bfloat16)), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("zeros", [0] * (3 * CS + 1)), 0) == (0, False)
    s.shutdown()


def test_a_model_whose_every_layer_slides_is_refused_at_start():
    """vLLM frees the blocks that leave a sliding window while a save may still read them: refused,
    saying so, rather than served with that race."""
    from types import SimpleNamespace as NS

    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvdepot.connectors.vllm.connector import KVDepotConnector

    transfer = KVTransferConfig(kv_connector="KVDepotConnector", kv_role="kv_both", kv_connector_extra_config={"url": f"tcp://127.0.0.1:{free_port()}"})
    config = NS(kv_transfer_config=transfer, parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1),
                model_config=NS(use_mla=False, model=MODEL), cache_config=NS(block_size=BS, cache_dtype="auto"))  # fmt: skip
    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16, sliding_window=4 * BS)
    groups = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
    with pytest.raises(NotImplementedError, match="this model.s KV cache is SlidingWindowSpec in every layer"):
        KVDepotConnector(config, KVConnectorRole.SCHEDULER, groups)


def test_a_request_aborted_while_its_async_load_runs_keeps_its_blocks_until_the_load_is_done(server):
    """Aborted in WAITING_FOR_REMOTE_KVS: the workers may still be writing its blocks, so vLLM must free
    them only when the load is reported done (finished_recving), not at once."""
    s, req, meta = async_load_handed_over(server, "aborted")
    assert [op.req_id for op in meta.loads] == ["aborted"]  # with the workers now
    assert s.request_finished(req) == (True, None)  # freed on finished_recving
    s.shutdown()


def test_a_request_preempted_and_admitted_again_within_one_schedule_keeps_its_new_load(server):
    """vLLM can preempt a request and admit it again in one schedule (resetting the prefix cache of
    running requests does): the connector sees the re-admission first, looks the request up afresh and
    plans its load; the preemption that build_connector_meta then reports must not undo that. Its
    earlier saves were drained: no longer counted."""
    s, req, _, first = running_after_a_hit(server, "again")
    assert len(first.loads) == 1 and len(first.saves) == 1
    # One schedule: preempted, then admitted again (its blocks were freed: new ones).
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    s.update_state_after_alloc(req, blocks([9, 8, 7, 6]), 2 * CS)
    meta = s.build_connector_meta(step(preempted={"again"}, cached=[(req, [9, 8, 7, 6], 2 * CS)], scheduled={"again": CS + 7}))
    assert meta.preempted == ["again"]  # the workers drain its saves before its old blocks are reused
    assert [(op.block_ids, op.skip_blocks) for op in meta.loads] == [([9, 8], 0)]
    assert s.states["again"].saves_planned == len(meta.saves) == 1  # this step's save only
    s.request_finished(req)
    s.shutdown()


def test_a_report_of_the_load_before_a_readmission_leaves_the_new_loads_locks_alone(server):
    """With async scheduling the step that ran a request's load is reported after the next schedule. If
    that schedule preempted the request and admitted it again (reset_prefix_cache between the two), its
    new lookup locked the chunks and a new load is in flight when the old load's report comes in: taken
    for the new load's, it freed the new lookup's locks before the workers had read the chunks (a miss,
    or chunks evicted under the load). Reports name their load's attempt; a stale one changes nothing."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvdepot.connectors.vllm.request_state import Locks

    toks = tokens(3 * CS + 7)
    store(server.url, toks, 2)
    s = scheduler(server.url)
    w = worker(server.url, cpu_caches())
    req = request("stale", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    s.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 2 * CS)
    first = s.build_connector_meta(step(new=[(req, [1, 2, 3, 4], 2 * CS)], scheduled={"stale": CS + 7}))
    w.start_load_kv(first)
    w.wait_for_save(first)
    stale = w.take_worker_meta()  # the first step's report, not yet delivered
    assert stale is not None and stale.loaded.keys() == {"stale"}
    # The next schedule: preempted and admitted again; a new lookup locks the two chunks, a new load goes.
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    s.update_state_after_alloc(req, blocks([9, 8, 7, 6]), 2 * CS)
    second = s.build_connector_meta(step(preempted={"stale"}, cached=[(req, [9, 8, 7, 6], 2 * CS)], scheduled={"stale": CS + 7}))
    assert [op.block_ids for op in second.loads] == [[9, 8]]
    assert server.wait_status(lambda st: st["l1"]["read_locked"] == 2)["l1"]["read_locked"] == 2
    s.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=stale))  # the first step's, late
    assert server.status()["l1"]["read_locked"] == 2, "a stale report freed the new load's locks"
    assert s.states["stale"].locks is Locks.LOADING
    w.handle_preemptions(second)
    w.start_load_kv(second)
    w.wait_for_save(second)
    s.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=w.take_worker_meta()))  # its own report
    assert s.states["stale"].locks is Locks.HELD
    assert server.wait_status(lambda st: st["l1"]["read_locked"] == 0)["l1"]["read_locked"] == 0
    s.request_finished(req)
    assert server.wait_status(lambda st: st["sessions"] == 0)["sessions"] == 0
    w.shutdown()
    s.shutdown()


def async_load_handed_over(server, req_id: str):
    """A 2-chunk hit announced as an asynchronous load and handed to the workers: (scheduler, request,
    the step's metadata; the request is not scheduled while it loads)."""
    toks = tokens(2 * CS + 3)
    store(server.url, toks, 2)
    s = scheduler(server.url, load_async=True)
    req = request(req_id, toks)
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, True)
    s.update_state_after_alloc(req, blocks([3, 4]), 2 * CS)
    return s, req, s.build_connector_meta(step())


def test_async_loading_is_announced(server):
    s, req, meta = async_load_handed_over(server, "a")
    assert [op.is_async for op in meta.loads] == [True]
    from vllm.v1.outputs import KVConnectorOutput

    s.update_connector_output(KVConnectorOutput(finished_recving={"a"}))
    assert server.status()["l1"]["read_locked"] == 0
    # Scheduled once loaded: allocation is reported again, and nothing is loaded twice.
    s.update_state_after_alloc(req, blocks([3, 4, 5]), 0)
    assert s.build_connector_meta(step(new=[(req, [3, 4, 5], 2 * CS)], scheduled={"a": 3})).loads == []
    s.request_finished(req)
    s.shutdown()


@pytest.mark.parametrize("how", ["invalid_blocks", "failed_recving"])
def test_a_request_whose_async_load_failed_is_not_offered_the_same_hit_again(server, how):
    """vLLM re-queues a request whose asynchronous load failed (no valid prefix) and asks again: the
    connector used to take that for a preemption, look the prompt up, claim the same hit and load it
    again, failing step after step for as long as lookups hit and loads did not."""
    from vllm.v1.outputs import KVConnectorOutput

    s, req, meta = async_load_handed_over(server, f"fails-{how}")
    assert [op.block_ids for op in meta.loads] == [[3, 4]]
    failure = {"invalid_blocks": {"invalid_block_ids": {3, 4}}, "failed_recving": {"failed_recving": {req.request_id}}}[how]
    s.update_connector_output(KVConnectorOutput(finished_recving={req.request_id}, **failure))
    req.num_computed_tokens = 0  # vLLM frees its blocks and re-queues it
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, blocks([6, 7, 8]), 0)
    m = s.build_connector_meta(step(new=[(req, [6, 7, 8], 0)], scheduled={req.request_id: 2 * CS + 3}))
    assert m.loads == []
    s.request_finished(req)
    assert server.status()["sessions"] == 0
    s.shutdown()


def test_unreachable_server_means_uncached_not_stuck():
    s = scheduler(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3, retry_after_s=60)
    t0 = time.monotonic()
    assert s.get_num_new_matched_tokens(request("x", tokens(3 * CS)), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("y", tokens(3 * CS)), 0) == (0, False)  # not retried yet
    assert time.monotonic() - t0 < 3
    s.shutdown()


def test_cache_salt_separates_requests(server):
    toks = tokens(2 * CS + 1)
    store(server.url, toks, 2, salt="tenant-a")
    s = scheduler(server.url)
    assert s.get_num_new_matched_tokens(request("a", toks, salt="tenant-a"), 0) == (2 * CS, False)
    assert s.get_num_new_matched_tokens(request("b", toks, salt="tenant-b"), 0) == (0, False)
    assert s.get_num_new_matched_tokens(request("c", toks), 0) == (0, False)
    s.shutdown()


def test_a_lookup_is_a_turn_of_the_agent_session_its_request_names(server):
    """vLLM passes ``kv_transfer_params`` through untouched: a request naming ``kvdepot_agent_session``
    opens (or renews) that session on the server, protecting the whole prompt's chunks."""
    import httpx
    from vllm import SamplingParams
    from vllm.v1.request import Request

    toks = tokens(3 * CS + 1)
    store(server.url, toks, 2, salt="t")
    s = scheduler(server.url)
    params = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": {"kvdepot_agent_session": "conv-1"}})
    req = Request("turn-1", toks, params, None, cache_salt="t")
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    sessions = httpx.get(f"{server.http}/cache/sessions", timeout=10).json()["sessions"]
    assert [(x["cache_salt"], x["name"], x["state"], x["keys"]) for x in sessions] == [("t", "conv-1", "open", 3)]
    assert s.get_num_new_matched_tokens(request("plain", toks, salt="t"), 0) == (2 * CS, False)
    assert len(httpx.get(f"{server.http}/cache/sessions", timeout=10).json()["sessions"]) == 1  # no name, no session
    s.shutdown()


def test_config_rejects_unknown_options():
    from kvdepot.connectors.vllm.config import ConnectorConfig

    with pytest.raises(ValueError, match="unknown kvdepot connector option"):
        ConnectorConfig.from_extra({"url": "tcp://x:1", "chunksize": 128})
    assert ConnectorConfig.from_extra({"layerwise": "true", "chunk_size": "256"}).layerwise is True
    assert ConnectorConfig().chunk_tokens(128) == 256 and ConnectorConfig().chunk_tokens(96) == 288
    with pytest.raises(ValueError, match="multiple"):
        ConnectorConfig(chunk_size=200).chunk_tokens(128)


# --- worker side ---------------------------------------------------------------------------------------


def cpu_caches(num_blocks: int = 12, dtype: str = "bfloat16", seed: int | None = None) -> dict:
    """Per-layer caches the way vLLM's CPU backend allocates them: views into one allocation."""
    import torch

    whole = torch.zeros(L, num_blocks, H, BS, 2 * D, dtype=getattr(torch, dtype))
    if seed is not None:
        whole.copy_(torch.randn(whole.shape, generator=torch.Generator().manual_seed(seed)))
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(L)}


def worker(url: str, caches: dict, **options):
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.worker import WorkerSide

    w = WorkerSide(ConnectorConfig(url=url, chunk_size=CS, **options), MODEL, BS, "auto", 0, 1)
    w.register_kv_caches(caches)
    return w


def save_now(w, m) -> None:
    """``wait_for_save`` as vLLM calls it, then what vLLM waits for before it frees the saved
    requests' blocks: each reported by ``get_finished`` (async saves: the saver thread ran them)."""
    w.wait_for_save(m)
    want = {op.req_id for op in m.saves}
    got: set[str] = set()
    deadline = time.monotonic() + 30
    while got != want:
        assert time.monotonic() < deadline, f"saves of {want - got} never reported finished"
        got |= w.take_finished_saves(want)
        time.sleep(0.005)


def meta(loads=(), saves=()):
    from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata

    return KVDepotConnectorMetadata(list(loads), list(saves))


def ops(toks, n, src_blocks, dst_blocks, skip=0, is_async=False, req="r"):
    from kvdepot.connectors.vllm.metadata import LoadOp, SaveOp

    hashes = chunk_hashes(toks, CS)[:n]
    return SaveOp(req, hashes, "", src_blocks), LoadOp(req, hashes, "", dst_blocks, skip, is_async)


def run_load_step(reader, mode: str, load, layer_names: list[str]) -> None:
    """One step that loads ``load`` as vLLM drives it: ``start_load_kv``; in ``layerwise`` mode every
    layer's wait; in ``async`` mode until ``get_finished`` reports the request; then ``wait_for_save``."""
    reader.start_load_kv(meta(loads=[load]))
    if mode == "layerwise":
        for name in layer_names:
            reader.wait_for_layer_load(name)
    if mode == "async":
        deadline = time.monotonic() + 10
        while not (done := reader.take_finished_async()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == {load.req_id}
    reader.wait_for_save(meta())


def blocks_equal(a: dict, ia: list[int], b: dict, ib: list[int]) -> bool:
    return all(bool((a[name][ia] == b[name][ib]).all()) for name in a)


def test_a_step_hands_its_saves_off_and_a_preemption_waits_for_them(server):
    from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata

    src = cpu_caches(seed=21)
    save, _ = ops(tokens(2 * CS + 1, seed=21), 2, [3, 4], [0, 0], req="held")
    w = worker(server.url, src, debug_save_delay_s=2.0)  # the saver thread sleeps before it reads
    before = server.status()["l1"]["objects"]
    w.wait_for_save(meta(saves=[save]))  # returns at once
    assert server.status()["l1"]["objects"] == before, "the step waited for its save"
    assert w.take_finished_saves({"held"}) == set()  # finished in vLLM, but its blocks are still read
    w.handle_preemptions(KVDepotConnectorMetadata(preempted=["held"]))  # before its blocks are reused
    assert server.status()["l1"]["objects"] == before + 2
    assert w.take_finished_saves(set()) == {"held"}  # now vLLM may free them, once
    assert w.take_finished_saves({"held"}) == set()
    w.shutdown()


@pytest.mark.parametrize("hooks", [True, False])
def test_layerwise_saves_copy_each_layer_once_it_is_written_and_commit_whole(server, hooks):
    """The step's saves go to the saver before the forward. The "forward" here writes each layer's
    blocks just before its save_kv_layer: what is stored is what was written, so no layer was copied
    before its hook, and nothing is committed before the last layer. Without the hooks (layers that
    never call them) wait_for_save lets the whole save through."""
    written, src, dst = cpu_caches(seed=23), cpu_caches(), cpu_caches()
    save, load = ops(tokens(2 * CS + 1, seed=23 + hooks), 2, [3, 4], [8, 9], req="lw")
    w = worker(server.url, src, layerwise_saves=True)
    before = server.status()["l1"]["ready"]
    step = meta(saves=[save])
    w.start_load_kv(step)
    for i, name in enumerate(src):
        src[name].copy_(written[name])
        if hooks:
            w.save_kv_layer(name)
        if i == 0:
            time.sleep(0.2)  # the saver has had time to copy layer 0 (and must not commit)
            assert server.status()["l1"]["ready"] == before, "committed before its last layer was written"
    save_now(w, step)  # (wait_for_save does not hand the step's saves over twice)
    assert server.status()["l1"]["ready"] == before + 2
    r = worker(server.url, dst)
    r.start_load_kv(meta(loads=[load]))
    assert r.take_load_errors() == set() and blocks_equal(written, [3, 4], dst, [8, 9])
    w.shutdown()
    r.shutdown()


class LayerCount:
    """Counts the gathers of each layer a worker's saver ran; ``wait(layer, n)`` waits until layer
    ``layer`` has ``n`` of them (or gives up after ``bound_s``, a bound, never a measurement)."""

    def __init__(self, w, bound_s: float = 10.0) -> None:
        import threading

        self.counts = [0] * w.paged.num_layers
        self._cond = threading.Condition()
        self._gather = w.paged.gather
        self._bound_s = bound_s
        w.paged.gather = self._counted

    def _counted(self, block_ids, out, layer=None) -> None:
        self._gather(block_ids, out, layer)
        with self._cond:
            for i in range(len(self.counts)) if layer is None else (layer,):
                self.counts[i] += 1
            self._cond.notify_all()

    def wait(self, layer: int, n: int) -> list[int]:
        with self._cond:
            self._cond.wait_for(lambda: self.counts[layer] >= n, timeout=self._bound_s)
            return list(self.counts)


def test_layerwise_saves_copy_each_layer_during_the_forward_in_a_step_without_synchronous_loads(server):
    """vLLM calls start_load_kv after the forward when the step has no synchronous load (most steps:
    its loads run before the forward only when the forward needs them). The step's layerwise saves were
    handed over there, after every layer's save_kv_layer had found no save to open: nothing was copied
    during the forward. The first layer's hook hands them over now: after the hook of layer N, layer N's
    chunks are copied and no later layer's; the step's start_load_kv and wait_for_save add none."""
    written, src = cpu_caches(seed=29), cpu_caches()
    save, load = ops(tokens(2 * CS + 1, seed=29), 2, [3, 4], [8, 9], req="nosync")
    w = worker(server.url, src, layerwise_saves=True)
    count = LayerCount(w)
    before = server.status()["l1"]["ready"]
    step_meta = meta(saves=[save])
    w.handle_preemptions(step_meta)  # the step as vLLM drives it: no synchronous load, so no start_load_kv yet
    shipped = []
    for i, name in enumerate(src):
        src[name].copy_(written[name])  # layer i's forward writes its blocks
        w.save_kv_layer(name, step_meta)
        shipped.append(count.wait(i, 2))  # both chunks of layer i, before layer i + 1 computes
    assert shipped == [[2] * (i + 1) + [0] * (L - i - 1) for i in range(L)]
    w.start_load_kv(step_meta)  # after the forward (nothing loads synchronously)
    save_now(w, step_meta)
    assert count.counts == [2] * L  # every layer once: the step's saves went to the saver once
    assert server.status()["l1"]["ready"] == before + 2
    dst = cpu_caches()
    r = worker(server.url, dst)
    r.start_load_kv(meta(loads=[load]))
    assert r.take_load_errors() == set() and blocks_equal(written, [3, 4], dst, [8, 9])
    w.shutdown()
    r.shutdown()


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("mode", ["sync", "layerwise", "async"])
def test_worker_saves_and_loads_blocks_exactly(server, transport, mode):
    src, dst = cpu_caches(seed=1), cpu_caches()
    toks = tokens(3 * CS + 1)
    save, load = ops(toks, 3, [7, 2, 9], [0, 5, 3], is_async=mode == "async")
    writer = worker(server.url, src, transport=transport)
    assert writer.client.transport == transport
    save_now(writer, meta(saves=[save]))
    assert server.status()["l1"]["objects"] == 3
    reader = worker(server.url, dst, transport=transport, layerwise=mode == "layerwise")
    run_load_step(reader, mode, load, list(dst))
    assert blocks_equal(src, [7, 2, 9], dst, [0, 5, 3])
    untouched = [b for b in range(12) if b not in (0, 5, 3)]
    assert all(bool((dst[n][untouched] == 0).all()) for n in dst)
    assert reader.take_load_errors() == set()
    wm = reader.take_worker_meta()
    assert (wm.loaded.keys() if wm else set()) == (set() if mode == "async" else {"r"})
    # (an inline retrieve's lease ends once the server has sent the frames: a moment after the reply)
    assert server.wait_status(lambda st: st["leases"] == 0, timeout_s=5)["leases"] == 0
    writer.shutdown()
    reader.shutdown()


def test_chunks_in_the_standard_layout(server):
    """With ``cpu_kv_layout="shared"`` what the worker stores is real per-token K and V
    (``[K, L, T, H, D]``): the same bytes vLLM's own CPU kernel was given, so any engine with this model
    and layout can read them."""
    import torch
    from vllm import _custom_ops as ops_
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    caches = cpu_caches(dtype="float32")
    keys = torch.randn(L, CS, H, D)
    values = torch.randn(L, CS, H, D)
    slots = torch.arange(4 * BS, 5 * BS)
    for i, cache in enumerate(caches.values()):
        kc, vc = cache.view(12, H, 2 * BS, D).chunk(2, dim=2)
        ops_.cpu_attn_reshape_and_cache(keys[i], values[i], kc, vc, slots, _get_attn_isa(torch.float32, BS, D))
    w = worker(server.url, caches, cpu_kv_layout="shared")
    assert w.model_id == MODEL
    toks = tokens(CS + 1)
    save, _ = ops(toks, 1, [4], [0])
    save_now(w, meta(saves=[save]))
    with KVClient(server.url, MODEL, layout("float32"), options=ClientOptions(chunk_size=CS)) as c:
        chunk = c.retrieve(toks)
    assert np.array_equal(chunk[0], keys.numpy()) and np.array_equal(chunk[1], values.numpy())
    w.shutdown()


def test_chunks_in_vllms_own_layout_by_default(server):
    """The default (``native``) stores each block's halves as vLLM's cache holds them, head by head,
    under a model id of their own, so no engine that reads per-token K/V is ever handed them."""
    caches = cpu_caches(seed=9, dtype="float32")
    w = worker(server.url, caches)
    assert w.model_id.startswith(MODEL + "@vllm-cpu-") and w.model_id.endswith(f"-native-bs{BS}")
    toks = tokens(CS + 1)
    save, _ = ops(toks, 1, [4], [0])
    save_now(w, meta(saves=[save]))
    with KVClient(server.url, MODEL, layout("float32"), options=ClientOptions(chunk_size=CS)) as c:
        assert c.lookup(toks) == 0  # not under the plain model name
    with KVClient(server.url, w.model_id, layout("float32"), options=ClientOptions(chunk_size=CS)) as c:
        chunk = c.retrieve(toks)
    for i, cache in enumerate(caches.values()):
        halves = cache.numpy()[4].reshape(H, 2, BS * D)  # block 4: per head, its K half then its V half
        assert np.array_equal(chunk[0, i].reshape(H, BS * D), halves[:, 0])
        assert np.array_equal(chunk[1, i].reshape(H, BS * D), halves[:, 1])
    w.shutdown()


def test_skipped_blocks_are_left_alone(server):
    src, dst = cpu_caches(seed=2), cpu_caches(seed=3)
    before = {n: t.clone() for n, t in dst.items()}
    toks = tokens(2 * CS + 1)
    save, load = ops(toks, 2, [1, 2], [6, 7], skip=1)
    save_now(worker(server.url, src), meta(saves=[save]))
    w = worker(server.url, dst)
    w.start_load_kv(meta(loads=[load]))
    assert blocks_equal(dst, [6], before, [6]) and blocks_equal(dst, [7], src, [2])
    w.shutdown()


def test_chunks_gone_before_the_load_become_load_errors(server):
    src, dst = cpu_caches(seed=4), cpu_caches()
    toks = tokens(3 * CS + 1)
    save, load = ops(toks, 3, [1, 2, 3], [4, 5, 6])
    saver = worker(server.url, src)
    save_now(saver, meta(saves=[save]))
    with KVClient(server.url, saver.model_id, layout("bfloat16"), options=ClientOptions(chunk_size=CS)) as c:
        c.clear()
        kv = np.zeros(layout("bfloat16").chunk_shape(CS), dtype=np.uint16)
        assert c.store(toks[:CS], kv, raw=True) == CS  # only the first chunk is back
    w = worker(server.url, dst)
    w.start_load_kv(meta(loads=[load]))
    assert w.take_load_errors() == {5, 6}
    assert w.take_worker_meta().loaded.keys() == {"r"}
    assert server.status()["leases"] == 0
    w.shutdown()


@pytest.mark.parametrize("mode", ["async", "layerwise_saves", "sync_saves"])
def test_a_step_whose_load_failed_keeps_its_save_of_that_request_off_the_server(server, mode):
    """A step loads chunks 0-1 of a request and saves what its forward computed after them; chunk 1
    is gone from the server, so its blocks stay unwritten and the forward attends to them anyway. vLLM
    recomputes once it reads the load errors, but the step's save would keep the wrong KV under the
    right hashes: it is dropped (with layerwise saves, after every layer's hook had let the saver copy),
    another request's save of that step is kept, and the request is still reported finished."""
    from kvdepot.connectors.vllm.metadata import LoadOp, SaveOp

    src, dst = cpu_caches(seed=5), cpu_caches(seed=6)
    toks, other = tokens(4 * CS + 1, seed=5), tokens(2 * CS + 1, seed=55)
    hashes = chunk_hashes(toks, CS)[:3]
    save_now(worker(server.url, src), meta(saves=[SaveOp("first", hashes[:1], "", [1])]))  # only chunk 0 is there
    before = server.status()["l1"]["objects"]
    options = {"layerwise_saves": True} if mode == "layerwise_saves" else {"async_saves": mode != "sync_saves"}
    w = worker(server.url, dst, **options)
    other_save, _ = ops(other, 2, [10, 11], [0, 0], req="other")
    step = meta(loads=[LoadOp("r", hashes[:2], "", [4, 5])], saves=[SaveOp("r", hashes, "", [4, 5, 6]), other_save])
    w.start_load_kv(step)
    for name in dst:  # the forward's hooks: every layer written
        w.save_kv_layer(name)
    if mode == "layerwise_saves":
        time.sleep(0.2)  # the saver has had time to copy every layer (and must not commit yet)
    if mode == "sync_saves":
        w.wait_for_save(step)
    else:
        save_now(w, step)
    assert w.take_load_errors() == {5}  # (vLLM reads them after wait_for_save)
    assert server.status()["l1"]["objects"] == before + (0 if mode == "layerwise_saves" else 2)  # "other": kept unless one job holds the step
    with KVClient(server.url, w.model_id, layout("bfloat16"), options=ClientOptions(chunk_size=CS)) as c:
        assert c.lookup(toks[: 3 * CS]) == CS  # chunk 0 only: nothing this step computed
    w.shutdown()


@pytest.mark.parametrize("layerwise_saves", [False, True])
def test_a_forward_that_raised_commits_none_of_its_saves(server, layerwise_saves):
    """vLLM calls wait_for_save in a ``finally`` after the forward: when the forward raised, the step's
    blocks may be half written, so its saves are dropped, and their requests still reported finished."""
    src = cpu_caches(seed=7)
    save, _ = ops(tokens(2 * CS + 1, seed=7), 2, [3, 4], [0, 0], req="broken")
    w = worker(server.url, src, layerwise_saves=layerwise_saves)
    before = server.status()["l1"]["objects"]
    step = meta(saves=[save])
    w.start_load_kv(step)
    w.save_kv_layer(next(iter(src)))  # one layer was written before the forward raised
    with pytest.raises(RuntimeError, match="the forward failed"):
        try:
            raise RuntimeError("the forward failed")
        finally:
            save_now(w, step)
    assert server.status()["l1"]["objects"] == before
    w.shutdown()


def test_worker_without_a_server_runs_uncached():
    """No server at start-up: the engine starts anyway; saves are skipped, loads become load errors
    (vLLM recomputes those blocks), and nothing waits long."""
    dst = cpu_caches()
    t0 = time.monotonic()
    w = worker(f"tcp://127.0.0.1:{free_port()}", dst, retry_after_s=60)
    assert w.client is None
    save, load = ops(tokens(2 * CS + 1), 2, [1, 2], [3, 4])
    save_now(w, meta(saves=[save]))
    w.start_load_kv(meta(loads=[load]))
    assert w.take_load_errors() == {3, 4}
    assert time.monotonic() - t0 < 5
    w.shutdown()


# --- leases under slow steps, and failure classes -------------------------------------------------------


def test_a_held_request_keeps_its_locks_past_the_ttl_and_a_dropped_one_does_not(parts_server):
    """The scheduler's clients renew the locks of the requests it still holds (waiting in vLLM's queue,
    or in a slow step); a request it no longer names is left to the TTL, the backstop for leaks."""
    srv = parts_server("--lease-ttl-s", str(TTL_S))
    toks = tokens(3 * CS + 1, seed=11)
    store(srv.url, toks, 3)
    s = scheduler(srv.url)
    held, leaked = request("held", toks), request("leaked", toks)
    assert s.get_num_new_matched_tokens(held, 0) == (3 * CS, False)
    assert s.get_num_new_matched_tokens(leaked, 0) == (3 * CS, False)
    t0 = time.monotonic()
    s._open_sessions.discard("leaked")  # as if the scheduler had lost track of it: no longer renewed
    srv.wait_status(lambda st: st["expired_leases"] >= 1)  # the leaked one's TTL ran out...
    time.sleep(max(0.0, t0 + 3 * TTL_S - time.monotonic()))  # ...and the held one lived three TTLs
    st = srv.status()
    assert st["leases"] == 1 and st["l1"]["read_locked"] == 3, "the held request lost its locks"
    assert st["expired_leases"] == 1  # the leaked one: ended by its TTL
    s.request_finished(held)
    assert srv.wait_status(lambda st: st["leases"] == 0)["leases"] == 0
    assert s.pool.breakers[Direction.LOOKUP].up
    s.shutdown()


def test_an_expired_lock_is_that_requests_miss_and_never_stops_lookups(parts_server):
    srv = parts_server("--lease-ttl-s", str(TTL_S))
    toks = tokens(2 * CS + 1, seed=12)
    store(srv.url, toks, 2)
    s = scheduler(srv.url)
    req = request("r", toks)
    assert s.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
    s._open_sessions.discard("r")  # its renewal stops (as in a process paused past the TTL): it expires
    srv.wait_status(lambda st: st["expired_leases"] >= 1)
    s.update_state_after_alloc(req, blocks([1, 2, 3]), 0)  # frees the (expired) locks: quietly
    assert s.pool.breakers[Direction.LOOKUP].up
    assert s.get_num_new_matched_tokens(request("next", toks), 0) == (2 * CS, False)  # still caching
    failures = srv.status()["request_failures"]
    # Counted on the server: as the expired lock the free met, or as the session the server dropped
    # once its lock had expired (whichever came first).
    assert failures["lease_expired"] + failures["sessions_expired"] >= 1
    s.shutdown()


def test_a_dead_server_stops_lookups_only_for_a_while(parts_server):
    srv = parts_server()
    s = scheduler(srv.url, retry_after_s=60, timeout_s=0.5)
    toks = tokens(2 * CS + 1, seed=13)
    assert s.get_num_new_matched_tokens(request("a", toks), 0) == (0, False)  # connected: a miss
    srv.proc.stop()
    t0 = time.monotonic()
    assert s.get_num_new_matched_tokens(request("b", toks), 0) == (0, False)
    assert not s.pool.breakers[Direction.LOOKUP].up
    assert s.get_num_new_matched_tokens(request("c", toks), 0) == (0, False)  # not retried: no stall
    assert time.monotonic() - t0 < 3
    assert ("lookup", "transport") in s.pool.tally.counts
    s.shutdown()


def test_lookups_and_saves_come_back_once_the_server_does(parts_server):
    """A transport failure switches lookups off for ``retry_after_s``; then one lookup probes the server
    and, answered, switches them on again. The probe must reach the server: hashing a prompt (which only
    needs the server's hash algorithm, known since connecting) must not spend the one call the breaker
    lets through, or lookups (and the saves, whose keys are hashed the same way) stay off for good."""
    srv = parts_server()
    s = scheduler(srv.url, retry_after_s=0.3, timeout_s=0.5)
    toks = tokens(2 * CS + 1, seed=16)
    assert s.get_num_new_matched_tokens(request("a", toks), 0) == (0, False)  # connected: a miss
    srv.proc.stop()
    assert s.get_num_new_matched_tokens(request("b", toks), 0) == (0, False)  # the lookup times out
    assert not s.pool.breakers[Direction.LOOKUP].up
    srv.start_again()
    store(srv.url, toks, 2)  # the restarted server holds the prompt's two chunks
    time.sleep(0.4)  # past retry_after_s: the next lookup is the probe
    assert s.get_num_new_matched_tokens(request("c", toks), 0) == (2 * CS, False)
    assert s.pool.breakers[Direction.LOOKUP].up
    # Saves are planned again, under the keys the server holds.
    other = tokens(2 * CS + 1, seed=17)
    r = request("d", other)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks([1, 2, 3]), 0)
    m = s.build_connector_meta(step(new=[(r, [1, 2, 3], 0)], scheduled={"d": len(other)}))
    assert [(op.req_id, op.hashes) for op in m.saves] == [("d", chunk_hashes(other[: 2 * CS], CS))]
    s.shutdown()


def test_an_outage_is_said_once_and_its_end_once(parts_server, caplog):
    """A server that stays away is one warning (lookups switched off), not one per probe that finds it
    still away; and once it answers again, that lookups are back on is said, once."""
    srv = parts_server()
    s = scheduler(srv.url, retry_after_s=0.2, timeout_s=1.5)  # (a loaded machine: no timeout once it is back)
    toks = tokens(2 * CS + 1, seed=18)
    assert s.get_num_new_matched_tokens(request("a", toks), 0) == (0, False)  # connected: a miss
    srv.proc.stop()
    with caplog.at_level(logging.DEBUG, logger="kvdepot"):
        for i in range(3):  # the first lookup times out; so does each later one, a probe
            assert s.get_num_new_matched_tokens(request(f"down{i}", toks), 0) == (0, False)
            time.sleep(0.25)  # past retry_after_s: the next lookup is a probe
        assert s.pool.tally.counts[("lookup", "transport")] == 3
        srv.start_again()
        deadline = time.monotonic() + 10
        while not s.pool.breakers[Direction.LOOKUP].up and time.monotonic() < deadline:
            s.get_num_new_matched_tokens(request(f"up{time.monotonic()}", toks), 0)
            time.sleep(0.05)
        for i in range(3):  # on again: nothing more is said
            s.get_num_new_matched_tokens(request(f"more{i}", toks), 0)
    assert s.pool.breakers[Direction.LOOKUP].up
    said = [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith("kvdepot.connectors")]
    off = [r for r in said if "no lookups for" in r.getMessage()]
    back = [r for r in said if "lookups back on" in r.getMessage()]
    assert len(off) == 1 and off[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert len(back) == 1 and back[0].levelno == logging.INFO, [r.getMessage() for r in said]
    s.shutdown()


def test_a_load_slower_than_the_ttl_keeps_its_lease(parts_server):
    srv = parts_server("--lease-ttl-s", str(TTL_S))
    src, dst = cpu_caches(seed=14), cpu_caches()
    toks = tokens(2 * CS + 1, seed=14)
    save, load = ops(toks, 2, [1, 2], [3, 4])
    save_now(worker(srv.url, src), meta(saves=[save]))
    w = worker(srv.url, dst, debug_load_delay_s=2.5 * TTL_S)  # a load that outlives its TTL 2.5 times
    w.start_load_kv(meta(loads=[load]))
    assert w.take_load_errors() == set()
    assert blocks_equal(src, [1, 2], dst, [3, 4])
    st = srv.status()
    assert st["expired_leases"] == 0 and st["quarantine"]["leases"] == 0
    w.shutdown()


def test_a_request_problem_on_the_worker_leaves_both_directions_on(server):
    src, dst = cpu_caches(seed=15), cpu_caches()
    toks = tokens(3 * CS + 1, seed=15)
    save, load = ops(toks, 3, [1, 2, 3], [4, 5, 6])
    w = worker(server.url, dst)
    missing = ops(tokens(2 * CS, seed=16), 2, [7, 8], [9, 10], req="missing")[1]
    w.start_load_kv(meta(loads=[missing]))  # never stored: that request recomputes
    assert w.take_load_errors() == {9, 10}
    assert w.breakers[Direction.LOAD].up and w.breakers[Direction.SAVE].up
    save_now(worker(server.url, src), meta(saves=[save]))
    w.start_load_kv(meta(loads=[load]))
    assert w.take_load_errors() == set() and blocks_equal(src, [1, 2, 3], dst, [4, 5, 6])
    w.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "uint8"])
def test_engines_whose_kv_caches_encode_bytes_differently_never_share_chunks(dtype):
    """vLLM allocates every fp8 encoding as uint8: an fp8_e5m2 engine used to share chunks with an
    fp8_e4m3 one of the same model (same layout, same model id) and load bytes it decodes wrongly."""
    from types import SimpleNamespace as NS

    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvdepot.connectors.vllm.connector import KVDepotConnector

    def model_id(cache_dtype: str) -> str:
        transfer = KVTransferConfig(kv_connector="KVDepotConnector", kv_role="kv_both", kv_connector_extra_config={"url": f"tcp://127.0.0.1:{free_port()}"})
        config = NS(kv_transfer_config=transfer, parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1),
                    model_config=NS(use_mla=False, model=MODEL), cache_config=NS(block_size=BS, cache_dtype=cache_dtype))  # fmt: skip
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=getattr(torch, dtype))
        groups = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])
        connector = KVDepotConnector(config, KVConnectorRole.SCHEDULER, groups)
        try:
            return connector._scheduler.pool.ranks[0].model
        finally:
            connector._scheduler.shutdown()

    if dtype == "uint8":
        ids = {name: model_id(name) for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head")}
        assert ids["fp8"] == ids["fp8_e4m3"]  # vLLM's fp8 is e4m3: the same bytes
        assert len({ids["fp8_e4m3"], ids["fp8_e5m2"], ids["int8_per_token_head"]}) == 3
        assert all(i.startswith(MODEL) for i in ids.values())
    else:
        assert model_id("auto") == model_id("bfloat16")  # the layout's dtype tells plain caches apart already


def test_layerwise_loads_ask_vllm_for_piecewise_cuda_graphs():
    """A full CUDA graph's replay skips wait_for_layer_load: with layer-by-layer loads on, attention
    would read blocks before their copies landed."""
    from kvdepot.connectors.vllm.connector import KVDepotConnector

    assert KVDepotConnector.requires_piecewise_for_cudagraph({"url": "tcp://127.0.0.1:1", "layerwise": True}) is True
    assert KVDepotConnector.requires_piecewise_for_cudagraph({"url": "tcp://127.0.0.1:1"}) is False


@pytest.mark.parametrize("world", [1, 2])
def test_kv_computed_over_a_failed_load_is_never_saved_by_the_next_step_another_request_or_another_rank(server, world):
    """A synchronous load left blocks 4-5 unwritten (chunk 1 was gone). The forward ran over them, and
    so did what the scheduler planned before it knew (async scheduling: the next step), another request
    that vLLM's prefix cache gave the same blocks, and, with TP, the ranks whose own load went fine (the
    bad heads reach their layers through the all-reduce). None of those saves may be committed; a save
    that does not depend on those blocks is."""
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.metadata import LoadOp, SaveOp
    from kvdepot.connectors.vllm.worker import WorkerSide

    def make(caches, rank_failed_elsewhere=False):
        w = WorkerSide(ConnectorConfig(url=server.url, chunk_size=CS), MODEL, BS, "auto", 0, world)
        w.register_kv_caches(caches)
        if rank_failed_elsewhere:  # another rank's load of chunk 1 failed; this one's went fine
            w._any_rank = lambda flags: [True] * len(flags)
        return w

    toks, other = tokens(4 * CS + 1, seed=15 + world), tokens(2 * CS + 1, seed=150 + world)
    hashes = chunk_hashes(toks, CS)
    stored = 2 if world == 2 else 1  # with TP, this rank's load finds both chunks
    src = make(cpu_caches(seed=9))
    save_now(src, meta(saves=[SaveOp("first", hashes[:stored], "", [1, 2][:stored])]))
    src.shutdown()
    w = make(cpu_caches(seed=10), rank_failed_elsewhere=world == 2)
    before = server.status()["l1"]["objects"]
    load = LoadOp("r", hashes[:2], "", [4, 5])
    # Step N: the load (and its request's save, over its own loaded blocks).
    step_n = meta(loads=[load], saves=[SaveOp("r", hashes[2:3], "", [6], over_loaded_blocks=[4, 5])])
    w.start_load_kv(step_n)
    save_now(w, step_n)
    # Step N+1, planned before the errors were known: the request's next chunk, another request over
    # the same blocks, and a request that shares nothing.
    other_save, _ = ops(other, 2, [10, 11], [0, 0], req="other")
    step_n1 = meta(saves=[SaveOp("r", hashes[3:4], "", [7], over_loaded_blocks=[4, 5]),
                          SaveOp("sharer", chunk_hashes(tokens(3 * CS, seed=99), CS)[2:3], "", [8], over_loaded_blocks=[4]),
                          other_save])  # fmt: skip
    w.start_load_kv(step_n1)
    save_now(w, step_n1)
    assert server.status()["l1"]["objects"] == before + 2  # "other"'s two chunks, nothing else
    with KVClient(server.url, w.model_id, layout("bfloat16"), options=ClientOptions(chunk_size=CS), world_size=world) as c:
        assert c.lookup(toks[: 4 * CS]) == stored * CS  # nothing computed over the failed blocks
    w.shutdown()


def test_saves_name_the_blocks_of_recent_synchronous_loads_their_kv_was_computed_over(server):
    """The scheduler cannot know in time whether a load failed (the workers find out during the step,
    and async scheduling plans the next step before that): each save names the blocks of loads of this
    schedule and the last that lie under its chunks, its own request's or another's it shares."""
    s, req, toks, first = running_after_a_hit(server, "over")
    assert [op.over_loaded_blocks for op in first.saves] == [[1, 2]]  # computed over its own load

    def sharer(req_id: str, seed: int):
        """A request whose first two chunks vLLM's prefix cache holds: blocks 1-2, shared."""
        r = request(req_id, toks[: 2 * CS] + tokens(CS + 5, seed=seed))
        assert s.get_num_new_matched_tokens(r, 2 * CS) == (0, False)
        s.update_state_after_alloc(r, blocks([1, 2, seed, seed + 1]), 0)
        return r

    a = sharer("sharer-a", 20)
    m2 = s.build_connector_meta(step(new=[(a, [1, 2, 20, 21], 2 * CS)], scheduled={"sharer-a": CS + 5}))
    assert [(op.req_id, op.over_loaded_blocks) for op in m2.saves] == [("sharer-a", [1, 2])]
    b = sharer("sharer-b", 30)
    m3 = s.build_connector_meta(step(new=[(b, [1, 2, 30, 31], 2 * CS)], scheduled={"sharer-b": CS + 5}))
    assert [(op.req_id, op.over_loaded_blocks) for op in m3.saves] == [("sharer-b", [])]  # the verdict is in by now
    for r in (req, a, b):
        s.request_finished(r)
    s.shutdown()


def test_a_layerwise_load_that_fails_to_end_is_recomputed_and_the_step_still_reaches_its_verdict(server):
    """The saves' verdict is collective over the TP group: a rank whose layer-by-layer load raised on its
    way out used to skip it (raising), leaving the other ranks waiting in the collective."""
    from kvdepot.connectors.vllm.metadata import LoadOp

    toks = tokens(2 * CS + 1, seed=61)
    hashes = chunk_hashes(toks, CS)
    w = worker(server.url, cpu_caches(seed=61), layerwise=True)
    step_meta = meta(loads=[LoadOp("lw", hashes[:2], "", [2, 3])])
    w.start_load_kv(step_meta)
    job = w._layerwise
    assert job is not None
    job.join()  # (let its thread end first; then make its end fail, as a broken copy would)

    def broken() -> None:
        raise RuntimeError("the copy thread died")

    job.join = broken
    w.wait_for_save(step_meta)  # does not raise
    assert w.take_load_errors() >= {2, 3}
    w.shutdown()
