"""``kvdepot.gpu.paged`` and ``kvdepot.gpu.mover``: a paged cache's chunks gathered and scattered through
torch, bit for bit, in both GPU layouts, every dtype a cache uses (fp8 included), one or several KV-cache
groups, with and without the one-kernel stacked view; and the checks that keep a bad block id from ever
reaching a kernel. Each case runs on the CPU, and on CUDA where there is a GPU (``tests/support/devices``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # the engine-side extra; the test set-up installs it

from kvdepot.gpu.mover import BlockMover
from kvdepot.gpu.paged import DevicePagedCache

from support.devices import DEVICES

L, NB, BS, H, D = 3, 10, 4, 2, 8
DTYPES = ["float16", "bfloat16", "float32"] + (["float8_e4m3fn"] if hasattr(torch, "float8_e4m3fn") else [])


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def random_layers(fmt: str, dtype: str, device: str, stacked: bool, seed: int = 0):
    """One tensor per layer, of random bits (every bit pattern: fp8 and bf16 included)."""
    shape = (2, NB, BS, H, D) if fmt == "kv_first" else (NB, 2, BS, H, D)
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    raw = torch.randint(0, 256, (L, *shape[:-1], D * itemsize), generator=gen, dtype=torch.uint8)
    whole = raw.view(getattr(torch, dtype)).to(device)
    layers = [whole[i] for i in range(L)] if stacked else [whole[i].clone() for i in range(L)]  # stacked: evenly spaced in one allocation
    return settled(layers)


def settled(tensors):
    """``tensors``, once every kernel queued for them has run: a mover called without ``ready`` works on
    streams of its own, which do not wait for the default stream's clone or zero-fill."""
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.synchronize()
    return tensors


def kv(t, fmt: str):
    """A layer as ``[K, blocks, block_size, H, D]`` whatever its format."""
    return t if fmt == "kv_first" else t.transpose(0, 1)


def reference_chunks(layers, fmt: str, ids: list[int], bpc: int):
    """What ``gather`` must produce: [n, K, L, T, H, D], block by block, the slow obvious way."""
    n = len(ids) // bpc
    out = torch.empty((n, 2, L, bpc * BS, H, D), dtype=layers[0].dtype)
    for c in range(n):
        for layer, t in enumerate(layers):
            view = t.cpu() if fmt == "kv_first" else t.cpu().transpose(0, 1)
            for j, b in enumerate(ids[c * bpc : (c + 1) * bpc]):
                out[c, :, layer, j * BS : (j + 1) * BS] = view[:, b]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["kv_first", "block_first"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stacked", [True, False])
def test_gather_then_scatter_round_trips_every_bit(device, fmt, dtype, stacked):
    src = random_layers(fmt, dtype, device, stacked, seed=1)
    cache = DevicePagedCache(src, fmt, BS)
    assert (cache._stacked is not None) == stacked
    ids = [7, 2, 9, 0]  # two chunks of two blocks, out of order
    out = torch.empty((2, 2, L, 2 * BS, H, D), dtype=src[0].dtype, device=device)
    cache.gather(cache.check_ids([ids], 4), out)
    assert torch.equal(bits(out), bits(reference_chunks(src, fmt, ids, 2)))

    dst = [torch.zeros_like(t) for t in src]
    target = DevicePagedCache(dst, fmt, BS)
    back = [3, 5, 1, 8]
    target.scatter(out, target.check_ids([back], 4))
    for layer in range(L):
        a = src[layer] if fmt == "kv_first" else src[layer].transpose(0, 1)
        b = dst[layer] if fmt == "kv_first" else dst[layer].transpose(0, 1)
        assert torch.equal(bits(a[:, ids]), bits(b[:, back]))
        untouched = [i for i in range(NB) if i not in back]
        assert not bits(b[:, untouched]).any()


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_leaves_skipped_blocks_and_other_layers_alone(device):
    src = random_layers("kv_first", "bfloat16", device, True, seed=2)
    cache = DevicePagedCache(src, "kv_first", BS)
    chunks = torch.empty((2, 2, L, 2 * BS, H, D), dtype=torch.bfloat16, device=device)
    cache.gather(cache.check_ids([[1, 2, 3, 4]], 4), chunks)
    dst = [torch.zeros_like(t) for t in src]
    target = DevicePagedCache(dst, "kv_first", BS)
    ids = target.check_ids([[5, 6, 7, 8]], 4)
    target.scatter(chunks, ids, skip_blocks=3, layers=range(1, 2))  # the engine holds 5, 6, 7 already
    assert not bits(dst[0]).any() and not bits(dst[2]).any()  # other layers: not this call's
    assert not bits(dst[1][:, [5, 6, 7]]).any()
    assert torch.equal(bits(dst[1][:, 8]), bits(src[1][:, 4]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["kv_first", "block_first"])
@pytest.mark.parametrize("skip", [0, 2, 3, 5, 6])
def test_a_cache_of_layers_allocated_apart_scatters_like_a_stacked_one(device, fmt, skip):
    """vLLM's layout (each layer its own allocation) takes the one-kernel-per-layer forms where the skip
    ends on a chunk's edge (0, 2, 6 of three two-block chunks) and the general form where it does not
    (3, 5): the same bytes land either way, in both layouts, and skipped blocks stay as they were."""
    src = random_layers(fmt, "bfloat16", device, True, seed=5)
    chunks = torch.empty((3, 2, L, 2 * BS, H, D), dtype=torch.bfloat16, device=device)
    DevicePagedCache(src, fmt, BS).gather(DevicePagedCache(src, fmt, BS).check_ids([[9, 1, 4, 0, 7, 2]], 6), chunks)
    targets = []
    for stacked in (True, False):
        dst = random_layers(fmt, "bfloat16", device, stacked, seed=6)  # the engine's own bytes
        cache = DevicePagedCache(dst, fmt, BS)
        assert (cache._stacked is not None) == stacked
        cache.scatter(chunks, cache.check_ids([[3, 8, 0, 5, 9, 6]], 6), skip_blocks=skip)
        targets.append(dst)
    before = random_layers(fmt, "bfloat16", "cpu", False, seed=6)
    order = [9, 1, 4, 0, 7, 2]
    for layer in range(L):
        stacked, apart = (kv(t[layer], fmt) for t in targets)
        assert torch.equal(bits(stacked), bits(apart))
        for i, block in enumerate([3, 8, 0, 5, 9, 6]):
            want = kv(before[layer], fmt)[:, block] if i < skip else kv(src[layer], fmt)[:, order[i]]
            assert torch.equal(bits(apart[:, block]), bits(want))


@pytest.mark.parametrize("device", DEVICES)
def test_groups_address_their_own_layers(device):
    """Hybrid models: layer l's blocks come from its KV-cache group's ids."""
    src = random_layers("kv_first", "float16", device, False, seed=3)
    cache = DevicePagedCache(src, "kv_first", BS, groups=[0, 1, 0])
    assert cache.num_groups == 2 and cache._stacked is None
    out = torch.empty((1, 2, L, 2 * BS, H, D), dtype=torch.float16, device=device)
    cache.gather(cache.check_ids([[4, 6], [1, 9]], 2), out)
    assert torch.equal(bits(out[0, :, 0]), bits(src[0][:, [4, 6]].reshape(2, 2 * BS, H, D)))
    assert torch.equal(bits(out[0, :, 1]), bits(src[1][:, [1, 9]].reshape(2, 2 * BS, H, D)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "apart"])
def test_layers_that_all_share_a_group_other_than_the_first_use_that_groups_ids(device, stacked):
    """Every layer in group 1 (a client's registration may say so): the one-kernel path of layers in
    one allocation took group 0's ids, which address no layer, so a store gathered the wrong blocks and
    a retrieve overwrote blocks of other requests; the per-layer path was right."""
    src = random_layers("kv_first", "float16", device, stacked, seed=4)
    cache = DevicePagedCache(src, "kv_first", BS, groups=[1] * L)
    assert cache.num_groups == 2 and (cache._stacked is not None) == stacked
    out = torch.empty((1, 2, L, 2 * BS, H, D), dtype=torch.float16, device=device)
    cache.gather(cache.check_ids([[0, 1], [7, 5]], 2), out)
    for layer in range(L):
        assert torch.equal(bits(out[0, :, layer]), bits(src[layer][:, [7, 5]].reshape(2, 2 * BS, H, D)))
    before = [t.clone() for t in src]
    flipped = torch.flip(out, dims=[3])  # the tokens in reverse: bytes those blocks do not hold yet
    cache.scatter(flipped, cache.check_ids([[0, 1], [7, 5]], 2))
    settled(src)
    for layer in range(L):
        got = src[layer][:, [7, 5]].reshape(2, 2 * BS, H, D)
        assert torch.equal(bits(got), bits(flipped[0, :, layer])), "group 1's blocks were not written"
        assert torch.equal(bits(src[layer][:, [0, 1]]), bits(before[layer][:, [0, 1]])), "blocks of group 0 (no layer's) were written"


def test_block_ids_are_checked_before_any_kernel():
    cache = DevicePagedCache(random_layers("kv_first", "float16", "cpu", True), "kv_first", BS)
    with pytest.raises(IndexError, match="outside"):
        cache.check_ids([[0, NB]], 2)
    with pytest.raises(IndexError, match="outside"):
        cache.check_ids([[-1, 2]], 2)
    with pytest.raises(ValueError, match="3 block ids for 2 blocks"):
        cache.check_ids([[0, 1, 2]], 2)
    with pytest.raises(ValueError, match="2 KV-cache groups"):
        cache.check_ids([[0, 1], [2, 3]], 2)


def test_layers_that_disagree_are_refused():
    layers = random_layers("kv_first", "float16", "cpu", False)
    with pytest.raises(ValueError, match="block_size 8"):
        DevicePagedCache(layers, "kv_first", 8)
    with pytest.raises(ValueError, match="layer 1"):
        DevicePagedCache([layers[0], layers[1].to(torch.float32)], "kv_first", BS)
    with pytest.raises(ValueError, match="block_first expects"):
        DevicePagedCache(layers, "block_first", BS)
    with pytest.raises(ValueError, match="kv_first or block_first"):
        DevicePagedCache(layers, "head_major", BS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging_chunks", [1, 3, 64])
@pytest.mark.parametrize("stacked", [True, False], ids=["one-allocation", "layers-apart"])
@pytest.mark.parametrize("skip", [1, 2], ids=["skip-inside-a-chunk", "skip-a-chunk"])
def test_mover_saves_into_host_slots_and_loads_them_back(device, staging_chunks, stacked, skip):
    """Through the staging buffer on a device (batches of ``staging_chunks``; several batches when fewer
    than the 5 chunks fit), straight into the slots on the CPU; a load that leaves the first ``skip``
    blocks alone (ending inside the first chunk, or with it), with an event after each layer."""
    src = random_layers("block_first", "bfloat16", device, stacked, seed=4)
    bpc = 2
    cache = DevicePagedCache(src, "block_first", BS)
    chunk_bytes = 2 * L * bpc * BS * H * D * 2
    mover = BlockMover(cache, bpc, staging_chunks * chunk_bytes)
    assert mover.chunk_bytes == chunk_bytes
    ids = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    slots = [np.zeros((2, L, bpc * BS, H, D), dtype=np.uint16) for _ in range(5)]  # arena-like numpy views
    mover.save(cache.check_ids([ids], 10), slots).wait()
    ref = reference_chunks(src, "block_first", ids, bpc)
    for c in range(5):
        assert np.array_equal(slots[c], bits(ref[c]).numpy().view(np.uint16))

    dst = settled([torch.zeros_like(t) for t in src])
    target = DevicePagedCache(dst, "block_first", BS)
    back = BlockMover(target, bpc, staging_chunks * chunk_bytes)
    events = [torch.cuda.Event() for _ in range(L)] if device == "cuda" else None
    readonly = [s.copy() for s in slots]
    for s in readonly:
        s.flags.writeable = False  # a retrieve's views are read-only
    done = back.load(readonly, target.check_ids([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]], 10), skip_blocks=skip, layer_events=events)
    done.wait()
    for layer in range(L):
        assert not bits(dst[layer][:skip]).any()  # skipped
        assert torch.equal(bits(dst[layer][skip:]), bits(src[layer][ids[skip:]]))


@pytest.mark.parametrize("device", DEVICES)
def test_pieces_sized_by_the_bytes_a_kernel_moves_still_move_every_chunk(device, monkeypatch):
    """With ``PIECE_BYTES`` at one chunk, a cache of layers apart (one kernel per layer) moves
    ``kernels`` chunks a piece, not half its staging: several pieces through ample staging, layer events on
    the last."""
    from kvdepot.gpu import mover as mover_module

    src = random_layers("kv_first", "float16", device, False, seed=10)
    bpc = 2
    cache = DevicePagedCache(src, "kv_first", BS)
    chunk_bytes = 2 * L * bpc * BS * H * D * 2
    monkeypatch.setattr(mover_module, "PIECE_BYTES", chunk_bytes)
    mover = BlockMover(cache, bpc, 64 * chunk_bytes)
    assert cache.kernels == L == 3
    assert [j - i for i, j, _ in mover._pieces(5)] == [3, 2]
    ids = [1, 3, 5, 7, 9, 0, 2, 4, 6, 8]
    slots = [np.zeros((2, L, bpc * BS, H, D), dtype=np.uint16) for _ in range(5)]
    mover.save(cache.check_ids([ids], NB), slots).wait()
    for got, want in zip(slots, reference_chunks(src, "kv_first", ids, bpc), strict=True):
        assert np.array_equal(got, bits(want).numpy().view(np.uint16))
    dst = settled([torch.zeros_like(t) for t in src])
    target = DevicePagedCache(dst, "kv_first", BS)
    back = BlockMover(target, bpc, 64 * chunk_bytes)
    events = [torch.cuda.Event() for _ in range(L)] if device == "cuda" else None
    back.load(slots, target.check_ids([list(range(NB))], NB), layer_events=events).wait()
    for layer in range(L):
        assert torch.equal(bits(dst[layer]), bits(src[layer][:, ids]))


@pytest.mark.parametrize("device", DEVICES)
def test_calls_queued_back_to_back_on_one_mover_never_share_staging_early(device):
    """Two saves and a load queued at once through one staging slot (each piece of each call reuses it):
    a later call's gather or copy into staging must wait for the earlier call's reads of it."""
    src = random_layers("kv_first", "float16", device, True, seed=7)
    bpc = 2
    cache = DevicePagedCache(src, "kv_first", BS)
    mover = BlockMover(cache, bpc, 2 * L * bpc * BS * H * D * 2)  # one chunk of staging
    first = [np.zeros((2, L, bpc * BS, H, D), dtype=np.uint16) for _ in range(2)]
    second = [np.zeros((2, L, bpc * BS, H, D), dtype=np.uint16) for _ in range(3)]
    a = mover.save(cache.check_ids([[0, 1, 2, 3]], 4), first)
    b = mover.save(cache.check_ids([[9, 8, 7, 6, 5, 4]], 6), second)
    loaded = [s.copy() for s in first]
    c = mover.load(loaded, cache.check_ids([[8, 9, 6, 7]], 4))  # blocks 0-3 land where 8, 9, 6, 7 were
    for done in (a, b, c):
        done.wait()
    original = random_layers("kv_first", "float16", "cpu", True, seed=7)  # src as it was before the load
    want = [*reference_chunks(original, "kv_first", [0, 1, 2, 3], bpc), *reference_chunks(original, "kv_first", [9, 8, 7, 6, 5, 4], bpc)]
    for got, chunk in zip(first + second, want, strict=True):
        assert np.array_equal(got, bits(chunk).numpy().view(np.uint16))
    for layer in range(L):
        assert torch.equal(bits(src[layer][:, [8, 9, 6, 7]]), bits(original[layer][:, [0, 1, 2, 3]]))


def test_pieces_are_larger_for_a_cache_whose_layers_were_allocated_apart(monkeypatch):
    """A piece moves PIECE_BYTES per kernel it launches: two for a stacked cache, one per layer otherwise
    (vLLM's layout), and never more than half the staging, so two pieces always overlap."""
    from kvdepot.gpu import mover as mover_module

    bpc = 1
    chunk_bytes = 2 * L * bpc * BS * H * D * 2
    monkeypatch.setattr(mover_module, "PIECE_BYTES", chunk_bytes)
    stacked = BlockMover(DevicePagedCache(random_layers("kv_first", "float16", "cpu", True), "kv_first", BS), bpc, 8 * chunk_bytes)
    apart = BlockMover(DevicePagedCache(random_layers("kv_first", "float16", "cpu", False), "kv_first", BS), bpc, 8 * chunk_bytes)
    assert stacked.cache.kernels == 2 and apart.cache.kernels == L
    assert stacked._pieces(5) == [(0, 2, 0), (2, 4, 2), (4, 5, 4)]
    assert apart._pieces(7) == [(0, 3, 0), (3, 6, 3), (6, 7, 0)]  # L=3 chunks a piece; two slots of staging
    tight = BlockMover(DevicePagedCache(random_layers("kv_first", "float16", "cpu", False), "kv_first", BS), bpc, 4 * chunk_bytes)
    assert tight._pieces(5) == [(0, 2, 0), (2, 4, 2), (4, 5, 0)]  # capped at half the staging


@pytest.mark.parametrize("device", DEVICES)
def test_a_duplex_movers_save_and_load_run_side_by_side_on_one_cache(device):
    """A save out of some blocks and a load into others, queued at once on their own streams (on CUDA
    the two overlap): each moves exactly its own bytes."""
    from kvdepot.gpu.mover import DuplexMover

    src = random_layers("block_first", "bfloat16", device, False, seed=8)
    bpc = 2
    cache = DevicePagedCache(src, "block_first", BS)
    chunk_bytes = 2 * L * bpc * BS * H * D * 2
    duplex = DuplexMover(cache, bpc, 4 * chunk_bytes)
    assert duplex.saver.per_batch == duplex.loader.per_batch == 2 and duplex.chunk_bytes == chunk_bytes
    incoming = [bits(c).numpy().view(np.uint16) for c in reference_chunks(random_layers("block_first", "bfloat16", "cpu", False, seed=9), "block_first", [1, 2, 3, 4, 5, 6], bpc)]  # fmt: skip
    saved = [np.zeros((2, L, bpc * BS, H, D), dtype=np.uint16) for _ in range(2)]
    out = duplex.save(cache.check_ids([[0, 9, 8, 7]], 4), saved)
    back = duplex.load(incoming, cache.check_ids([[1, 2, 3, 4, 5, 6]], 6))
    out.wait()
    back.wait()
    original = random_layers("block_first", "bfloat16", "cpu", False, seed=8)
    for got, want in zip(saved, reference_chunks(original, "block_first", [0, 9, 8, 7], bpc), strict=True):
        assert np.array_equal(got, bits(want).numpy().view(np.uint16))
    loaded = reference_chunks(src, "block_first", [1, 2, 3, 4, 5, 6], bpc)
    for got, want in zip(loaded, incoming, strict=True):
        assert np.array_equal(bits(got).numpy().view(np.uint16), want)


def test_a_scatter_that_deterministic_mode_would_make_rewrite_every_block_is_refused(monkeypatch):
    """On CUDA, torch's deterministic mode writes an indexed copy into a non-contiguous target by copying
    all of it out and back, racing the engine's writes to other blocks: refused before any write, with the
    reason (the load's blocks are recomputed). A contiguous target (kv_first) passes the check."""
    chunks = torch.zeros((1, 2, L, 2 * BS, H, D), dtype=torch.bfloat16)
    for fmt, stacked, refused in (("block_first", False, True), ("block_first", True, True), ("kv_first", True, False), ("kv_first", False, False)):
        dst = random_layers(fmt, "bfloat16", "cpu", stacked, seed=3)
        before = [t.clone() for t in dst]
        cache = DevicePagedCache(dst, fmt, BS)
        monkeypatch.setattr(cache, "device", torch.device("cuda"))  # what the check reads (no GPU is needed to refuse)
        torch.use_deterministic_algorithms(True)
        try:
            if refused:
                with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
                    cache.scatter(chunks, cache.check_ids([[3, 4]], 2))
                assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, dst))
            else:
                cache.check_write_mode()  # passes (the scatter itself would need a GPU from here on)
        finally:
            torch.use_deterministic_algorithms(False)
        monkeypatch.setattr(cache, "device", torch.device("cpu"))
        cache.scatter(chunks, cache.check_ids([[3, 4]], 2))  # the same call on the CPU, the mode off: written
        assert not any(bits(kv(t, fmt)[:, [3, 4]]).any() for t in dst)
