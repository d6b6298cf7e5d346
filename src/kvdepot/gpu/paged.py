"""A worker's paged KV cache as torch tensors on one device, read and written a chunk's blocks at a time.

An engine keeps each layer's KV in fixed-size blocks; a request's tokens are spread over the blocks its
block table names. ``DevicePagedCache.gather`` copies the blocks of ``n`` chunks into a contiguous
``[n, K, L, T, H, D]`` buffer on the same device (a staging buffer, before one copy to host memory) and
``scatter`` copies such a buffer back into blocks. Every layer is read as ``[K, blocks, block_size, H, D]``
of its *bits* (integers of the same width), so a copy is bit-exact for every dtype, fp8 included, and never
looks at values.

Cost: when every layer is a view into one allocation, evenly spaced (as an engine that allocates the
whole cache at once lays them out), all layers move in one batched ``index_select`` / ``index_copy_`` and
one permuting copy; otherwise in one indexing kernel per layer that reads or writes the chunk layout in
place (two per layer for a scatter whose skip ends inside a chunk). Never one per block.

Block ids come from the wire on the server, so they are checked on the host before any kernel sees them:
an index out of range inside a CUDA kernel is a device-side assert that ends the whole CUDA context.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdepot.gpu.runtime import bits_dtype, require_torch
from kvdepot.layout import PagedFormat


class DevicePagedCache:
    """``layers``: one tensor per layer in model order (the chunk's L axis), all of one shape, dtype and
    device, in ``fmt`` (``kv_first`` or ``block_first``). ``groups[l]``: the KV-cache group whose block ids
    address layer ``l`` (hybrid models have several; default: one group)."""

    def __init__(self, layers: Sequence, fmt: PagedFormat | str, block_size: int, groups: Sequence[int] | None = None, kv_factor: int = 2) -> None:
        self.torch = torch = require_torch("moving a paged KV cache")
        if not layers:
            raise ValueError("a paged cache needs at least one layer")
        self.format = PagedFormat(fmt)
        if self.format not in (PagedFormat.KV_FIRST, PagedFormat.BLOCK_FIRST):
            raise ValueError(f"the device path reads kv_first or block_first caches, not {self.format.value}")
        first = layers[0]
        self.device = first.device
        self.dtype = first.dtype
        self.kv_factor = kv_factor
        self.block_size = block_size
        self.groups = list(groups) if groups is not None else [0] * len(layers)
        if len(self.groups) != len(layers) or min(self.groups) < 0:
            raise ValueError(f"groups names {len(self.groups)} layers' groups for {len(layers)} layers")
        self.num_groups = max(self.groups) + 1
        bits = bits_dtype(first.dtype)
        self.views = [self._canonical(t.view(bits), i) for i, t in enumerate(layers)]
        for i, (t, v) in enumerate(zip(layers, self.views)):
            if t.device != self.device or t.dtype != self.dtype or v.shape != self.views[0].shape:
                raise ValueError(f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is {tuple(first.shape)} {first.dtype} on {self.device}")
        k, self.num_blocks, bs, self.heads, self.head_dim = self.views[0].shape
        if bs != block_size:
            raise ValueError(f"the cache's blocks hold {bs} tokens, not block_size {block_size}")
        self._stacked = self._stack(layers, bits) if len(set(self.groups)) == 1 else None

    def __repr__(self) -> str:
        return (f"DevicePagedCache({self.format.value}, {len(self.views)} layers x {self.num_blocks} blocks of {self.block_size}, "
                f"H={self.heads} D={self.head_dim} {self.dtype} on {self.device}, {'stacked' if self._stacked is not None else 'per layer'})")

    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def kernels(self) -> int:
        """Kernels a gather or scatter of any size launches: two for a stacked cache (select, permute),
        one per layer for a cache of separate layer allocations (vLLM allocates each layer's cache on
        its own; two per layer for a scatter whose skip ends inside a chunk)."""
        return 2 if self._stacked is not None else len(self.views)

    def close(self) -> None:
        """Let go of the layers (the memory they view is released once nothing else holds it)."""
        self.views = []
        self._stacked = None

    @property
    def block_bytes(self) -> int:
        """One block of one layer, K and V."""
        return self.kv_factor * self.block_size * self.heads * self.head_dim * self.views[0].element_size()

    def chunk_shape(self, n: int, blocks_per_chunk: int) -> tuple[int, ...]:
        return (n, self.kv_factor, self.num_layers, blocks_per_chunk * self.block_size, self.heads, self.head_dim)

    def _canonical(self, t, index: int):
        k = self.kv_factor
        if t.dim() != 5:
            raise ValueError(f"layer {index} has shape {tuple(t.shape)}; a {self.format.value} cache is 5-dimensional")
        if self.format is PagedFormat.KV_FIRST:
            if t.shape[0] != k:
                raise ValueError(f"layer {index}: kv_first expects [{k}, blocks, block_size, H, D], got {tuple(t.shape)}")
            return t
        if t.shape[1] != k:
            raise ValueError(f"layer {index}: block_first expects [blocks, {k}, block_size, H, D], got {tuple(t.shape)}")
        return t.transpose(0, 1)

    def _stack(self, layers: Sequence, bits):
        """One ``[L, K, blocks, block_size, H, D]`` view over every layer when they lie evenly spaced in one
        storage with equal strides (one kernel for all layers), else None."""
        if len(layers) < 2:
            return None
        torch = self.torch
        storage = layers[0].untyped_storage()
        ptr0 = storage.data_ptr()
        item = self.views[0].element_size()
        offsets = []
        for t, v in zip(layers, self.views):
            if t.untyped_storage().data_ptr() != ptr0 or v.stride() != self.views[0].stride():
                return None
            offsets.append(v.storage_offset())  # in elements of the bits dtype
        step = offsets[1] - offsets[0]
        if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:])):
            return None
        base = torch.empty(0, dtype=bits, device=self.device).set_(storage, 0, (storage.nbytes() // item,), (1,))
        return torch.as_strided(base, (len(layers), *self.views[0].shape), (step, *self.views[0].stride()), offsets[0])

    # --- block ids -------------------------------------------------------------------------------------

    def check_ids(self, block_ids: Sequence[Sequence[int]], n_blocks: int) -> list[np.ndarray]:
        """Per group, ``n_blocks`` ids in ``[0, num_blocks)``; IndexError/ValueError naming the problem."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"block ids for {len(block_ids)} KV-cache groups; the cache has {self.num_groups}")
        out = []
        for g, ids in enumerate(block_ids):
            try:
                arr = np.asarray(ids, dtype=np.int64)
            except (OverflowError, TypeError, ValueError):
                raise ValueError(f"group {g}: block ids must be integers that fit in 64 bits") from None
            if arr.ndim != 1 or arr.size != n_blocks:
                raise ValueError(f"group {g}: {arr.size} block ids for {n_blocks} blocks")
            if arr.size and (arr.min() < 0 or arr.max() >= self.num_blocks):
                raise IndexError(f"group {g}: a block id is outside [0, {self.num_blocks})")
            out.append(arr)
        return out

    def device_ids(self, ids):
        """Block ids (a checked numpy array) as an index on the cache's device. A mover uploads a call's
        ids once, before its data copies, and slices them per piece: an upload per piece would queue
        behind the data copies on the copy engine (and stall the kernels that wait for it)."""
        torch = self.torch
        if isinstance(ids, torch.Tensor):
            return ids
        index = torch.from_numpy(ids)
        if self.device.type != "cuda":
            return index
        # From pinned memory (torch's caching host allocator): a copy from pageable memory would first wait
        # for everything queued on the stream, the wait on the engine's event included, holding up the host.
        return index.pin_memory().to(self.device, non_blocking=True)

    # --- copies --------------------------------------------------------------------------------------

    def check_write_mode(self) -> None:
        """Refuse a scatter that torch's deterministic mode would make unsafe: on CUDA it writes an
        indexed copy into a non-contiguous target (a block_first cache's layers, or the stacked view) by
        copying the whole target out and back, every block of it, racing the engine's own writes to
        other blocks. The load fails instead (its blocks are recomputed), saying why."""
        torch = self.torch
        if self.device.type != "cuda" or not torch.are_deterministic_algorithms_enabled():
            return
        targets = [self._stacked] if self._stacked is not None else self.views
        if not all(t.is_contiguous() for t in targets):
            raise RuntimeError(
                "torch.use_deterministic_algorithms(True) is on: its indexed copy rewrites every block of this "
                f"{self.format.value} cache, under the engine's own writes; kvdepot does not load into it"
            )

    def gather(self, block_ids: Sequence, out) -> None:
        """Copy the blocks of ``out.shape[0]`` chunks (``block_ids[g]``: group g's ids, chunk after chunk,
        checked numpy arrays or ``device_ids``) into ``out`` ``[n, K, L, T, H, D]`` (the cache's bits
        dtype or its dtype, on its device)."""
        n, k, nl, tokens, h, d = out.shape
        out = out.view(self.views[0].dtype)
        if self._stacked is not None:
            sel = self._stacked.index_select(2, self.device_ids(block_ids[self.groups[0]]))  # every layer's group (one)
            out.copy_(sel.view(nl, k, n, tokens, h, d).permute(2, 1, 0, 3, 4, 5))
            return
        # Layers allocated apart: one indexing kernel per layer, writing straight into the strided chunk
        # layout (no second, permuting copy): a layer's blocks [K, n, blocks a chunk, bs, H, D].
        bpc = tokens // self.block_size
        index = [self.device_ids(ids).view(n, bpc) for ids in block_ids]
        for layer, view in enumerate(self.views):
            into = out[:, :, layer].view(n, k, bpc, self.block_size, h, d).permute(1, 0, 2, 3, 4, 5)
            self.torch.ops.aten.index.Tensor_out(view, [None, index[self.groups[layer]]], out=into)

    def scatter(self, src, block_ids: Sequence, skip_blocks: int = 0, layers: range | None = None) -> None:
        """Copy ``src`` ``[n, K, L, T, H, D]`` into the chunks' blocks, leaving the first ``skip_blocks``
        blocks (over the chunks in order) unwritten; only ``layers`` when given (a layer-by-layer load)."""
        n, k, nl, tokens, h, d = src.shape
        src = src.view(self.views[0].dtype)
        bs = self.block_size
        per = n * tokens // bs
        skip = min(max(skip_blocks, 0), per)
        if skip == per:
            return
        layers = layers if layers is not None else range(nl)
        self.check_write_mode()
        if self._stacked is not None:
            index = self.device_ids(block_ids[self.groups[0]][skip:])  # every layer's group (one)
            part = src[:, :, layers.start : layers.stop].permute(2, 1, 0, 3, 4, 5).reshape(len(layers), k, per, bs, h, d)
            self._stacked[layers.start : layers.stop].index_copy_(2, index, part[:, :, skip:])
            return
        bpc = tokens // bs
        if skip % bpc == 0:
            # Whole chunks skipped: one indexing kernel per layer, reading the strided chunk layout as is.
            first = skip // bpc
            index = [self.device_ids(ids[skip:]).view(n - first, bpc) for ids in block_ids]
            for layer in layers:
                values = src[first:, :, layer].view(n - first, k, bpc, bs, h, d).permute(1, 0, 2, 3, 4, 5)
                self.torch.ops.aten.index_put_(self.views[layer], [None, index[self.groups[layer]]], values)
            return
        index = [self.device_ids(ids[skip:]) for ids in block_ids]
        for layer in layers:
            part = src[:, :, layer].transpose(0, 1).reshape(k, per, bs, h, d)
            self.views[layer].index_copy_(1, index[self.groups[layer]], part[:, skip:])
