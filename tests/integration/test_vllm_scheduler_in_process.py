"""The vLLM connector's scheduler half against vLLM's own request and scheduler-output types, with a
lookup client that answers from a table (no server), and a worker half whose server is unreachable
(every load fails): what vLLM is told to wait for is reported, what it is not told is never reported,
and a chain's keys follow its adapter's root."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from kvdepot.bench.engines.vllm_engines import require_vllm
from kvdepot.hashing import HashAlgorithm

from support.vllm_objects import blocks, reports, request, run_step, step, tokens

CS = BS = 128


@pytest.fixture(scope="module", autouse=True)
def vllm_present():
    require_vllm()


class TableClient:
    """A lookup client whose every lookup hits its first ``hits`` chunks."""

    hash_algorithm = HashAlgorithm.SHA256

    def __init__(self, hits: int = 0) -> None:
        self.hits = hits

    def lookup_reply(self, hashes, cache_salt=None, session_id="", **kw):
        n = min(self.hits, len(hashes))
        return NS(hits=n, in_l1=n)

    def free_lookup_locks(self, sid, start=0, end=-1):
        pass

    def end_session(self, sid):
        pass


def scheduler(hits: int = 0, hash_cache: bool = True):
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.hash_cache import ChunkHashCache
    from kvdepot.connectors.vllm.scheduler import SchedulerSide
    from kvdepot.layout import KVLayout

    cache = ChunkHashCache(CS, BS) if hash_cache else None
    side = SchedulerSide(ConnectorConfig(url="tcp://127.0.0.1:1", chunk_size=CS), "m", KVLayout(2, 2, 64, "bfloat16"), BS, 1, hash_cache=cache)
    client = TableClient(hits)
    side.pool.get = lambda: [client]
    side.pool.hash_algorithm = lambda: client.hash_algorithm  # connected: what hashing reads, asking no breaker
    return side


def worker_without_server():
    """A CPU worker half whose server does not answer: every load finds nothing (its blocks become
    load errors), as when the chunks went between lookup and load."""
    import torch

    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.worker import WorkerSide

    whole = torch.zeros(2, 12, 2, BS, 128, dtype=torch.bfloat16)
    config = ConnectorConfig(url="tcp://127.0.0.1:9", chunk_size=CS, timeout_s=0.2, retry_after_s=60.0)
    w = WorkerSide(config, "m", BS, "auto", 0, 1)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": whole[i] for i in range(2)})
    return w




def test_a_request_aborted_after_its_first_loaded_block_failed_is_reported_as_vllm_waits_for():
    """vLLM hands request_finished the blocks of the request's *computed* tokens only. A synchronous
    load whose first block failed sets those to none while the request keeps all its blocks, and its
    step's save (dropped, unsafe) still owes a report. Aborted then, it was answered "free now" (an
    empty list read as "preempted"), and the workers' report a step later named a request vLLM had
    deleted: vLLM's engine core dies on that (an assertion in _update_from_kv_xfer_finished)."""
    from vllm.v1.outputs import KVConnectorOutput

    sched, w = scheduler(hits=2, hash_cache=False), worker_without_server()
    try:
        req = request("r", tokens(3 * CS + 5, seed=3))
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * CS, False)
        sched.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 2 * CS)
        meta = sched.build_connector_meta(step(new=[(req, [1, 2, 3, 4], 2 * CS)], scheduled={"r": CS + 5}))
        assert [op.req_id for op in meta.loads] == ["r"] and [op.req_id for op in meta.saves] == ["r"]
        run_step(w, meta)
        errors = w.take_load_errors()
        assert 1 in errors  # vLLM truncates num_computed_tokens to 0
        sched.update_connector_output(KVConnectorOutput(invalid_block_ids=errors, kv_connector_worker_meta=w.take_worker_meta()))
        req.num_computed_tokens = 0
        delay, _ = sched.request_finished(req, [])  # aborted: it holds blocks 1-4, none computed
        run_step(w, sched.build_connector_meta(step()))
        reported = reports(w, {"r"})
        assert delay == bool(reported), f"vLLM told to wait: {delay}; the workers reported: {reported}"
    finally:
        w.shutdown()


@pytest.mark.parametrize("counted", [True, False], ids=["vllm_counts_preemptions", "an_older_vllm"])
def test_a_request_preempted_between_schedules_then_aborted_is_neither_waited_for_nor_reported(counted):
    """Told by vLLM's preemption count; a vLLM without one (no ``num_preemptions``) by the empty list of
    blocks it still holds, as before."""
    sched, w = scheduler(hash_cache=False), worker_without_server()
    try:
        req = request("p", tokens(4 * CS + 20, seed=1))
        if not counted:
            req = _WithoutPreemptionCount(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
        first = sched.build_connector_meta(step(new=[(req, [1, 2, 3, 4, 5], 0)], scheduled={"p": 4 * CS + 20}))
        assert [op.req_id for op in first.saves] == ["p"]
        run_step(w, first)
        if counted:
            req.num_preemptions += 1  # vLLM's _preempt_request (reset_prefix_cache)
        req.num_computed_tokens = 0
        delay, _ = sched.request_finished(req, [])
        run_step(w, sched.build_connector_meta(step(preempted={"p"})))
        assert not delay and not reports(w, {"p"})
    finally:
        w.shutdown()


class _WithoutPreemptionCount:
    """A vLLM request as an older vLLM made it: everything but ``num_preemptions``."""

    def __init__(self, req) -> None:
        object.__setattr__(self, "_req", req)

    def __getattr__(self, name):
        if name == "num_preemptions":
            raise AttributeError(name)
        return getattr(self._req, name)

    def __setattr__(self, name, value):
        setattr(self._req, name, value)


def _adapter(path, weights: bytes) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_bytes(b'{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return str(path)


@pytest.mark.parametrize("hash_cache", [True, False], ids=["hash_cache", "no_hash_cache"])
def test_an_adapter_reloaded_in_place_gets_keys_of_its_own(tmp_path, hash_cache):
    """vLLM names an adapter in its prefix hashes by name and path only; one reloaded in place keeps
    both, and kvdepot gives it a new root. The hash cache, keyed by vLLM's hashes alone, handed the
    reloaded adapter's requests the old adapter's keys: KV of the old weights served for the new."""
    from vllm.lora.request import LoRARequest

    path = _adapter(tmp_path / "a", b"w" * 64)
    sched = scheduler(hash_cache=hash_cache)
    toks = tokens(3 * CS + 5, seed=7)
    first = request("r1", toks, vllm_hashes=True, lora_request=LoRARequest("a", 1, path, load_inplace=True))
    sched.get_num_new_matched_tokens(first, 0)
    old_root, old_keys = sched.states["r1"].root, list(sched.states["r1"].hashes)
    assert len(old_keys) == 3
    _adapter(tmp_path / "a", b"new weights, another size")  # replaced, then reloaded in place
    again = request("r2", toks, vllm_hashes=True, lora_request=LoRARequest("a", 1, path, load_inplace=True))
    sched.get_num_new_matched_tokens(again, 0)
    st = sched.states["r2"]
    assert st.root != old_root
    assert not set(st.hashes) & set(old_keys), "the reloaded adapter's requests got the old adapter's keys"


def test_a_layer_that_reuses_another_layers_kv_cache_is_not_counted_twice():
    """Cross-layer KV sharing (Gemma 3n, Gemma 4): vLLM hands the worker a sharing layer as its
    target's tensor again, and leaves it out of the KV-cache groups the scheduler half counts its layers
    from. The worker counted it, so the halves' layouts (part of every key) differed: every lookup
    missed, and every save stored the shared layers twice."""
    import torch

    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.paged_layout import make_layout
    from kvdepot.connectors.vllm.worker import WorkerSide

    whole = torch.zeros(3, 12, 2, BS, 128, dtype=torch.bfloat16)
    caches = {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(3)}
    caches["model.layers.3.self_attn.attn"] = caches["model.layers.1.self_attn.attn"]  # layer 3 reuses layer 1's
    caches["model.layers.4.self_attn.attn"] = caches["model.layers.2.self_attn.attn"]
    w = WorkerSide(ConnectorConfig(url="tcp://127.0.0.1:9", chunk_size=CS, timeout_s=0.2, retry_after_s=60.0), "m", BS, "auto", 0, 1)
    try:
        w.register_kv_caches(caches)
        assert w._layout == make_layout(3, 2, 64, torch.bfloat16)  # what the scheduler makes of 3 layers in its group
        assert sorted(w.layer_index.values()) == [0, 1, 2] and "model.layers.3.self_attn.attn" not in w.layer_index
    finally:
        w.shutdown()
