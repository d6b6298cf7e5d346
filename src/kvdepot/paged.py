"""Gather and scatter between an engine's paged KV cache and contiguous chunks.

A paged engine keeps each layer's KV in fixed-size blocks; a request's tokens are spread over the blocks
its block table names. ``gather_chunk`` copies the blocks of one chunk into a contiguous
``[K, L, T, H, D]`` buffer (for example a shared-memory slot of the server: the single copy of the shm
path) and ``scatter_chunk`` copies it back. Both work per layer with one vectorised ``np.take`` /
``np.put``-style call, so their cost is the memory traffic, not Python overhead.

Supported per-layer formats (each is viewed, without a copy, as ``[K, num_blocks, block_size, H, D]``):

- ``kv_first``:    ``[K, num_blocks, block_size, H, D]`` — vLLM's flash-attention layout.
- ``block_first``: ``[num_blocks, K, block_size, H, D]`` — flashinfer-style.
- ``vllm_cpu``:    ``[num_blocks, H, K*block_size, D]`` — vLLM's CPU backend (per head, K rows then V).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import numpy as np

from kvdepot.layout import as_numpy


class PagedFormat(str, Enum):
    KV_FIRST = "kv_first"
    BLOCK_FIRST = "block_first"
    VLLM_CPU = "vllm_cpu"


def canonical_view(layer_cache, fmt: PagedFormat | str, kv_factor: int = 2) -> np.ndarray:
    """View one layer's cache as ``[K, num_blocks, block_size, H, D]`` (no copy)."""
    arr = as_numpy(layer_cache)
    fmt = PagedFormat(fmt)
    if fmt is PagedFormat.KV_FIRST:
        if arr.ndim != 5 or arr.shape[0] != kv_factor:
            raise ValueError(f"kv_first expects [{kv_factor}, blocks, block_size, H, D], got {arr.shape}")
        return arr
    if fmt is PagedFormat.BLOCK_FIRST:
        if arr.ndim != 5 or arr.shape[1] != kv_factor:
            raise ValueError(f"block_first expects [blocks, {kv_factor}, block_size, H, D], got {arr.shape}")
        return arr.transpose(1, 0, 2, 3, 4)
    if arr.ndim != 4 or arr.shape[2] % kv_factor:
        raise ValueError(f"vllm_cpu expects [blocks, H, {kv_factor}*block_size, D], got {arr.shape}")
    nb, h, kbs, d = arr.shape
    return arr.reshape(nb, h, kv_factor, kbs // kv_factor, d).transpose(2, 0, 3, 1, 4)


def _check_ids(block_ids: Sequence[int], num_blocks: int) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.intp)
    if ids.ndim != 1:
        raise ValueError("block_ids must be one-dimensional")
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise IndexError(f"block id out of range [0, {num_blocks})")
    return ids


def gather_chunk(
    layer_caches: Sequence, block_ids: Sequence[int], out: np.ndarray, fmt: PagedFormat | str = "kv_first"
) -> np.ndarray:
    """Copy the blocks ``block_ids`` of every layer into ``out`` ``[K, L, len(ids)*block_size, H, D]``."""
    out = as_numpy(out)
    kf = out.shape[0]
    views = [canonical_view(c, fmt, kf) for c in layer_caches]
    if len(views) != out.shape[1]:
        raise ValueError(f"out has {out.shape[1]} layers but {len(views)} layer caches were given")
    ids = _check_ids(block_ids, views[0].shape[1])
    bs = views[0].shape[2]
    if out.shape[2] != ids.size * bs:
        raise ValueError(f"out holds {out.shape[2]} tokens, blocks give {ids.size * bs}")
    k, _, _, h, d = out.shape
    for layer, view in enumerate(views):
        dst = out[:, layer].reshape(k, ids.size, bs, h, d)
        # mode="clip" (ids are checked above) keeps numpy from buffering ``out``.
        np.take(view, ids, axis=1, out=dst, mode="clip")
    return out


def scatter_chunk(
    chunk: np.ndarray, layer_caches: Sequence, block_ids: Sequence[int], fmt: PagedFormat | str = "kv_first"
) -> None:
    """Copy ``chunk`` ``[K, L, T, H, D]`` into the blocks ``block_ids`` of every layer."""
    chunk = as_numpy(chunk)
    kf = chunk.shape[0]
    views = [canonical_view(c, fmt, kf) for c in layer_caches]
    if len(views) != chunk.shape[1]:
        raise ValueError(f"chunk has {chunk.shape[1]} layers but {len(views)} layer caches were given")
    ids = _check_ids(block_ids, views[0].shape[1])
    bs = views[0].shape[2]
    if chunk.shape[2] != ids.size * bs:
        raise ValueError(f"chunk holds {chunk.shape[2]} tokens, blocks give {ids.size * bs}")
    k, _, _, h, d = chunk.shape
    for layer, view in enumerate(views):
        src = chunk[:, layer].reshape(k, ids.size, bs, h, d)
        view[:, ids] = src  # one advanced-index assignment per layer
