"""A mover's per-layer kernels replayed as CUDA graphs (``kvdepot.gpu.graphs``), on a real GPU: bit-exact
over calls that reuse every staging slot with new block ids each time (a replay that read a stale id or
slot would move the wrong blocks), beside the same mover with graphs off; the shapes never captured (a
skip inside a piece, a layer-by-layer last piece) still right; a capture that fails leaves the mover
eager and right; ``KVDEPOT_CUDA_GRAPHS=0`` keeps it eager. Skipped, and counted, without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdepot.gpu import graphs as graphs_module
from kvdepot.gpu.mover import BlockMover
from kvdepot.gpu.paged import DevicePagedCache

from support.devices import gpu

pytestmark = gpu

LAYERS, NB, BS, H, D = 6, 64, 4, 2, 8
BPC = 2  # blocks a chunk
CHUNK_BYTES = 2 * LAYERS * BPC * BS * H * D * 2


def layers_apart(seed: int | None):
    shape = (2, NB, BS, H, D)
    if seed is None:
        out = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    else:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        out = [torch.randint(-(1 << 15), 1 << 15, shape, generator=gen, dtype=torch.int16, device="cuda").view(torch.bfloat16) for _ in range(LAYERS)]
    torch.cuda.synchronize()
    return out


def expected(layers, ids: list[int]) -> list[np.ndarray]:
    """Chunk by chunk, ``[K, L, T, H, D]`` the slow obvious way."""
    out = []
    for c in range(len(ids) // BPC):
        chunk = torch.stack([t[:, ids[c * BPC : (c + 1) * BPC]].reshape(2, BPC * BS, H, D) for t in layers], dim=1)
        out.append(chunk.view(torch.int16).cpu().numpy().view(np.uint16))
    return out


def slots(n: int) -> list[np.ndarray]:
    return [np.zeros((2, LAYERS, BPC * BS, H, D), dtype=np.uint16) for _ in range(n)]


def mover_for(layers, graphs: bool | None = True, staging_chunks: int = 4) -> BlockMover:
    return BlockMover(DevicePagedCache(layers, "kv_first", BS), BPC, staging_chunks * CHUNK_BYTES, graphs=graphs)


def round_trip(mover: BlockMover, back: BlockMover, src, dst, rounds: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        n = int(rng.integers(3, 9))  # a piece count that varies: the last piece's length varies with it
        ids = [int(b) for b in rng.permutation(NB)[: n * BPC]]
        got = slots(n)
        mover.save(mover.cache.check_ids([ids], n * BPC), got).wait()
        for have, want in zip(got, expected(src, ids), strict=True):
            assert np.array_equal(have, want)
        where = [int(b) for b in rng.permutation(NB)[: n * BPC]]
        back.load(got, back.cache.check_ids([where], n * BPC)).wait()
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][:, where].view(torch.int16), src[layer][:, ids].view(torch.int16))


def test_replayed_pieces_move_the_blocks_of_each_call_bit_exact():
    src, dst = layers_apart(1), layers_apart(None)
    mover, back = mover_for(src), mover_for(dst)
    round_trip(mover, back, src, dst, rounds=6, seed=2)
    assert mover.graphs is not None and mover.graphs.on and mover.graphs.replays > 0, mover.graphs
    assert back.graphs is not None and back.graphs.on and back.graphs.replays > 0, back.graphs
    assert len(mover.graphs.graphs) <= 4 * 4  # a key per (slot, length): bounded by the staging


def test_the_shapes_never_captured_still_land_right_beside_replays():
    """A skip that ends inside a piece and a layer-by-layer last piece run eagerly, between replays."""
    src, dst = layers_apart(3), layers_apart(None)
    mover, back = mover_for(src, staging_chunks=2), mover_for(dst, staging_chunks=2)
    ids = list(range(NB - 1, NB - 1 - 8 * BPC, -1))
    got = slots(8)
    for _ in range(2):  # the second call replays
        mover.save(mover.cache.check_ids([ids], 8 * BPC), got).wait()
    assert mover.graphs.replays > 0
    where = list(range(8 * BPC))
    back.load(got, back.cache.check_ids([where], 8 * BPC)).wait()  # warms the loads, captures
    for skip in (0, 1, 3, 5):
        for t in dst:
            t.zero_()
        torch.cuda.synchronize()
        events = [torch.cuda.Event() for _ in range(LAYERS)]
        back.load(got, back.cache.check_ids([where], 8 * BPC), skip_blocks=skip, layer_events=events).wait()
        for layer in range(LAYERS):
            assert not dst[layer][:, :skip].view(torch.int16).any()
            assert torch.equal(dst[layer][:, where[skip:]].view(torch.int16), src[layer][:, ids[skip:]].view(torch.int16))
    assert back.graphs.replays > 0


def test_a_capture_that_fails_leaves_the_mover_eager_and_right(monkeypatch, caplog):
    def refuse(self, kernels):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module.PieceGraphs, "_capture", refuse)
    src, dst = layers_apart(5), layers_apart(None)
    mover, back = mover_for(src), mover_for(dst)
    round_trip(mover, back, src, dst, rounds=3, seed=6)
    assert not mover.graphs.on and mover.graphs.replays == 0
    assert "CUDA graphs off" in caplog.text


def test_graphs_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVDEPOT_CUDA_GRAPHS", "0")
    src, dst = layers_apart(7), layers_apart(None)
    mover, back = mover_for(src, graphs=None), mover_for(dst, graphs=None)
    round_trip(mover, back, src, dst, rounds=2, seed=8)
    assert mover.graphs is None and back.graphs is None


def test_a_cache_in_one_allocation_is_never_captured():
    whole = torch.zeros((LAYERS, 2, NB, BS, H, D), dtype=torch.bfloat16, device="cuda")
    mover = mover_for(list(whole))
    mover.save(mover.cache.check_ids([list(range(4))], 4), slots(2)).wait()
    assert mover.cache.kernels == 2 and mover.graphs is None
