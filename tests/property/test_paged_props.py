"""gather/scatter over random shapes, formats and block tables, against a per-block loop."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.connectors.paged import gather_chunk, scatter_chunk


def block_of(cache: np.ndarray, fmt: str, block: int, kf: int) -> np.ndarray:
    """One block as [K, block_size, H, D], indexed the way each format is documented."""
    if fmt == "kv_first":
        return cache[:, block]
    if fmt == "block_first":
        return cache[block]
    nb, h, kbs, d = cache.shape
    bs = kbs // kf
    return np.stack([cache[block, :, k * bs : (k + 1) * bs, :].transpose(1, 0, 2) for k in range(kf)])


@st.composite
def cases(draw):
    fmt = draw(st.sampled_from(["kv_first", "block_first", "head_major"]))
    kf = draw(st.integers(1, 2))
    layers = draw(st.integers(1, 3))
    nb = draw(st.integers(1, 6))
    bs = draw(st.integers(1, 4))
    h = draw(st.integers(1, 3))
    d = draw(st.integers(1, 4))
    ids = draw(st.lists(st.integers(0, nb - 1), max_size=nb, unique=True))
    seed = draw(st.integers(0, 2**16))
    shape = {"kv_first": (kf, nb, bs, h, d), "block_first": (nb, kf, bs, h, d), "head_major": (nb, h, kf * bs, d)}[fmt]
    rng = np.random.default_rng(seed)
    caches = [rng.integers(0, 255, size=shape, dtype=np.uint8) for _ in range(layers)]
    return fmt, kf, bs, h, d, ids, caches


@settings(max_examples=150, deadline=None)
@given(cases())
def test_gather_equals_per_block_copy(case):
    fmt, kf, bs, h, d, ids, caches = case
    out = np.full((kf, len(caches), len(ids) * bs, h, d), 0xEE, dtype=np.uint8)
    gather_chunk(caches, ids, out, fmt)
    for layer, cache in enumerate(caches):
        for j, block in enumerate(ids):
            assert out[:, layer, j * bs : (j + 1) * bs].tobytes() == np.ascontiguousarray(block_of(cache, fmt, block, kf)).tobytes()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_scatter_writes_exactly_the_named_blocks_and_round_trips(case):
    fmt, kf, bs, h, d, ids, caches = case
    originals = [c.copy() for c in caches]
    rng = np.random.default_rng(len(ids))
    chunk = rng.integers(0, 255, size=(kf, len(caches), len(ids) * bs, h, d), dtype=np.uint8)
    scatter_chunk(chunk, caches, ids, fmt)
    nb = originals[0].shape[0] if fmt != "kv_first" else originals[0].shape[1]
    for layer, (cache, orig) in enumerate(zip(caches, originals)):
        for block in range(nb):
            got = np.ascontiguousarray(block_of(cache, fmt, block, kf)).tobytes()
            if block in ids:
                j = ids.index(block)
                assert got == np.ascontiguousarray(chunk[:, layer, j * bs : (j + 1) * bs]).tobytes()
            else:
                assert got == np.ascontiguousarray(block_of(orig, fmt, block, kf)).tobytes()
    back = np.zeros_like(chunk)
    gather_chunk(caches, ids, back, fmt)
    assert back.tobytes() == chunk.tobytes()
