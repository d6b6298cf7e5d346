"""SGLang's HiCache host pool seen as kvdepot chunks: one SGLang page is one kvdepot chunk.

A kvdepot chunk is ``[K, L, T, H, D]`` (``kvdepot.layout``). SGLang's host pool keeps the same numbers
in one of several memory layouts; each page of it is, without copying, a strided view that a permutation
turns into the chunk's shape. The table below names the axes of one page as SGLang's own
``get_data_page(index, flat=False)`` returns it (``p`` is the page axis of length 1, ``k`` keys/values,
``l`` layers, ``t`` tokens, ``H`` KV heads, ``d`` head dim; MLA pages have no ``k``: one latent):

=================== ============ =============
layout              MHA page     MLA page
=================== ============ =============
layer_first         k l t H d    l t H d
page_first          k t l H d    t l H d
page_first_direct   k p l t H d  p l t H d
page_head           k p H t l d  (none)
=================== ============ =============

Copies go straight between a page's view and a kvdepot buffer (an arena slot on the shm transport: the
one copy); bfloat16 and fp8 travel as same-width unsigned integers, never converted.

Pages of one pool lie at equal distances in one buffer (SGLang slices one axis of one tensor), so the
codec finds that distance once, checks it against SGLang's own ``get_data_page`` for the first, second
and last page, and afterwards makes a page's view with numpy alone (``PoolPages``): no call into SGLang
and no torch call per page. That matters inside SGLang: each torch call lets go of the GIL, and a
scheduler thread busy in Python takes up to its switch interval (5 ms) to hand it back (``kvdepot.runs``
says more).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from kvdepot.layout import KVLayout
from kvdepot.types import ChunkHash

_MHA_AXES = {
    "layer_first": "kltHd",
    "page_first": "ktlHd",
    "page_first_direct": "kpltHd",
    "page_head": "kpHtld",
}
_MLA_AXES = {
    "layer_first": "ltHd",
    "page_first": "tlHd",
    "page_first_direct": "pltHd",
}
log = logging.getLogger(__name__)

_CHUNK_AXES = "kltHd"  # [K, L, T, H, D]; H upper-case only so that no two axes share a letter


def supported_layouts(mla: bool) -> list[str]:
    return sorted(_MLA_AXES if mla else _MHA_AXES)


@dataclass(frozen=True)
class PageCodec:
    """How one page of a host pool maps onto a chunk: the page's shape as SGLang returns it, and the
    axis order that makes it ``[K, L, T, H, D]``."""

    pool: object  # SGLang's HostKVCache
    layout: KVLayout
    page_size: int
    axes: str  # the page's axes, from the table above
    page_shape: tuple[int, ...]
    permutation: tuple[int, ...]
    add_kv_axis: bool  # MLA: one latent, so K = 1
    pages: PoolPages | None = None  # page views without SGLang or torch (None: through get_data_page)
    logical_dtype: str = ""  # the KV's own dtype where the pool stores it as another (fp8 variants as uint8)
    index_step: int = 0  # host indices from one page to the next (SGLang's whole page; 0: page_size)

    @classmethod
    def of(cls, pool) -> PageCodec:
        """The codec of SGLang's host pool ``pool`` (MHA or MLA); ValueError for anything kvdepot cannot
        hold (another layout, K and V of different widths, an unsupported dtype)."""
        mla = hasattr(pool, "kv_lora_rank")
        name = pool.layout
        table = _MLA_AXES if mla else _MHA_AXES
        if name not in table:
            kind = "MLA" if mla else "MHA"
            raise ValueError(f"kvdepot cannot hold SGLang's {name!r} host layout for {kind}; use one of {supported_layouts(mla)}")
        if mla:
            heads, width = 1, int(pool.kv_cache_dim)
        else:
            if int(pool.v_head_dim) != int(pool.head_dim):
                raise ValueError(f"keys ({pool.head_dim}) and values ({pool.v_head_dim}) of different widths are not supported")
            heads, width = int(pool.head_num), int(pool.head_dim)
        dtype = str(pool.dtype).removeprefix("torch.")
        layout = KVLayout(int(pool.layer_num), heads, width, dtype=dtype, use_mla=mla)
        axes = table[name]
        page = pool.get_data_page(0, flat=False)
        kept = axes.replace("p", "")
        if mla:
            kept = "k" + kept
        permutation = tuple(kept.index(a) for a in _CHUNK_AXES)
        device = getattr(getattr(pool, "device_pool", None), "dtype", None)
        logical = str(device).removeprefix("torch.") if device is not None else ""
        step = int(getattr(pool, "logical_page_size", None) or pool.page_size)  # decode-CP ranks hold part of a page
        codec = cls(pool, layout, int(pool.page_size), axes, tuple(page.shape), permutation, mla,
                    logical_dtype="" if logical == dtype else logical, index_step=step)  # fmt: skip
        return replace(codec, pages=PoolPages.of(codec))  # found through the codec's own (SGLang's) page views

    def chunk_view(self, page: torch.Tensor) -> np.ndarray:
        """A writable numpy view ``[K, L, T, H, D]`` (storage dtype) of one page tensor (no copy)."""
        page = page.view(self.page_shape) if page.dim() == 1 else page  # view, never a silent copy: loads write into it
        if "p" in self.axes:
            page = page.squeeze(self.axes.index("p"))
        if self.add_kv_axis:
            page = page.unsqueeze(0)
        return _as_numpy(page.permute(self.permutation), self.layout)

    def host_page(self, token_index: int) -> np.ndarray:
        """The chunk view of the host pool's page that starts at token ``token_index``."""
        if self.pages is not None:
            return self.pages.page(token_index)
        return self.sglang_page(token_index)

    def sglang_page(self, token_index: int) -> np.ndarray:
        """The same view, made through SGLang's own ``get_data_page``."""
        return self.chunk_view(self.pool.get_data_page(token_index, flat=False))

    def page_starts(self, host_indices: torch.Tensor, pages: int) -> list[int]:
        """The first host index of each of ``pages`` pages (SGLang passes every token's index)."""
        step = self.index_step or self.page_size
        if host_indices.numel() < pages * step:
            raise ValueError(f"{host_indices.numel()} host indices for {pages} pages of {step}")
        return host_indices[: pages * step : step].tolist()


@dataclass(frozen=True)
class PoolPages:
    """Chunk views of a host pool's pages made by offset arithmetic over one numpy view of the pool's
    buffer: page ``i`` (starting at token ``i x page_size``) is at ``first + i x step`` bytes, with the
    shape and strides of every page."""

    buffer: np.ndarray  # uint8, the pool tensor's whole storage
    page_size: int
    first: int  # byte offset of page 0 in ``buffer``
    step: int  # bytes from one page to the next
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    count: int  # pages in the pool

    @classmethod
    def of(cls, codec: PageCodec) -> PoolPages | None:
        """Found from SGLang's own page views; None (views through SGLang) where the pool is not one
        evenly paged buffer, or where the arithmetic disagrees with SGLang for any page checked."""
        pool, size = codec.pool, codec.page_size
        count = int(getattr(pool, "size", 0)) // size
        if count < 2:
            return None
        try:
            tensor = pool.get_data_page(0, flat=False)
            storage = tensor.untyped_storage()
            buffer = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
            base = buffer.ctypes.data
            p0, p1 = codec.sglang_page(0), codec.sglang_page(size)
            pages = cls(buffer, size, p0.ctypes.data - base, p1.ctypes.data - p0.ctypes.data, p0.shape, p0.strides, p0.dtype, count)
            for i in (0, 1, count - 1):  # the arithmetic against SGLang's own view of each
                mine, theirs = pages.page(i * size), codec.sglang_page(i * size)
                if (mine.ctypes.data, mine.strides, mine.shape) != (theirs.ctypes.data, theirs.strides, theirs.shape):
                    raise ValueError(f"page {i}: offset arithmetic disagrees with get_data_page")
        except Exception as exc:  # noqa: BLE001 - an unusual pool is served the slow way, never refused
            log.info("kvdepot: SGLang's %s host pool is paged through get_data_page (%s)", pool.layout, exc)
            return None
        return pages

    def page(self, token_index: int) -> np.ndarray:
        index, rest = divmod(token_index, self.page_size)
        if rest or not 0 <= index < self.count:
            raise ValueError(f"host index {token_index} does not start one of the pool's {self.count} pages of {self.page_size}")
        return np.ndarray(self.shape, self.dtype, buffer=self.buffer, offset=self.first + index * self.step, strides=self.strides)


def model_identity(model_name: str, storage_config, codec: PageCodec, kv_cache_dtype: str = "") -> str:
    """The model part of every object's identity, over a kvdepot server or the peer tier alike: the model
    name, the pipeline and context-parallel shard (each holds other layers or tokens), and the KV's own
    dtype where the pool stores it as another (fp8_e4m3 and fp8_e5m2 are both uint8 bytes): the device
    pool's, else SGLang's ``--kv-cache-dtype`` (``kv_cache_dtype``)."""
    cfg = storage_config
    logical = codec.logical_dtype
    if not logical and codec.layout.dtype == "uint8" and kv_cache_dtype:
        logical = kv_cache_dtype
    if not logical and codec.layout.dtype == "uint8":
        log.warning("kvdepot (SGLang): the KV is stored as bytes and its own dtype is not known here; name the model with its "
                    "KV dtype (model_name) so that fp8_e4m3 and fp8_e5m2 deployments never share pages")  # fmt: skip
    name = model_name
    if getattr(cfg, "pp_size", 1) > 1:
        name += f"|pp{cfg.pp_rank}/{cfg.pp_size}"
    if getattr(cfg, "attn_cp_size", 1) > 1:
        name += f"|cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}"
    if getattr(cfg, "dcp_size", 1) > 1:
        name += f"|dcp{cfg.dcp_rank}/{cfg.dcp_size}"
    if logical:
        name += f"|kv:{logical}"
    return name


def page_hash(key: str) -> ChunkHash:
    """SGLang's page key (64 hex digits of a sha256 chain) as kvdepot's chunk hash; any other key
    (a future key scheme) is hashed, so that it still names one object."""
    if len(key) == 64:
        try:
            return ChunkHash(bytes.fromhex(key))
        except ValueError:
            pass
    return ChunkHash(hashlib.sha256(key.encode()).digest())


def _as_numpy(t: torch.Tensor, layout: KVLayout) -> np.ndarray:
    """A numpy view of a CPU tensor holding ``layout``'s dtype, as its storage dtype: bfloat16 (which
    numpy lacks) as uint16 and fp8 as uint8, through a same-width integer view of the tensor."""
    if t.device.type != "cpu":
        raise ValueError(f"SGLang's host pool is on {t.device}; kvdepot copies host pages only")
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).numpy().view(layout.storage_dtype)
