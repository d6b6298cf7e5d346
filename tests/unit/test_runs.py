"""``kvdepot.runs.copy_all``: the same bytes as ``np.copyto`` for every shape of pair the connectors copy
(whole chunks, strided page views of a host pool, permuted views whose runs are short), and clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.runs import MIN_RUN_BYTES, copy_all, plan


def random_u16(shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**16, size=shape, dtype=np.uint16)


def test_pages_of_a_layer_first_pool_are_copied_as_runs_and_byte_exact():
    pool = np.zeros((2, 4, 1024, 4, 64), np.uint16)  # [K, L, tokens, H, D]: a page is 16 runs of 32 KiB
    chunks = [random_u16((2, 4, 64, 4, 64), seed) for seed in range(3)]
    starts = [128, 0, 640]
    pages = [pool[:, :, s : s + 64] for s in starts]
    assert plan(pages[0].shape, pages[0].strides, chunks[0].strides, 2).run_bytes == 64 * 4 * 64 * 2
    copy_all(zip(pages, chunks))
    for s, c in zip(starts, chunks):
        assert np.array_equal(pool[:, :, s : s + 64], c)
    assert not pool[:, :, 64:128].any()  # nothing outside the pages was touched
    back = [np.empty_like(c) for c in chunks]
    copy_all(zip(back, pages))  # and the other way (a save)
    assert all(np.array_equal(b, c) for b, c in zip(back, chunks))


def test_short_runs_fall_back_to_numpy_with_the_same_result():
    pool = np.zeros((2, 1024, 4, 4, 64), np.uint16)  # page_first: [K, tokens, L, H, D]
    page = pool[:, 64:128].transpose(0, 2, 1, 3, 4)  # chunk order [K, L, T, H, D]: runs of 512 bytes
    chunk = random_u16(page.shape, 5)
    assert plan(page.shape, page.strides, chunk.strides, 2) is None
    copy_all([(page, chunk)])
    assert np.array_equal(page, chunk)


def test_item_size_is_what_counts_not_the_dtype_name():
    dst = np.zeros((8, 8192), np.int16)
    src = random_u16((8, 8192), 7)  # bfloat16 travels as uint16; a pool may be viewed as int16
    copy_all([(dst, src)])
    assert np.array_equal(dst.view(np.uint16), src)


def test_length_one_axes_do_not_break_a_run():
    dst = np.zeros((2, 1, 64, 256), np.uint16)[:, :, :, :]
    src = np.lib.stride_tricks.as_strided(random_u16((2, 64, 256), 9), (2, 1, 64, 256), (64 * 256 * 2, 12345, 512, 2))
    assert plan(dst.shape, dst.strides, src.strides, 2).run_bytes >= MIN_RUN_BYTES
    copy_all([(dst, src)])
    assert np.array_equal(dst, src)


def test_bad_pairs_are_refused_before_any_byte_moves():
    ro = np.zeros((4, 8192), np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        copy_all([(ro, random_u16((4, 8192)))])
    with pytest.raises(ValueError, match="cannot copy"):
        copy_all([(np.zeros((4, 8192), np.uint16), random_u16((4, 4096)))])
    with pytest.raises(ValueError, match="cannot copy"):
        copy_all([(np.zeros((4, 8192), np.uint32), random_u16((4, 8192)))])
