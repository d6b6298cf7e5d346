"""A load's missing chunks are told in the step that loaded them, also when vLLM asks before
``wait_for_save``. vLLM with speculative decoding (any ``speculative_config``: EAGLE, MTP, ngram, draft model) defers
``wait_for_save`` until after the drafter ran (gpu_model_runner.py ``defer_kv_connector_finalize``,
kv_connector_model_runner_mixin.py ``_get_kv_connector_output(defer_finalize=True)``), so a step goes:

    start_load_kv -> forward (wait_for_layer_load per layer) -> get_finished
    -> get_block_ids_with_load_errors -> build_connector_worker_meta -> [sample, draft] -> wait_for_save

A synchronous *layer-by-layer* load whose chunks the server no longer has must report their blocks
in that step's get_block_ids_with_load_errors: vLLM then drops the token it sampled from that forward
(``update_from_output`` skips the affected request) and recomputes. Reported a step late, the token
computed over the unwritten blocks has already been appended to the request and streamed. The halves
are driven in process in that order against a real server that holds the first of two chunks; no
engine is started.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

from kvdepot.bench.engines.vllm_engines import require_vllm
from kvdepot.hashing import chunk_hashes


@pytest.fixture(scope="module", autouse=True)
def vllm_present():
    require_vllm()


# --- the device paths (vLLM's 5-d GPU layouts), run here on CPU tensors through the worker's mover ---

DCS, DBS, DNB = 64, 16, 16
DL, DH, DD = 3, 2, 32


@pytest.fixture
def dserver(make_server):
    return make_server(ipc=False, base=("--chunk-size", str(DCS), "--l1-size-gb", "0.0625", "--no-prefault"))


def worker(url, model, chunk, block, caches, **options):
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.worker import WorkerSide

    w = WorkerSide(ConnectorConfig(url=url, chunk_size=chunk, **options), model, block, "auto", 0, 1)
    w.register_kv_caches(caches)
    return w


def device_worker(url, layers, **options):
    return worker(url, "dmodel", DCS, DBS, {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)}, **options)


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_device_layerwise_load_reports_missing_chunks_before_a_deferred_wait_for_save(dserver, transport):
    from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata, LoadOp, SaveOp

    src = [t for t in torch.randn((DL, 2, DNB, DBS, DH, DD), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)]
    dst = [t for t in torch.zeros((DL, 2, DNB, DBS, DH, DD), dtype=torch.bfloat16)]
    toks = np.random.default_rng(5).integers(3, 30000, size=2 * DCS + 1).tolist()
    hashes = chunk_hashes(toks, DCS)[:2]
    writer = device_worker(dserver.url, src, transport="inline")
    writer.wait_for_save(KVDepotConnectorMetadata(saves=[SaveOp("w", hashes[:1], "", [0, 1, 2, 3])]))  # chunk 0 only
    writer.shutdown()  # (drains its saver)

    w = device_worker(dserver.url, dst, transport=transport, layerwise=True)
    step = KVDepotConnectorMetadata(loads=[LoadOp("r", hashes, "", [4, 5, 6, 7, 8, 9, 10, 11])])
    w.handle_preemptions(step)
    w.start_load_kv(step)
    for name in [f"model.layers.{i}.self_attn.attn" for i in range(DL)]:
        w.wait_for_layer_load(name)  # the forward
    w.take_finished_saves(set()), w.take_finished_async()  # get_finished
    errors_this_step = w.take_load_errors()  # get_block_ids_with_load_errors, before the deferred wait_for_save
    w.wait_for_save(step)  # finalize_kv_connector, after the drafter
    errors_next_step = w.take_load_errors()
    w.shutdown()
    assert errors_this_step == {8, 9, 10, 11}, (
        f"chunk 1 was missing at start_load_kv, yet this step reported {errors_this_step} "
        f"(and the next step {errors_next_step}): vLLM kept the token sampled over the unwritten blocks"
    )


# --- vLLM's CPU layout, layer by layer on the helper thread ---

CS = BS = 128
L, H, D = 3, 2, 64


@pytest.fixture
def server(make_server):
    return make_server(ipc=False, base=("--chunk-size", str(CS), "--l1-size-gb", "0.25", "--no-prefault"))


def cpu_worker(url, caches, **options):
    return worker(url, "cmodel", CS, BS, caches, **options)


def cpu_caches(seed=None):
    whole = torch.zeros(L, 12, H, BS, 2 * D, dtype=torch.bfloat16)
    if seed is not None:
        whole.copy_(torch.randn(whole.shape, generator=torch.Generator().manual_seed(seed)))
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(L)}


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_cpu_layerwise_load_reports_missing_chunks_before_a_deferred_wait_for_save(server, transport):
    """The helper thread knows the chunk is missing when the server answers, before the first layer;
    it reports it only when the views are given back, after the last layer's event. Anything that
    makes that release take a moment (here: 0.3 s, standing for a slow release or a descheduled helper
    thread on a loaded host) lets the engine's get_block_ids_with_load_errors pass before it."""
    from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata, LoadOp, SaveOp

    toks = np.random.default_rng(6).integers(3, 30000, size=2 * CS + 1).tolist()
    hashes = chunk_hashes(toks, CS)[:2]
    writer = cpu_worker(server.url, cpu_caches(seed=2), transport="inline")
    writer.wait_for_save(KVDepotConnectorMetadata(saves=[SaveOp("w", hashes[:1], "", [1])]))
    writer.shutdown()

    dst = cpu_caches()
    w = cpu_worker(server.url, dst, transport=transport, layerwise=True)
    client = w.client
    real = client.prepare_retrieve

    @contextlib.contextmanager
    def slow_release(*args, **kwargs):
        with real(*args, **kwargs) as views:
            yield views
            time.sleep(0.3)

    client.prepare_retrieve = slow_release
    step = KVDepotConnectorMetadata(loads=[LoadOp("r", hashes, "", [4, 5])])
    w.start_load_kv(step)
    for name in dst:
        w.wait_for_layer_load(name)
    errors_this_step = w.take_load_errors()
    w.wait_for_save(step)
    errors_next_step = w.take_load_errors()
    w.shutdown()
    assert errors_this_step == {5}, f"this step reported {errors_this_step}, the next {errors_next_step}"
