"""How a vLLM worker's paged KV cache maps onto kvdepot chunks ``[K, L, T, H, D]``.

vLLM's CPU attention backend allocates one tensor per layer shaped ``[num_blocks, H, block_size, 2*D]``
(all layers views into one allocation). Inside a block, per head, it keeps the block's keys first and
its values after them -- but *how* depends on the kernel ISA it picked. With the ``vec`` ISA (x86
without AMX, the common case) the keys are stored transposed, ``[D, block_size]``, and the values as
rows, ``[block_size, D]``; other ISAs (``amx``, ``neon``, ``vec16``, ...) pack them their own way.

So the layout is not guessed from the shape: ``probe_cpu_layout`` writes known keys and values through
vLLM's own cache-write kernel into a scratch cache and checks which reading recovers them.

- ``token_major``: the probe found the ``vec`` layout; chunks hold real per-token K and V, byte-equal to
  what any other engine with the same model and layout would store. Keys are transposed on the way.
- ``raw``: any other layout. Chunks hold each block's bytes as they are (a byte-exact round trip), and
  the model id gets a ``@vllm-cpu-<isa>`` suffix so such chunks are never shared with an engine that
  reads chunks as per-token K/V.
- ``native`` (the default, ``cpu_kv_layout="native"``): whatever the ISA, a chunk holds each block's
  keys and values in vLLM's own byte order, head by head, so a load or save is one contiguous run of
  ``block_size * D`` elements per (K or V, layer, block, head): memcpy speed. Moving per-token keys into
  the ``vec`` layout is a transpose at element granularity, measured at ~4.5 x a memcpy of the same
  bytes (the whole difference between a kvdepot hit and vLLM's own prefix-cache hit). Its model id gets
  ``@vllm-cpu-<isa>-native-bs<block size>``: only an engine with the same layout reads these chunks. ``shared`` keeps
  ``token_major`` (or ``raw``) for engines that must read each other's chunks (vLLM and SGLang on CPU).

``token_major`` and ``raw`` are expressed as per-K lists of strided ``[1, num_blocks, block_size, H, D]``
views, which ``kvdepot.paged``'s ``kv_first`` gather/scatter copy block by block (all layers per call
when the layers are evenly spaced, as vLLM allocates them); ``native`` copies runs (``_NativeBlocks``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvdepot.connectors.paged import gather_chunk, scatter_chunk
from kvdepot.layout import KVLayout, as_numpy

log = logging.getLogger(__name__)

TOKEN_MAJOR = "token_major"
RAW = "raw"
NATIVE = "native"


class CpuKVLayout(str, enum.Enum):
    """How the vLLM connector lays out chunks of vLLM's CPU cache (``cpu_kv_layout``)."""

    NATIVE = "native"  # vLLM's own byte order per head: copies at memcpy speed; read by the same layout only
    SHARED = "shared"  # per-token K/V where the layout allows it: read by other engines too (SGLang)

_TORCH_DTYPE_NAMES = {
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float32",
    "torch.uint8": "uint8",  # fp8 caches are allocated as uint8
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
    "torch.int8": "int8",
}


def dtype_name(torch_dtype) -> str:
    name = _TORCH_DTYPE_NAMES.get(str(torch_dtype))
    if name is None:
        raise ValueError(f"kvdepot cannot store a KV cache of dtype {torch_dtype}")
    return name


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """What the probe decided: how chunks are read from blocks, and the model-id suffix that keeps
    chunks of incompatible byte layouts apart (empty for ``token_major``)."""

    kind: str  # TOKEN_MAJOR | RAW | NATIVE
    isa: str
    block_size: int = 0  # vLLM's; 0: not known (then left out of the suffix)

    @property
    def model_suffix(self) -> str:
        """``native`` and raw chunks hold vLLM's blocks as they are, so their bytes depend on the block
        size too (two engines with other block sizes but one chunk size must never share them)."""
        if self.kind == TOKEN_MAJOR:
            return ""
        bs = f"-bs{self.block_size}" if self.block_size else ""
        return f"@vllm-cpu-{self.isa}-native{bs}" if self.kind == NATIVE else f"@vllm-cpu-{self.isa}{bs}"


def choose_format(probed: CacheFormat, layout: CpuKVLayout | str) -> CacheFormat:
    """The format chunks use: ``probed`` (``probe_cpu_layout``) for ``shared``, vLLM's own for ``native``."""
    return CacheFormat(NATIVE, probed.isa, probed.block_size) if CpuKVLayout(layout) is CpuKVLayout.NATIVE else probed


def _cpu_views(layer: np.ndarray, head_size: int, kind: str) -> list[np.ndarray]:
    """Per-K ``[1, num_blocks, block_size, H, D]`` views of one layer ``[nb, H, bs, 2*D]``."""
    nb, h, bs, two_d = layer.shape
    if two_d != 2 * head_size:
        raise ValueError(f"expected a [blocks, H, block_size, 2*{head_size}] CPU cache, got {layer.shape}")
    halves = np.reshape(layer, (nb, h, 2, bs * head_size), copy=False)
    if kind == TOKEN_MAJOR:
        k = np.reshape(halves[:, :, 0], (nb, h, head_size, bs), copy=False).transpose(0, 3, 1, 2)
    else:
        k = np.reshape(halves[:, :, 0], (nb, h, bs, head_size), copy=False).transpose(0, 2, 1, 3)
    v = np.reshape(halves[:, :, 1], (nb, h, bs, head_size), copy=False).transpose(0, 2, 1, 3)
    return [k[None], v[None]]


@functools.lru_cache(maxsize=None)
def probe_cpu_layout(dtype_str: str, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> CacheFormat:
    """Write known K/V through vLLM's CPU cache kernel and see which reading gives them back."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = getattr(torch, dtype_str.removeprefix("torch."))
    try:
        isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except Exception as exc:  # an unsupported combination: treat the bytes as opaque
        log.warning("kvdepot: cannot tell the CPU attention ISA (%s); storing raw blocks", exc)
        return CacheFormat(RAW, "unknown", block_size)
    if kv_cache_dtype not in ("auto", dtype_str.removeprefix("torch.")):
        return CacheFormat(RAW, isa, block_size)  # quantized caches: opaque bytes
    try:
        from vllm import _custom_ops as ops

        heads, blocks = 2, 2
        cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
        gen = torch.Generator().manual_seed(0)
        # Small integers are exact in every float dtype the backend supports.
        key = torch.randint(-100, 100, (block_size, heads, head_size), generator=gen).to(dtype)
        value = torch.randint(-100, 100, (block_size, heads, head_size), generator=gen).to(dtype)
        slots = torch.arange(block_size, 2 * block_size)  # block 1
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
        views = _cpu_views(as_numpy(cache), head_size, TOKEN_MAJOR)
        want_k, want_v = as_numpy(key), as_numpy(value)
        if np.array_equal(views[0][0, 1], want_k) and np.array_equal(views[1][0, 1], want_v):
            return CacheFormat(TOKEN_MAJOR, isa, block_size)
    except Exception as exc:
        log.warning("kvdepot: probing vLLM's CPU KV layout failed (%s); storing raw blocks", exc)
    return CacheFormat(RAW, isa, block_size)


class PagedKV:
    """One worker's KV cache as kvdepot sees it: per-layer views, the chunk layout, and the copies.

    ``block_ids`` given to ``gather``/``scatter`` name the blocks of whole chunks, in token order.
    """

    def __init__(self, layers: Sequence, block_size: int, head_size: int, fmt: CacheFormat) -> None:
        arrays = [as_numpy(t) for t in layers]
        shape = arrays[0].shape
        for i, a in enumerate(arrays):
            if a.shape != shape or a.dtype != arrays[0].dtype:
                raise ValueError(f"layer {i} cache is {a.shape} {a.dtype}, layer 0 is {shape} {arrays[0].dtype}")
        if len(shape) != 4 or shape[2] != block_size:
            raise ValueError(f"expected [blocks, H, {block_size}, 2*D] caches, got {shape}")
        self.block_size = block_size
        self.format = fmt
        self.num_blocks = shape[0]
        self.num_layers = len(arrays)
        self._native = _NativeBlocks(arrays, head_size) if fmt.kind == NATIVE else None
        per_layer = [_cpu_views(a, head_size, TOKEN_MAJOR if fmt.kind == NATIVE else fmt.kind) for a in arrays]
        self.per_k = [[views[k] for views in per_layer] for k in range(2)]

    def __repr__(self) -> str:
        return (
            f"PagedKV(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
            f"format={self.format.kind}/{self.format.isa})"
        )

    def gather(self, block_ids: Sequence[int], out: np.ndarray, layer: int | None = None) -> None:
        """Copy the blocks into ``out`` ``[K, L, len(ids)*block_size, H, D]`` (a store slot); ``layer``
        limits it to one layer."""
        if self._native is not None:
            self._native.copy(out, block_ids, range(self.num_layers) if layer is None else (layer,), to_cache=False)
            return
        for k, views in enumerate(self.per_k):
            if layer is None:
                gather_chunk(views, block_ids, out[k : k + 1], "kv_first")
            else:
                gather_chunk([views[layer]], block_ids, out[k : k + 1, layer : layer + 1], "kv_first")

    def scatter(self, chunk: np.ndarray, block_ids: Sequence[int], skip_blocks: int = 0, layer: int | None = None) -> None:
        """Copy ``chunk`` into the blocks, leaving the first ``skip_blocks`` of them untouched (blocks
        vLLM already holds, possibly shared with running requests). ``layer`` limits it to one layer."""
        tokens = slice(skip_blocks * self.block_size, None)
        ids = list(block_ids)[skip_blocks:]
        if not ids:
            return
        if self._native is not None:
            layers = range(self.num_layers) if layer is None else (layer,)
            self._native.copy(chunk[:, :, tokens], ids, layers, to_cache=True)
            return
        for k, views in enumerate(self.per_k):
            if layer is None:
                scatter_chunk(chunk[k : k + 1, :, tokens], views, ids, "kv_first")
            else:
                scatter_chunk(chunk[k : k + 1, layer : layer + 1, tokens], [views[layer]], ids, "kv_first")


class _NativeBlocks:
    """``native`` chunks: per (K or V, layer), token range ``[j*bs, (j+1)*bs)`` of a chunk holds block
    ``ids[j]``'s bytes for that half, head after head (``[H, bs*D]``), exactly as vLLM's cache keeps
    them, so every copy is one 2-D copy of ``H`` contiguous runs."""

    def __init__(self, arrays: list[np.ndarray], head_size: int) -> None:
        nb, h, bs, _ = arrays[0].shape
        self.block_size, self.heads, self.run = bs, h, bs * head_size
        self.halves = [np.reshape(a, (nb, h, 2, bs * head_size), copy=False) for a in arrays]  # [block, head, K|V, run]

    def copy(self, chunk: np.ndarray, block_ids: Sequence[int], layers, to_cache: bool) -> None:
        bs, n = self.block_size, len(block_ids)
        if chunk.shape[2] != n * bs:
            raise ValueError(f"the chunk holds {chunk.shape[2]} tokens, the blocks give {n * bs}")
        if not n:
            return
        ids = np.asarray(block_ids, dtype=np.intp)
        blocks = self.halves[0].shape[0]
        if ids.min() < 0 or ids.max() >= blocks:
            raise IndexError(f"block ids {ids.min()}..{ids.max()} outside the cache's {blocks} blocks")
        # One indexed copy per (layer, K or V) moves all the chunk's blocks in C: a Python call per block
        # cost more than the copy itself (a 4k-token hit is thousands of 16-KiB runs).
        for layer in layers:
            half = self.halves[layer]
            if half.dtype != chunk.dtype:
                half = half.view(chunk.dtype)  # bf16 is int16 from torch, uint16 from KVLayout
            rows = np.reshape(chunk[:, layer], (2, n, self.heads, self.run), copy=False)  # [K|V, block, head, run]
            if to_cache:
                # Seen as the cache's [block, head, K|V, run]: each block's bytes are written front to back, once.
                half[ids] = rows.transpose(1, 2, 0, 3)
            else:
                # Gathered in C into a block-sized temporary (it stays in the cache), then laid out as
                # the chunk's. (np.take on the cache's halves copies the whole cache first: not that.)
                np.copyto(rows.transpose(1, 2, 0, 3), half[ids])


_PLAIN_CACHE_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32"})  # the layout's dtype names these


def cache_dtype_tag(cache_dtype: str, skip_layers: Sequence[str] = ()) -> str:
    """A model-id suffix for a quantized KV cache (``--kv-cache-dtype``): vLLM allocates every fp8 and
    int encoding as uint8, so the layout alone would let an ``fp8_e5m2`` engine load ``fp8_e4m3`` bytes.
    Empty for the plain dtypes, which the layout's dtype already tells apart. vLLM's ``fp8`` is e4m3."""
    if cache_dtype in _PLAIN_CACHE_DTYPES:
        return ""
    tag = "@kv-" + ("fp8_e4m3" if cache_dtype == "fp8" else cache_dtype)
    if skip_layers:  # those layers keep the model's dtype: another mix of bytes per chunk
        tag += "-skip" + hashlib.sha256(",".join(sorted(skip_layers)).encode()).hexdigest()[:8]
    return tag


def make_layout(num_layers: int, num_kv_heads: int, head_size: int, torch_dtype) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_size, dtype=dtype_name(torch_dtype))
