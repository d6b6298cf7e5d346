"""The vLLM connector's worker half with vLLM's GPU cache layouts (FlashAttention's ``kv_first``,
FlashInfer's ``block_first``), driven directly against a real server, on each path: the server moves
the blocks (``cuda_ipc``; with CPU tensors, a host cache file, the same server code), or the worker's
mover does (``shm``, ``inline``). Run on the CPU everywhere and on CUDA where there is a GPU: the same
ops, the same checks, every byte compared. On a GPU machine without vLLM, vLLM's two metadata base
classes are stood in (``support.vllm_bases``): the worker half needs nothing else of vLLM.
"""

from __future__ import annotations


import time

import numpy as np
import pytest
import torch

from kvdepot.bench.engines.vllm_engines import require_vllm
from kvdepot.gpu.memory import HostCacheFile
from kvdepot.hashing import chunk_hashes

from e2e.test_connector_parts import meta, run_load_step, save_now  # the same step helpers as the CPU layouts' tests
from support import vllm_bases
from support.devices import DEVICES, HAVE_CUDA

CS, BS, NB = 64, 16, 16  # 4 blocks a chunk
L, H, D = 3, 2, 32
MODEL = "device-model"


@pytest.fixture(scope="module", autouse=True)
def vllm_present():
    """vLLM, or on a GPU machine without it (the one lent to kvdepot has torch and no vLLM) its two
    metadata base classes stood in: the worker half imports nothing else of vLLM (``support.vllm_bases``)."""
    if HAVE_CUDA and not vllm_bases.vllm_installed():
        added = vllm_bases.stand_in()
        yield
        vllm_bases.remove(added)
        return
    require_vllm()
    yield


@pytest.fixture
def server(make_server, tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    return make_server("--shm-dir", str(shm), ipc=False, base=("--chunk-size", str(CS), "--l1-size-gb", "0.0625", "--no-prefault"))


class Caches:
    """vLLM-like per-layer caches on ``device`` (in a host cache file on the CPU when the server is to
    reach them), by layer name."""

    def __init__(self, device: str, fmt: str, shm_dir: str, in_file: bool, seed: int | None, dtype=torch.bfloat16) -> None:
        shape = (2, NB, BS, H, D) if fmt == "kv_first" else (NB, 2, BS, H, D)
        self.file = HostCacheFile.create(shm_dir, L, shape, dtype) if in_file and device == "cpu" else None
        layers = self.file.layers if self.file else [t for t in torch.zeros((L, *shape), dtype=dtype, device=device)]
        if seed is not None:  # random bits, every pattern (fp8 and bf16 included), made on the CPU
            gen = torch.Generator().manual_seed(seed)
            bits = {1: torch.uint8, 2: torch.int16}[layers[0].element_size()]
            for t in layers:
                t.view(bits).copy_(torch.randint(0, 1 << 16, t.shape, generator=gen, dtype=torch.int32).to(bits))
        self.fmt = fmt
        self.by_name = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(layers)}

    def blocks(self, ids: list[int]) -> list:
        bits = {1: torch.uint8, 2: torch.int16}[next(iter(self.by_name.values())).element_size()]
        return [(t if self.fmt == "kv_first" else t.transpose(0, 1))[:, ids].view(bits).cpu() for t in self.by_name.values()]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def worker(url: str, caches: Caches, rank: int = 0, world: int = 1, **options):
    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.worker import WorkerSide

    w = WorkerSide(ConnectorConfig(url=url, chunk_size=CS, **options), MODEL, BS, "auto", rank, world)
    w.register_kv_caches(caches.by_name)
    return w


def ops(seed: int, n: int, src_blocks, dst_blocks, skip=0, is_async=False, req="r"):
    from kvdepot.connectors.vllm.metadata import LoadOp, SaveOp

    toks = np.random.default_rng(seed).integers(3, 30000, size=n * CS + 1).tolist()
    hashes = chunk_hashes(toks, CS)[:n]
    return SaveOp(req, hashes, "", list(src_blocks)), LoadOp(req, hashes, "", list(dst_blocks), skip, is_async)


EXPECTED_PATH = {"cuda_ipc": ("host_file", "cuda_ipc"), "shm": ("shm", "shm (pinned)"), "inline": ("inline",)}


def load_and_check(server, device, fmt, transport, mode, src, src_ids, seed, store_transport=None):
    dst = Caches(device, fmt, server_shm(server), transport == "cuda_ipc", None)
    writer = worker(server.url, src, transport=store_transport or transport)
    save, load = ops(seed, 2, src_ids, [12, 1, 7, 3, 0, 5, 9, 14], skip=1, is_async=mode == "async")
    save_now(writer, meta(saves=[save]))
    reader = worker(server.url, dst, transport=transport, layerwise=mode == "layerwise")
    run_load_step(reader, mode, load, list(dst.by_name))
    assert reader.device.path in EXPECTED_PATH[transport], reader.device.path
    if device == "cuda":
        torch.cuda.synchronize()
    assert reader.take_load_errors() == set()
    wanted = src.blocks(src_ids[1:])  # block 12 was skipped: vLLM's own prefix cache has it
    got = dst.blocks([1, 7, 3, 0, 5, 9, 14])
    assert all(torch.equal(a, b) for a, b in zip(wanted, got))
    untouched = [b for b in range(NB) if b not in (1, 7, 3, 0, 5, 9, 14)]
    assert all(not t.any() for t in dst.blocks(untouched))
    assert server.wait_status(lambda st: st["leases"] == 0, timeout_s=10)["leases"] == 0
    writer.shutdown()
    reader.shutdown()
    dst.close()


def server_shm(server) -> str:
    args = server.proc.args
    return args[args.index("--shm-dir") + 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["cuda_ipc", "shm", "inline"])
@pytest.mark.parametrize("mode", ["sync", "layerwise", "async"])
def test_saves_and_loads_are_bit_exact_on_every_path(server, device, transport, mode):
    src = Caches(device, "kv_first", server_shm(server), transport == "cuda_ipc", seed=3)
    load_and_check(server, device, "kv_first", transport, mode, src, [4, 5, 6, 7, 10, 11, 2, 13], seed=3)
    src.close()


def test_an_async_load_marks_the_engine_stream_on_the_engine_thread(server, monkeypatch):
    """An async load runs on a thread of its own, whose current stream is not the engine's (on a GPU
    past the first, not even on its device): "after the engine's work so far" is marked when the engine
    asks for the load, on its thread, and the load waits for that mark."""
    import threading

    src = Caches("cpu", "kv_first", server_shm(server), False, seed=6)
    dst = Caches("cpu", "kv_first", server_shm(server), False, None)
    writer = worker(server.url, src, transport="shm")
    save, load = ops(6, 2, [4, 5, 6, 7, 10, 11, 2, 13], [12, 1, 7, 3, 0, 5, 9, 14], is_async=True)
    save_now(writer, meta(saves=[save]))
    reader = worker(server.url, dst, transport="shm")
    marks, waits = [], []
    ready = reader.device.ready
    monkeypatch.setattr(reader.device, "ready", lambda: (marks.append(threading.current_thread()), ready())[1])
    mover_load = reader.device.mover.load
    monkeypatch.setattr(reader.device.mover, "load", lambda *a, **k: (waits.append(k.get("ready")), mover_load(*a, **k))[1])
    run_load_step(reader, "async", load, list(dst.by_name))
    assert marks == [threading.main_thread()], marks
    assert len(waits) == 1 and waits[0] is None  # on the CPU the mark is (None, b""): its event
    assert reader.take_load_errors() == set()
    assert all(torch.equal(a, b) for a, b in zip(src.blocks([4, 5, 6, 7, 10, 11, 2, 13][1:]), dst.blocks([1, 7, 3, 0, 5, 9, 14])))
    writer.shutdown()
    reader.shutdown()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["cuda_ipc", "shm"])
def test_flashinfer_layout_and_chunks_shared_across_paths(server, device, transport):
    """Stored by the other path, loaded by this one: the chunks are one layout whoever moved them."""
    other = "shm" if transport == "cuda_ipc" else "cuda_ipc"
    src = Caches(device, "block_first", server_shm(server), True, seed=4)
    load_and_check(server, device, "block_first", transport, "sync", src, [0, 2, 4, 6, 8, 10, 12, 14], seed=4, store_transport=other)
    src.close()


def test_chunks_are_the_shared_layout_under_the_plain_model_id(server):
    """A GPU worker's chunks are per-token K/V: a plain KVClient of the same model reads them as such."""
    from kvdepot import ClientOptions, KVClient, KVLayout

    src = Caches("cpu", "kv_first", server_shm(server), False, seed=5)
    w = worker(server.url, src, transport="shm")
    assert w.model_id == MODEL
    save, _ = ops(5, 1, [3, 2, 1, 0], [0, 0, 0, 0])
    save_now(w, meta(saves=[save]))
    with KVClient(server.url, MODEL, KVLayout(L, H, D, "bfloat16"), options=ClientOptions(chunk_size=CS)) as c:
        with c.prepare_retrieve(save.hashes) as views:
            assert len(views) == 1
            for layer, t in enumerate(src.by_name.values()):
                want = t[:, [3, 2, 1, 0]].reshape(2, CS, H, D).view(torch.int16).numpy()
                assert np.array_equal(views[0][:, layer].view(np.int16), want)
    w.shutdown()


def test_cuda_ipc_asked_for_and_not_offered_is_a_miss_said_in_the_log(make_server, tmp_path, caplog):
    """An explicit ``transport: cuda_ipc`` the server cannot give is refused (not silently another path):
    saves and loads are misses, the engine runs on."""
    server = make_server("--gpu-transfer", "off", ipc=False, base=("--chunk-size", str(CS), "--l1-size-gb", "0.0625", "--no-prefault"))
    src = Caches("cpu", "kv_first", str(tmp_path), True, seed=6)
    w = worker(server.url, src, transport="cuda_ipc")
    save, load = ops(6, 1, [0, 1, 2, 3], [4, 5, 6, 7])
    save_now(w, meta(saves=[save]))
    assert server.status()["l1"]["objects"] == 0
    assert "cuda_ipc" in w.device.path and "refused" in w.device.path
    w.start_load_kv(meta(loads=[load]))
    assert w.take_load_errors() == {4, 5, 6, 7}
    assert any("no server-driven path" in r.getMessage() for r in caplog.records)
    w.shutdown()
    src.close()


def test_the_server_driven_path_comes_back_once_the_server_does(server):
    """Loads and saves that the server moves itself (cuda_ipc; a host cache file on the CPU) switch off
    for ``retry_after_s`` after a transport failure, like any other; then one of each probes the server
    and, answered, switches its direction on again. The server's answer to RETRIEVE_BLOCKS and
    STORE_BLOCKS must count as the direction's: else each probe is served and the direction stays off,
    one transfer per ``retry_after_s`` let through and every other one a miss, until the engine restarts."""
    import time

    from kvdepot.connectors.common import Direction

    caches = Caches("cpu", "kv_first", server_shm(server), True, seed=12)
    w = worker(server.url, caches, transport="cuda_ipc", retry_after_s=0.2, timeout_s=1.5)  # (a loaded machine: no timeout once it is back)
    assert w.device.path == "host_file"
    save, load = ops(12, 2, [4, 5, 6, 7, 10, 11, 2, 13], [12, 1, 8, 3, 0, 15, 9, 14])
    server.proc.stop()
    save_now(w, meta(saves=[save]))  # times out: saves are off for a while
    run_load_step(w, "sync", load, list(caches.by_name))  # times out: loads are off for a while
    assert w.take_load_errors() == set(load.block_ids)
    assert not w.breakers[Direction.SAVE].up and not w.breakers[Direction.LOAD].up
    server.start_again()
    deadline = time.monotonic() + 10  # many retry intervals
    while not (w.breakers[Direction.SAVE].up and w.breakers[Direction.LOAD].up) and time.monotonic() < deadline:
        save_now(w, meta(saves=[save]))
        run_load_step(w, "sync", load, list(caches.by_name))
        w.take_load_errors()
        time.sleep(0.05)
    assert w.breakers[Direction.SAVE].up, "saves never came back after the server did"
    assert w.breakers[Direction.LOAD].up, "loads never came back after the server did"
    # Back for good: the next load (and the save before it) go through, not one per retry interval.
    save_now(w, meta(saves=[save]))
    run_load_step(w, "sync", load, list(caches.by_name))
    assert w.take_load_errors() == set()
    assert all(torch.equal(a, b) for a, b in zip(caches.blocks(save.block_ids[1:]), caches.blocks(load.block_ids[1:])))
    w.shutdown()
    caches.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transport", ["cuda_ipc", "shm"])
def test_fp8_caches_and_tensor_parallel_ranks_keep_their_own_chunks(server, device, transport):
    """Two TP ranks store their own shards of the same prompt under the same hashes (fp8 caches, every
    bit pattern): each rank's reader gets its own rank's bytes back, never the other's."""
    dtype = getattr(torch, "float8_e4m3fn")
    shm = server_shm(server)
    srcs = [Caches(device, "kv_first", shm, transport == "cuda_ipc", seed=10 + r, dtype=dtype) for r in range(2)]
    dsts = [Caches(device, "kv_first", shm, transport == "cuda_ipc", None, dtype=dtype) for _ in range(2)]
    save, load = ops(9, 1, [8, 9, 10, 11], [0, 1, 2, 3])
    for rank in range(2):
        w = worker(server.url, srcs[rank], rank=rank, world=2, transport=transport)
        save_now(w, meta(saves=[save]))
        w.shutdown()
    assert server.status()["l1"]["objects"] == 2  # one chunk per rank
    for rank in range(2):
        r = worker(server.url, dsts[rank], rank=rank, world=2, transport=transport)
        r.start_load_kv(meta(loads=[load]))
        r.wait_for_save(meta())
        assert r.take_load_errors() == set()
        r.shutdown()
    if device == "cuda":
        torch.cuda.synchronize()
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(srcs[rank].blocks([8, 9, 10, 11]), dsts[rank].blocks([0, 1, 2, 3])))
    assert not all(torch.equal(a, b) for a, b in zip(dsts[0].blocks([0, 1, 2, 3]), dsts[1].blocks([0, 1, 2, 3])))
    for c in srcs + dsts:
        c.close()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_loads_come_back_once_the_server_does(server, transport):
    """A load that times out switches loads off for ``retry_after_s``; then one load probes the server
    and, answered, switches them on again. On the worker's own path (the mover copies: shm, inline) the
    probe must reach the server: asking for the path must not spend the one load the breaker lets
    through and leave the retrieve itself turned away, or loads stay off for good."""
    from kvdepot.connectors.common import Direction

    shm = server_shm(server)
    src = Caches("cpu", "kv_first", shm, False, seed=8)
    dst = Caches("cpu", "kv_first", shm, False, None)
    reader = worker(server.url, dst, transport=transport, retry_after_s=0.2, timeout_s=1.5)  # (a loaded machine: no timeout once it is back)
    save, load = ops(8, 2, [4, 5, 6, 7, 10, 11, 2, 13], [12, 1, 7, 3, 0, 5, 9, 14])
    server.proc.stop()
    run_load_step(reader, "sync", load, list(dst.by_name))  # the load times out: its blocks are recomputed
    assert reader.take_load_errors() == set(load.block_ids)
    assert not reader.breakers[Direction.LOAD].up
    server.start_again()
    writer = worker(server.url, src, transport=transport)
    save_now(writer, meta(saves=[save]))  # the restarted server holds the chunks
    deadline = time.monotonic() + 10  # many retry intervals
    while True:
        run_load_step(reader, "sync", load, list(dst.by_name))
        if not reader.take_load_errors() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert reader.breakers[Direction.LOAD].up, "loads never came back after the server did"
    assert all(torch.equal(a, b) for a, b in zip(src.blocks(save.block_ids), dst.blocks(load.block_ids)))
    writer.shutdown()
    reader.shutdown()
    src.close()
    dst.close()
