"""Request-lifecycle edges of the vLLM connector, its halves driven in process against a real server:
what vLLM is told to wait for must be reported, and what it is told not to wait for must not be.

vLLM's own request, block and scheduler-output types; no engine is started.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.bench.engines.vllm_engines import require_vllm

from support.vllm_objects import blocks, reports, request, run_step, step, tokens

CS = BS = 128  # one chunk is one vLLM CPU block here
MODEL = "edges-model"
L, H, D = 3, 2, 64


@pytest.fixture(scope="module", autouse=True)
def vllm_present():
    require_vllm()


@pytest.fixture
def server(make_server):
    return make_server(ipc=False, base=("--chunk-size", str(CS), "--l1-size-gb", "0.25", "--no-prefault"))


def connector(url: str, **options):
    """The scheduler role of ``KVDepotConnector``, as vLLM builds it (its hooks, not SchedulerSide's)."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvdepot.connectors.vllm.connector import KVDepotConnector

    extra = {"url": url, "chunk_size": CS, "timeout_s": 5.0, **options}
    transfer = KVTransferConfig(kv_connector="KVDepotConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    config = NS(kv_transfer_config=transfer, parallel_config=NS(pipeline_parallel_size=1, tensor_parallel_size=1),
                model_config=NS(use_mla=False, model=MODEL), cache_config=NS(block_size=BS, cache_dtype="auto"))  # fmt: skip
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    groups = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    return KVDepotConnector(config, KVConnectorRole.SCHEDULER, groups)


def worker(url: str, **options):
    import torch

    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.worker import WorkerSide

    whole = torch.randn(L, 12, H, BS, 2 * D, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    w = WorkerSide(ConnectorConfig(url=url, chunk_size=CS, **options), MODEL, BS, "auto", 0, 1)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": whole[i] for i in range(L)})
    return w




@pytest.mark.parametrize("preempted_first", [True, False])
def test_a_request_preempted_outside_a_schedule_then_aborted_is_freed_without_waiting_for_a_report(server, preempted_first):
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts running requests between two
    schedules, and an abort can end one before the next schedule tells the connector of the preemption.
    vLLM freed its blocks at the preemption and hands request_finished none; the workers drain and forget
    its saves when the preemption reaches them, so no report ever comes. Answering "free later" (it had
    a save planned) left the request in vLLM's table for good: the engine never went idle again. A
    request that still holds its blocks (not preempted) keeps waiting for its saves, and is reported."""
    conn = connector(server.url)
    w = worker(server.url)
    req = request("r", tokens(4 * CS + 20, seed=1))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), 0)
    first = conn.build_connector_meta(step(new=[(req, [1, 2, 3, 4, 5], 0)], scheduled={"r": 4 * CS + 20}))
    assert [op.req_id for op in first.saves] == ["r"]
    run_step(w, first)  # its save is handed to the saver thread
    if preempted_first:
        # reset_prefix_cache preempted it (its blocks are freed), then it was aborted.
        req.num_preemptions += 1  # (vLLM's _preempt_request)
        req.num_computed_tokens = 0
        delay, _ = conn.request_finished(req, [])
        nxt = conn.build_connector_meta(step(preempted={"r"}))
        assert nxt.preempted == ["r"]
    else:
        delay, _ = conn.request_finished(req, [1, 2, 3, 4, 5])
        nxt = conn.build_connector_meta(step())
    run_step(w, nxt)
    reported = reports(w, {"r"})
    assert delay == bool(reported), f"vLLM told to wait for a report: {delay}; reported: {reported}"
    assert delay is not preempted_first
    assert server.wait_status(lambda st: st["sessions"] == 0)["sessions"] == 0
    w.shutdown()
    conn.shutdown()


def store(url: str, model: str, toks: list[int], n_chunks: int) -> None:
    """``n_chunks`` chunks of ``toks`` under ``model``, in the connector's layout (bfloat16, as raw bits)."""
    lay = KVLayout(L, H, D, "bfloat16")
    kv = np.zeros(lay.chunk_shape(n_chunks * CS), dtype=np.uint16)
    with KVClient(url, model, lay, options=ClientOptions(chunk_size=CS)) as c:
        assert c.store(toks[: n_chunks * CS], kv, raw=True) == n_chunks * CS


def test_an_async_load_whose_failed_blocks_came_a_step_before_its_done_is_not_claimed_again(server):
    """vLLM takes an asynchronous load's failed blocks in any step up to the one that reports the load
    done (get_block_ids_with_load_errors), and the worker's loader thread can add them just after one
    step's get_finished and its done just before the next. The scheduler looked for them only in the
    step of the done: the load passed for a success, and vLLM, which had re-queued the request with
    nothing valid, was offered the same hit again, to load (and fail) once more."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvdepot.connectors.vllm.scheduler import SchedulerSide

    toks = tokens(2 * CS + 3, seed=2)
    conn = connector(server.url, load_async=True)
    sched = conn._scheduler
    assert isinstance(sched, SchedulerSide)
    store(server.url, sched.pool.ranks[0].model, toks, 2)
    req = request("a", toks)
    assert conn.get_num_new_matched_tokens(req, 0) == (2 * CS, True)
    conn.update_state_after_alloc(req, blocks([3, 4]), 2 * CS)
    meta = conn.build_connector_meta(step())
    assert [(op.block_ids, op.is_async) for op in meta.loads] == [([3, 4], True)]
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids={3, 4}))  # this step: its errors
    conn.update_connector_output(KVConnectorOutput(finished_recving={"a"}))  # the next: its done
    req.num_computed_tokens = 0  # vLLM freed its blocks and re-queued it
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, blocks([6, 7, 8]), 0)
    assert conn.build_connector_meta(step(new=[(req, [6, 7, 8], 0)], scheduled={"a": 2 * CS + 3})).loads == []
    conn.request_finished(req, [6, 7, 8])
    assert server.wait_status(lambda st: st["sessions"] == 0)["sessions"] == 0
    conn.shutdown()
