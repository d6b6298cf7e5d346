"""The vLLM connector's views of vLLM's CPU cache (``[blocks, H, block_size, 2*D]`` per layer, all layers
one allocation): the ``native`` chunk format holds each block's halves in vLLM's own byte order, head by
head, and round-trips byte for byte; ``token_major`` holds per-token K/V. Both put back exactly what
they took, leave skipped blocks and other layers alone, and never share a model id."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.connectors.vllm.paged_layout import NATIVE, RAW, TOKEN_MAJOR, CacheFormat, CpuKVLayout, PagedKV, choose_format
from kvdepot.layout import KVLayout

L, H, D, BS, NB = 3, 2, 8, 16, 10


def cache(dtype, seed: int) -> list[np.ndarray]:
    """One allocation, a view per layer, as vLLM's CPU backend allocates them."""
    rng = np.random.default_rng(seed)
    alloc = rng.integers(-1000, 1000, (L, NB, H, BS, 2 * D)).astype(dtype)
    return [alloc[i] for i in range(L)]


def chunk_for(dtype, blocks: int) -> np.ndarray:
    return np.zeros((2, L, blocks * BS, H, D), dtype=dtype)


@pytest.mark.parametrize("kind", [NATIVE, TOKEN_MAJOR])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gather_then_scatter_elsewhere_copies_the_blocks_byte_for_byte(kind, dtype) -> None:
    src = cache(dtype, 1)
    dst = [np.zeros_like(a) for a in src]
    fmt = CacheFormat(kind, "vec")
    chunk = chunk_for(dtype, 2)
    PagedKV(src, BS, D, fmt).gather([3, 7], chunk)
    PagedKV(dst, BS, D, fmt).scatter(chunk, [0, 5])
    for layer in range(L):
        assert np.array_equal(dst[layer][0], src[layer][3]) and np.array_equal(dst[layer][5], src[layer][7])
        untouched = [b for b in range(NB) if b not in (0, 5)]
        assert not dst[layer][untouched].any()


@pytest.mark.parametrize("kind", [NATIVE, TOKEN_MAJOR])
def test_a_gather_layer_by_layer_fills_the_slot_as_one_gather_does_and_only_its_layer(kind) -> None:
    src = cache(np.float32, 4)
    paged = PagedKV(src, BS, D, CacheFormat(kind, "vec"))
    whole, by_layer = chunk_for(np.float32, 2), chunk_for(np.float32, 2)
    paged.gather([6, 1], whole)
    paged.gather([6, 1], by_layer, 1)
    assert np.array_equal(by_layer[:, 1], whole[:, 1]) and not by_layer[:, [0, 2]].any()  # layer 1 alone
    for layer in (0, 2):
        paged.gather([6, 1], by_layer, layer)
    assert np.array_equal(by_layer, whole)


def test_native_chunks_hold_vllms_own_bytes_head_by_head() -> None:
    src = cache(np.float32, 2)
    chunk = chunk_for(np.float32, 1)
    PagedKV(src, BS, D, CacheFormat(NATIVE, "vec")).gather([4], chunk)
    for layer in range(L):
        block = src[layer][4]  # [H, BS, 2*D]: per head, the K half's bytes then the V half's
        halves = block.reshape(H, 2, BS * D)
        assert np.array_equal(chunk[0, layer].reshape(H, BS * D), halves[:, 0])
        assert np.array_equal(chunk[1, layer].reshape(H, BS * D), halves[:, 1])


def test_token_major_chunks_hold_per_token_values() -> None:
    """The ``vec`` ISA keeps K transposed (``[D, BS]`` per head) and V as rows; token_major undoes that."""
    src = cache(np.float32, 3)
    chunk = chunk_for(np.float32, 1)
    PagedKV(src, BS, D, CacheFormat(TOKEN_MAJOR, "vec")).gather([2], chunk)
    halves = src[1][2].reshape(H, 2, BS * D)
    k = halves[:, 0].reshape(H, D, BS)  # transposed keys
    v = halves[:, 1].reshape(H, BS, D)
    assert np.array_equal(chunk[0, 1], k.transpose(2, 0, 1))
    assert np.array_equal(chunk[1, 1], v.transpose(1, 0, 2))


@pytest.mark.parametrize("kind", [NATIVE, TOKEN_MAJOR])
def test_scatter_leaves_skipped_blocks_and_other_layers_alone(kind) -> None:
    src = cache(np.float32, 4)
    fmt = CacheFormat(kind, "vec")
    chunk = chunk_for(np.float32, 2)
    PagedKV(src, BS, D, fmt).gather([1, 2], chunk)
    dst = cache(np.float32, 5)
    before = [a.copy() for a in dst]
    PagedKV(dst, BS, D, fmt).scatter(chunk, [6, 8], skip_blocks=1)  # block 6 is vLLM's own: untouched
    for layer in range(L):
        assert np.array_equal(dst[layer][6], before[layer][6])
        assert np.array_equal(dst[layer][8], src[layer][2])
    dst2 = cache(np.float32, 6)
    before2 = [a.copy() for a in dst2]
    PagedKV(dst2, BS, D, fmt).scatter(chunk, [6, 8], layer=1)
    assert np.array_equal(dst2[1][6], src[1][1]) and np.array_equal(dst2[1][8], src[1][2])
    for layer in (0, 2):
        assert np.array_equal(dst2[layer], before2[layer])


def test_bfloat16_caches_meet_uint16_chunks() -> None:
    """torch's bf16 arrives as int16 and KVLayout's as uint16: the copy reinterprets, never converts."""
    src = cache(np.int16, 7)
    chunk = KVLayout(L, H, D, dtype="bfloat16").empty(BS)
    assert chunk.dtype == np.uint16
    PagedKV(src, BS, D, CacheFormat(NATIVE, "vec")).gather([9], chunk)
    dst = [np.zeros_like(a) for a in src]
    PagedKV(dst, BS, D, CacheFormat(NATIVE, "vec")).scatter(chunk, [0])
    assert all(np.array_equal(d[0], s[9]) for d, s in zip(dst, src))


def test_formats_never_share_a_model_id_and_the_setting_picks_one() -> None:
    suffixes = {CacheFormat(k, "vec").model_suffix for k in (NATIVE, TOKEN_MAJOR, RAW)}
    assert suffixes == {"@vllm-cpu-vec-native", "", "@vllm-cpu-vec"}
    probed = CacheFormat(TOKEN_MAJOR, "vec")
    assert choose_format(probed, "shared") is probed
    assert choose_format(probed, CpuKVLayout.NATIVE) == CacheFormat(NATIVE, "vec")
    assert choose_format(CacheFormat(RAW, "amx"), "native") == CacheFormat(NATIVE, "amx")
    with pytest.raises(ValueError):
        choose_format(probed, "fast")


def test_chunks_that_hold_vllms_blocks_as_they_are_are_kept_apart_by_block_size() -> None:
    """A ``native`` or raw chunk is vLLM's blocks byte for byte, so an engine with 64-token blocks must
    never read one written with 128-token blocks (same chunk size, same model); the shared per-token
    layout does not depend on the block size."""
    for kind in (NATIVE, RAW):
        assert CacheFormat(kind, "vec", 64).model_suffix != CacheFormat(kind, "vec", 128).model_suffix
        assert CacheFormat(kind, "vec", 64).model_suffix.endswith("-bs64")
    assert CacheFormat(TOKEN_MAJOR, "vec", 64).model_suffix == CacheFormat(TOKEN_MAJOR, "vec", 128).model_suffix == ""
    assert choose_format(CacheFormat(TOKEN_MAJOR, "vec", 32), "native") == CacheFormat(NATIVE, "vec", 32)


def test_a_block_id_outside_the_cache_is_refused_before_anything_is_copied() -> None:
    src = cache(np.float32, 5)
    before = [a.copy() for a in src]
    chunk = chunk_for(np.float32, 2)
    chunk[:] = 7
    paged = PagedKV(src, BS, D, CacheFormat(NATIVE, "vec"))
    for bad in ([1, NB], [-1, 2]):
        with pytest.raises(IndexError):
            paged.scatter(chunk, bad)
        with pytest.raises(IndexError):
            paged.gather(bad, chunk)
    assert all(np.array_equal(a, b) for a, b in zip(src, before))
    assert (chunk == 7).all()
