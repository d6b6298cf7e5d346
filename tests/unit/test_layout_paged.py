"""KVLayout arithmetic and views; gather/scatter between paged caches and chunks, against a naive loop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvdepot.layout import KVLayout, as_numpy, supported_dtypes
from kvdepot.connectors.paged import PagedFormat, canonical_view, gather_chunk, gather_chunks, scatter_chunk, scatter_chunks

# --- KVLayout ---------------------------------------------------------------------------------------


def test_chunk_bytes_and_shape():
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert layout.kv_factor == 2
    assert layout.itemsize == 2
    assert layout.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert layout.chunk_bytes(256) == 33_554_432
    assert layout.chunk_shape(256) == (2, 32, 256, 8, 128)


def test_mla_has_one_kv_plane():
    layout = KVLayout(num_layers=61, num_kv_heads=1, head_dim=576, dtype="bfloat16", use_mla=True)
    assert layout.kv_factor == 1
    assert layout.chunk_bytes(64) == 61 * 576 * 2 * 64
    assert layout.chunk_shape(64) == (1, 61, 64, 1, 576)


@pytest.mark.parametrize(
    ("dtype", "storage", "itemsize"),
    [
        ("float16", np.float16, 2),
        ("bfloat16", np.uint16, 2),
        ("float32", np.float32, 4),
        ("float8_e4m3fn", np.uint8, 1),
        ("float8_e5m2", np.uint8, 1),
        ("int8", np.int8, 1),
        ("uint8", np.uint8, 1),
    ],
)
def test_storage_dtypes(dtype, storage, itemsize):
    layout = KVLayout(2, 2, 4, dtype)
    assert layout.storage_dtype == np.dtype(storage)
    assert layout.itemsize == itemsize
    assert layout.chunk_bytes(3) == 2 * 2 * 2 * 4 * itemsize * 3


def test_supported_dtypes_is_sorted_and_complete():
    assert supported_dtypes() == [
        "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"
    ]


def test_fingerprint_names_dtype_and_shape():
    assert KVLayout(32, 8, 128, "bfloat16").fingerprint() == "bfloat16:K2xL32xH8xD128"
    assert KVLayout(61, 1, 576, "bfloat16", use_mla=True).fingerprint() == "bfloat16:K1xL61xH1xD576"
    assert KVLayout(32, 8, 128, "float16").fingerprint() != KVLayout(32, 8, 128, "bfloat16").fingerprint()
    assert KVLayout(32, 8, 128).fingerprint() != KVLayout(32, 8, 64).fingerprint()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": -1, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": 2, "num_kv_heads": 0, "head_dim": 128},
        {"num_layers": 2, "num_kv_heads": 8, "head_dim": 0},
        {"num_layers": 2.0, "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": "2", "num_kv_heads": 8, "head_dim": 128},
        {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "float64"},
        {"num_layers": 2, "num_kv_heads": 8, "head_dim": 128, "dtype": "bf16"},
    ],
)
def test_bad_layout_values_raise(kwargs):
    with pytest.raises(ValueError):
        KVLayout(**kwargs)


def test_view_chunk_shares_memory_with_the_buffer():
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, dtype="float16")
    buf = bytearray(layout.chunk_bytes(5))
    view = layout.view_chunk(buf, 5)
    assert view.shape == (2, 2, 5, 3, 4) and view.dtype == np.float16
    view[1, 1, 4, 2, 3] = 1.0  # the very last element
    assert bytes(buf[-2:]) == np.float16(1.0).tobytes()
    assert bytes(buf[:-2]) == bytes(len(buf) - 2)


def test_view_chunk_of_a_larger_buffer_uses_its_start():
    layout = KVLayout(1, 1, 2, "uint8")
    buf = bytearray(range(10))
    view = layout.view_chunk(buf, 2)  # 2*1*2*1*2 = 8 bytes
    assert view.tobytes() == bytes(range(8))


def test_read_only_view_cannot_be_written():
    layout = KVLayout(1, 1, 2, "float16")
    buf = bytearray(layout.chunk_bytes(2))
    view = layout.view_chunk(buf, 2, writable=False)
    with pytest.raises(ValueError):
        view[0, 0, 0, 0, 0] = 1


def test_view_chunk_of_a_too_small_buffer_raises():
    layout = KVLayout(1, 1, 2, "float16")
    with pytest.raises(ValueError):
        layout.view_chunk(bytearray(layout.chunk_bytes(2) - 1), 2)


def test_empty_has_chunk_shape():
    layout = KVLayout(3, 2, 4, "bfloat16")
    arr = layout.empty(7)
    assert arr.shape == (2, 3, 7, 2, 4) and arr.dtype == np.uint16


def test_as_numpy_passes_numpy_through_and_converts_sequences():
    arr = np.arange(4)
    assert as_numpy(arr) is arr
    assert as_numpy([1, 2]).tolist() == [1, 2]


def test_as_numpy_views_torch_tensors_without_copy():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float16).reshape(2, 3)
    a = as_numpy(t)
    a[0, 0] = 7
    assert t[0, 0].item() == 7
    bf = torch.zeros(4, dtype=torch.bfloat16)
    view = as_numpy(bf)
    assert view.dtype == np.uint16 and view.shape == (4,)  # the width KVLayout uses for bf16
    view[1] = 0x3F80  # bfloat16 1.0
    assert bf[1].item() == 1.0


# --- gather / scatter -------------------------------------------------------------------------------

K, NB, BS, H, D, L = 2, 6, 3, 2, 4, 3


def make_caches(fmt: str, kf: int = K, nb: int = NB, layers: int = L, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = {
        "kv_first": (kf, nb, BS, H, D),
        "block_first": (nb, kf, BS, H, D),
        "head_major": (nb, H, kf * BS, D),
    }[fmt]
    return [rng.integers(0, 60000, size=shape).astype(np.uint16) for _ in range(layers)]


def naive_element(cache: np.ndarray, fmt: str, k: int, block: int, t: int, h: int, d: int):
    if fmt == "kv_first":
        return cache[k, block, t, h, d]
    if fmt == "block_first":
        return cache[block, k, t, h, d]
    return cache[block, h, k * BS + t, d]  # head_major: per head, the K rows then the V rows


def naive_gather(caches, ids, fmt, kf=K) -> np.ndarray:
    out = np.zeros((kf, len(caches), len(ids) * BS, H, D), dtype=caches[0].dtype)
    for layer, cache in enumerate(caches):
        for k, (j, block), t, h, d in itertools.product(range(kf), enumerate(ids), range(BS), range(H), range(D)):
            out[k, layer, j * BS + t, h, d] = naive_element(cache, fmt, k, block, t, h, d)
    return out


FORMATS = [f.value for f in PagedFormat]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ids", [[0], [5, 0, 3], [2, 2], [], [1, 2, 3, 4, 5, 0]])
def test_gather_matches_a_naive_loop(fmt, ids):
    caches = make_caches(fmt)
    out = np.zeros((K, L, len(ids) * BS, H, D), dtype=np.uint16)
    assert gather_chunk(caches, ids, out, fmt) is out
    assert np.array_equal(out, naive_gather(caches, ids, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_with_mla_kv_factor_one(fmt):
    caches = make_caches(fmt, kf=1)
    out = np.zeros((1, L, 2 * BS, H, D), dtype=np.uint16)
    gather_chunk(caches, [4, 1], out, fmt)
    assert np.array_equal(out, naive_gather(caches, [4, 1], fmt, kf=1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_scatter_matches_a_naive_loop_and_touches_only_the_named_blocks(fmt):
    caches = make_caches(fmt)
    originals = [c.copy() for c in caches]
    ids = [4, 1]
    rng = np.random.default_rng(1)
    chunk = rng.integers(0, 60000, size=(K, L, len(ids) * BS, H, D)).astype(np.uint16)
    scatter_chunk(chunk, caches, ids, fmt)
    for layer, (cache, orig) in enumerate(zip(caches, originals)):
        for k, block, t, h, d in itertools.product(range(K), range(NB), range(BS), range(H), range(D)):
            got = naive_element(cache, fmt, k, block, t, h, d)
            if block in ids:
                want = chunk[k, layer, ids.index(block) * BS + t, h, d]
            else:
                want = naive_element(orig, fmt, k, block, t, h, d)
            assert got == want, (layer, k, block, t, h, d)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_then_scatter_into_a_fresh_cache_round_trips(fmt):
    src = make_caches(fmt)
    dst = [np.zeros_like(c) for c in src]
    ids = [3, 0, 5]
    chunk = np.empty((K, L, len(ids) * BS, H, D), dtype=np.uint16)
    gather_chunk(src, ids, chunk, fmt)
    scatter_chunk(chunk, dst, ids, fmt)
    for s, d in zip(src, dst):
        sv, dv = canonical_view(s, fmt), canonical_view(d, fmt)
        for block in range(NB):
            if block in ids:
                assert sv[:, block].tobytes() == dv[:, block].tobytes()
            else:
                assert not dv[:, block].any()


def test_gather_into_a_shared_memory_style_view():
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    caches = make_caches("kv_first")
    buf = bytearray(layout.chunk_bytes(2 * BS))
    gather_chunk(caches, [2, 3], layout.view_chunk(buf, 2 * BS), "kv_first")
    assert bytes(buf) == naive_gather(caches, [2, 3], "kv_first").tobytes()


BF16_REASON = (
    "BUG: layout.as_numpy views a torch bfloat16 tensor as int16, but KVLayout stores bfloat16 as uint16; "
    "gather_chunk's np.take(out=...) refuses the int16->uint16 cast, so gathering a bf16 torch cache into "
    "an arena slot (KVLayout.view_chunk) raises TypeError"
)


def test_gather_of_a_bf16_cache_as_as_numpy_sees_it_into_a_bf16_layout_view():
    # what as_numpy(torch bf16 tensor) returns: the same bits as int16 (see as_numpy)
    caches = [c.view(np.int16) for c in make_caches("kv_first")]
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    buf = bytearray(layout.chunk_bytes(BS))
    gather_chunk(caches, [1], layout.view_chunk(buf, BS), "kv_first")
    assert bytes(buf) == naive_gather(caches, [1], "kv_first").tobytes()


def test_gather_of_a_torch_bf16_cache_into_a_layout_view():
    torch = pytest.importorskip("torch")
    caches = [torch.randn(K, NB, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    buf = bytearray(layout.chunk_bytes(BS))
    gather_chunk(caches, [2], layout.view_chunk(buf, BS), "kv_first")
    want = torch.stack([c[:, 2] for c in caches], dim=1).contiguous().view(torch.int16).numpy().tobytes()
    assert bytes(buf) == want


def test_scatter_of_a_bf16_layout_view_into_an_int16_view_keeps_the_bits():
    caches = [np.zeros((K, NB, BS, H, D), dtype=np.int16) for _ in range(L)]
    layout = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="bfloat16")
    buf = bytearray(range(256)) * (layout.chunk_bytes(BS) // 256 + 1)
    chunk = layout.view_chunk(buf, BS)
    scatter_chunk(chunk, caches, [3], "kv_first")
    assert np.stack([c[:, 3] for c in caches], axis=1).tobytes() == chunk.tobytes()


def test_canonical_views_of_the_three_formats_agree():
    kv = make_caches("kv_first", layers=1)[0]
    bf = np.ascontiguousarray(kv.transpose(1, 0, 2, 3, 4))
    cpu = np.ascontiguousarray(kv.transpose(1, 3, 0, 2, 4)).reshape(NB, H, K * BS, D)
    for fmt, arr in (("kv_first", kv), ("block_first", bf), ("head_major", cpu)):
        view = canonical_view(arr, fmt)
        assert view.shape == (K, NB, BS, H, D)
        assert np.array_equal(view, kv), fmt
        assert np.shares_memory(view, arr)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [[NB], [-1], [0, NB + 3]])
def test_out_of_range_block_ids_raise_index_error_and_write_nothing(fmt, bad):
    caches = make_caches(fmt)
    originals = [c.copy() for c in caches]
    out = np.zeros((K, L, len(bad) * BS, H, D), dtype=np.uint16)
    with pytest.raises(IndexError):
        gather_chunk(caches, bad, out, fmt)
    assert not out.any()
    with pytest.raises(IndexError):
        scatter_chunk(np.ones_like(out), caches, bad, fmt)
    assert all(np.array_equal(c, o) for c, o in zip(caches, originals))


def stacked_caches(fmt: str) -> list[np.ndarray]:
    """The caches of ``make_caches`` as views of one allocation, evenly spaced (as vLLM allocates them)."""
    whole = np.stack(make_caches(fmt))
    return [whole[layer] for layer in range(L)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("make", [make_caches, stacked_caches])
def test_several_chunks_at_once_move_what_one_at_a_time_moves(fmt, make):
    caches = make(fmt)
    ids = [[5, 0], [3], [1, 2, 4]]
    outs = [np.zeros((K, L, len(i) * BS, H, D), dtype=np.uint16) for i in ids]
    gather_chunks(caches, ids, outs, fmt)
    for i, out in zip(ids, outs):
        assert np.array_equal(out, naive_gather(caches, i, fmt))
    dst = [np.zeros_like(c) for c in caches]
    scatter_chunks(outs, dst, ids, fmt)
    one_by_one = [np.zeros_like(c) for c in caches]
    for i, out in zip(ids, outs):
        scatter_chunk(out, one_by_one, i, fmt)
    assert all(np.array_equal(a, b) for a, b in zip(dst, one_by_one))
    assert any(a.any() for a in dst)


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_chunks_are_all_checked_before_any_byte_moves(fmt):
    caches = make_caches(fmt)
    originals = [c.copy() for c in caches]
    outs = [np.zeros((K, L, BS, H, D), dtype=np.uint16) for _ in range(3)]
    with pytest.raises(IndexError):
        gather_chunks(caches, [[0], [1], [NB]], outs, fmt)  # the last chunk's id is out of range
    assert not any(o.any() for o in outs)
    with pytest.raises(IndexError):
        scatter_chunks([np.ones_like(o) for o in outs], caches, [[0], [1], [NB]], fmt)
    assert all(np.array_equal(c, o) for c, o in zip(caches, originals))
    with pytest.raises(ValueError):  # one id list short
        gather_chunks(caches, [[0], [1]], outs, fmt)
    with pytest.raises(ValueError):  # chunks of different layer counts
        gather_chunks(caches, [[0], [1]], [outs[0], np.zeros((K, L - 1, BS, H, D), dtype=np.uint16)], fmt)
    gather_chunks(caches, [], [], fmt)  # nothing to do
    gather_chunks(caches, [[0], [NB]], [None, None], fmt)  # prepare_store's None slots: nothing written, nothing checked
    gather_chunks(caches, [[5], [1], [0]], [outs[0], None, outs[2]], fmt)
    assert np.array_equal(outs[0], naive_gather(caches, [5], fmt)) and np.array_equal(outs[2], naive_gather(caches, [0], fmt))
    assert not outs[1].any()


def test_block_ids_are_checked_against_every_layer():
    caches = [make_caches("kv_first", nb=NB, layers=1)[0], make_caches("kv_first", nb=NB - 2, layers=1)[0]]
    out = np.zeros((K, 2, BS, H, D), dtype=np.uint16)
    with pytest.raises((IndexError, ValueError)):
        gather_chunk(caches, [NB - 1], out, "kv_first")


@pytest.mark.parametrize(
    ("fmt", "cache_shape"),
    [
        ("kv_first", (3, NB, BS, H, D)),  # K does not match out's
        ("kv_first", (NB, BS, H, D)),  # 4-D
        ("block_first", (NB, 3, BS, H, D)),
        ("block_first", (K, NB, BS, H)),
        ("head_major", (NB, H, K * BS + 1, D)),  # K*block_size not divisible by K
        ("head_major", (NB, H, K * BS, D, 1)),  # 5-D
    ],
)
def test_wrong_cache_shapes_raise_value_error(fmt, cache_shape):
    caches = [np.zeros(cache_shape, dtype=np.uint16) for _ in range(L)]
    out = np.zeros((K, L, BS, H, D), dtype=np.uint16)
    with pytest.raises(ValueError):
        gather_chunk(caches, [0], out, fmt)
    with pytest.raises(ValueError):
        scatter_chunk(out, caches, [0], fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_chunk_shapes_raise_value_error(fmt):
    caches = make_caches(fmt)
    with pytest.raises(ValueError):  # one layer too few
        gather_chunk(caches, [0], np.zeros((K, L - 1, BS, H, D), dtype=np.uint16), fmt)
    with pytest.raises(ValueError):  # tokens do not match two blocks
        gather_chunk(caches, [0, 1], np.zeros((K, L, BS, H, D), dtype=np.uint16), fmt)
    with pytest.raises(ValueError):
        scatter_chunk(np.zeros((K, L + 1, BS, H, D), dtype=np.uint16), caches, [0], fmt)
    with pytest.raises(ValueError):
        scatter_chunk(np.zeros((K, L, 2 * BS, H, D), dtype=np.uint16), caches, [0], fmt)
    with pytest.raises(ValueError):  # 2-D block ids
        gather_chunk(caches, [[0], [1]], np.zeros((K, L, 2 * BS, H, D), dtype=np.uint16), fmt)


def test_unknown_format_raises_value_error():
    with pytest.raises(ValueError):
        canonical_view(np.zeros((K, NB, BS, H, D)), "nhd")
