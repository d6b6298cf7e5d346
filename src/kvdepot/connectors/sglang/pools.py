"""SGLang's v2 HiCache interface (hybrid models: Mamba / linear-attention states, SWA, DSA indexer pools),
shared by both SGLang backends (``backend.KVDepotHiCacheStorage`` over a kvdepot server,
``peer_backend.PeerHiCacheStorage`` over the peer tier).

SGLang (0.5.23, ``hicache_storage.py``) registers each host pool of a hybrid model with
``register_mem_host_pool_v2(pool, name)`` and then moves pages with ``PoolTransfer`` descriptors: one per
pool, its own keys (SGLang's page keys) and host indices. What this module does with them:

- the KV pool (``PoolName.KV``) goes through the backend's v1 methods, byte for byte what
  ``batch_get_v1`` / ``batch_set_v1`` / ``batch_exists`` do (same objects, same results);
- every other pool's page is one object of its own, named by the page key in a namespace of its own (the
  model identity plus ``|pool:<name>:<digest of the page geometry>``, TP-sharded as SGLang shards it), so
  it never meets a KV page or another pool's page; its bytes are the page's tensors back to back (for a
  Mamba pool that is SGLang's own flat page), copied straight between the host pool and the store;
- ``batch_exists_v2`` keeps SGLang's hit policies: the usable prefix is the longest KV prefix every pool
  can restore. ``ALL_PAGES``: every page up to it must exist; ``TRAILING_PAGES``: the last
  ``len(transfer.keys)`` pages before it must exist, and every prefix length that qualifies is reported
  (``restorable_prefix_pages``: SGLang intersects those sets across ranks, holes included);
- a pool kvdepot cannot hold (no per-page views of its memory, a GPU pool, an unknown hit policy) is
  refused once with a warning and is a miss from then on, never an exception in SGLang's threads.

``BLOCK_GROUPS`` is refused: SGLang 0.5.23 defines it without a caller or a backend that implements it,
and its docstring alone does not fix which objects a group is made of. Its pool gives no verdict (so,
as that docstring says, it never gates the KV hit) and its loads and saves are misses.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvdepot.runs import copy_all

log = logging.getLogger(__name__)

KV = "kv"  # PoolName.KV; SGLang's names and policies are str enums, so plain strings compare equal
MAMBA = "mamba"  # TP-sharded even where the model's MLA KV is replicated (SGLang's should_backup)
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"
SUPPORTED_POLICIES = (ALL_PAGES, TRAILING_PAGES)

Page = list[np.ndarray]  # one page of a pool: its tensors' views, in SGLang's order


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A writable numpy view of a CPU tensor, as the same-width integer (bfloat16/fp8 stay bits)."""
    if t.device.type != "cpu":
        raise ValueError(f"the pool is on {t.device}; kvdepot copies host pages only")
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width).numpy()


def _page_tensors(pool: Any, start: int) -> list[torch.Tensor]:
    # Mamba's get_data_page concatenates (a copy); _iter_page_tensors yields the views it is made of.
    # Both are checked to be views of the pool's memory before use (ExtraPool.of).
    if hasattr(pool, "_iter_page_tensors"):
        return list(pool._iter_page_tensors(start))
    return [pool.get_data_page(start, flat=False)]


@dataclass(frozen=True)
class ExtraPool:
    """A registered non-KV host pool seen page by page: each page is a list of views of the pool's own
    memory; its object is those views' bytes back to back."""

    name: str
    pool: Any
    page_size: int
    page_bytes: int
    digest: str  # names the page geometry (pool class, layout, each view's shape and dtype)

    @classmethod
    def of(cls, name: str, pool: Any) -> ExtraPool:
        """ValueError (the reason) for a pool whose pages are not views of its memory."""
        page_size = int(getattr(pool, "page_size", 0) or 0)
        if page_size <= 0:
            raise ValueError("the pool has no page size")
        first, again = _page_tensors(pool, 0), _page_tensors(pool, 0)
        if [t.data_ptr() for t in first] != [t.data_ptr() for t in again]:
            raise ValueError("its pages are copies, not views of the pool's memory")
        if int(getattr(pool, "size", 0)) >= 2 * page_size:
            other = _page_tensors(pool, page_size)
            if any(a.numel() and a.data_ptr() == b.data_ptr() for a, b in zip(first, other, strict=True)):
                raise ValueError("two pages share memory")
        views = [_numpy_view(t) for t in first]
        geometry = f"{type(pool).__name__}|{getattr(pool, 'layout', '')}|" + ";".join(f"{v.dtype.str}{v.shape}" for v in views)
        digest = hashlib.sha256(geometry.encode()).hexdigest()[:16]
        return cls(name, pool, page_size, sum(v.nbytes for v in views), digest)

    def page(self, start: int) -> Page:
        return [_numpy_view(t) for t in _page_tensors(self.pool, start)]

    def pages(self, host_indices: torch.Tensor | None, count: int) -> list[Page]:
        """The pages of a transfer: SGLang passes every slot's index, ``page_size`` per page."""
        if host_indices is None or host_indices.numel() != count * self.page_size:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(f"{got} host indices for {count} pages of {self.page_size}")
        return [self.page(s) for s in host_indices[:: self.page_size].tolist()]


def _parts(flat: np.ndarray, page: Page):
    """(slice of ``flat`` shaped as the view, view) for each view of ``page``, back to back."""
    offset = 0
    for v in page:
        yield flat[offset : offset + v.nbytes].view(v.dtype).reshape(v.shape), v
        offset += v.nbytes


def gather(page: Page, flat: np.ndarray) -> None:
    """The page's bytes into the object ``flat`` (uint8, contiguous, at least ``page_bytes``), and
    zeros after them: the object is rounded up to whole rows, and its tail held whatever L1 had there
    (another object's bytes, maybe another tenant's), which went on to every tier and peer."""
    copy_all(_parts(flat, page))
    flat[sum(v.nbytes for v in page) :] = 0


def scatter(flat: np.ndarray, page: Page) -> None:
    """The object ``flat`` into the page's views."""
    copy_all((v, part) for part, v in _parts(flat, page))


def leading(done: Sequence[bool]) -> list[bool]:
    """Only the leading run counts (SGLang's ``count_pool_hits``)."""
    n = next((i for i, ok in enumerate(done) if not ok), len(done))
    return [True] * n + [False] * (len(done) - n)


def restorable_lengths(present: Sequence[bool], policy: str, window: int) -> list[int]:
    """The prefix lengths (in pages, ascending) a pool can restore, from which of its pages exist."""
    if policy == ALL_PAGES:
        n = next((i for i, ok in enumerate(present) if not ok), len(present))
        return list(range(1, n + 1))
    # TRAILING_PAGES: a stop point works when the window ending there is whole; scan every one, since
    # a state stored at 8 and 4 pages but not at 6 leaves holes SGLang needs to see.
    return [p for p in range(1, len(present) + 1) if all(present[max(0, p - window) : p])]


class HostPoolsV2:
    """SGLang's v2 methods over a backend's own primitives. The backend supplies its KV methods (v1)
    and, for extra pools, ``_pool_present`` / ``_pool_read`` / ``_pool_write`` (each never raising)."""

    storage_config: Any

    def _init_pools_v2(self) -> None:
        """Called by the backend's ``__init__``."""
        self._extra_pools: dict[str, ExtraPool | None] = {}  # None: registered, refused
        self._refused: set[str] = set()  # what was logged already
        self._refused_lock = threading.Lock()

    def refuse(self, what: str) -> None:
        """Log ``what`` once per backend: SGLang calls per request, and the reason never changes."""
        with self._refused_lock:
            if what in self._refused:
                return
            self._refused.add(what)
        log.warning("kvdepot (SGLang): %s; its pages are misses", what)

    # --- registration -------------------------------------------------------------------------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        pools = self._extra_pools
        self.registered_pools = getattr(self, "registered_pools", {})
        self.registered_pools[host_pool_name] = host_pool
        name = str(getattr(host_pool_name, "value", host_pool_name))
        if name == KV:
            return  # the anchor: register_mem_pool_host set up the v1 path that v2 uses for it
        try:
            pools[name] = ExtraPool.of(name, host_pool)
        except Exception as exc:  # noqa: BLE001 - a refused pool is a miss, never a failed start
            pools[name] = None
            self.refuse(f"the {name!r} host pool ({type(host_pool).__name__}) cannot be held: {exc}")
            return
        self._pool_registered(pools[name])
        log.info("kvdepot: SGLang's %r host pool (%s, page %d, %d bytes a page) is held as objects of its own",
                 name, type(host_pool).__name__, pools[name].page_size, pools[name].page_bytes)  # fmt: skip

    def _pool_registered(self, pool: ExtraPool) -> None:
        """A hook: a backend that keeps per-pool state drops what it had for this name."""

    def on_host_pools_registered(self) -> None:
        pass

    def pool_identity(self, model: str, pool: ExtraPool) -> tuple[str, int, int]:
        """(model, rank, world size) of ``pool``'s namespace: the KV's model identity with the pool
        named in it; per TP rank unless SGLang replicates the pool (an MLA model's non-Mamba pools)."""
        cfg = self.storage_config
        sharded = pool.name == MAMBA or not cfg.is_mla_model
        rank, world = (cfg.tp_rank, cfg.tp_size) if sharded else (0, 1)
        return f"{model}|pool:{pool.name}:{pool.digest}", rank, world

    def _extra(self, transfer: Any) -> ExtraPool | None:
        name, policy = _name(transfer), _policy(transfer)
        if policy not in SUPPORTED_POLICIES:
            self.refuse(f"the {name!r} pool's hit policy {policy!r} is not supported")
            return None
        pools = self._extra_pools
        if name not in pools:
            self.refuse(f"the {name!r} pool was never registered (register_mem_host_pool_v2)")
        return pools.get(name)

    # --- lookups ------------------------------------------------------------------------------------

    def batch_exists_v2(self, keys: list[str], pool_transfers: list | None = None, extra_info: Any = None):
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        try:
            kv_pages, hits, restorable = self._exists_v2(keys, pool_transfers or [], extra_info)
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception in SGLang's prefetch thread
            log.warning("kvdepot (SGLang): a v2 lookup of %d pages failed: %s: %s", len(keys), type(exc).__name__, exc)
            return PoolTransferResult(0, {}, [])
        return PoolTransferResult(kv_pages, hits, restorable)

    def _exists_v2(self, keys: list[str], transfers: list, extra_info: Any) -> tuple[int, dict, list[int]]:
        kv_pages = int(self.batch_exists(keys, extra_info)) if keys else 0
        hits: dict = {_kv_name(): kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in transfers:
            if not restorable:
                break
            if _name(transfer) == KV:
                continue  # the KV pool's own verdict is kv_pages
            pool = self._extra(transfer)
            if _policy(transfer) not in SUPPORTED_POLICIES:
                continue  # no verdict, and (BLOCK_GROUPS) never a gate on the KV hit
            present = self._pool_present(pool, keys[:kv_pages]) if pool is not None else [False] * kv_pages
            own = restorable_lengths(present, _policy(transfer), max(1, len(transfer.keys or ())))
            if own:
                hits[transfer.name] = own[-1]
            allowed = set(own)
            restorable = [p for p in restorable if p in allowed]
        return (restorable[-1] if restorable else 0), hits, restorable

    # --- pages in and out ---------------------------------------------------------------------------

    def batch_get_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._io_v2(transfers, extra_info, self.batch_get_v1, self._pool_read, "load")

    def batch_set_v2(self, transfers: list, extra_info: Any = None) -> dict[str, list[bool]]:
        return self._io_v2(transfers, extra_info, self.batch_set_v1, self._pool_write, "save")

    def _io_v2(self, transfers: list, extra_info: Any, kv_io: Callable, pool_io: Callable, what: str) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            miss = [False] * len(keys)
            if not keys:
                results[transfer.name] = []
            elif _name(transfer) == KV:
                results[transfer.name] = kv_io(keys, transfer.host_indices, extra_info) if transfer.host_indices is not None else miss
            else:
                results[transfer.name] = self._pool_io(transfer, keys, pool_io, what)
        return results

    def _pool_io(self, transfer: Any, keys: list[str], pool_io: Callable, what: str) -> list[bool]:
        pool = self._extra(transfer)
        if pool is None:
            return [False] * len(keys)
        try:
            pages = pool.pages(transfer.host_indices, len(keys))
        except Exception as exc:  # noqa: BLE001
            log.warning("kvdepot (SGLang): a %s of %d %r pages: %s", what, len(keys), pool.name, exc)
            return [False] * len(keys)
        return pool_io(pool, keys, pages)

    # --- the backend's primitives -------------------------------------------------------------------

    def _pool_present(self, pool: ExtraPool, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def _pool_read(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        raise NotImplementedError

    def _pool_write(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        raise NotImplementedError


def _name(transfer: Any) -> str:
    return str(getattr(transfer.name, "value", transfer.name))


def _policy(transfer: Any) -> str:
    return str(getattr(transfer.hit_policy, "value", transfer.hit_policy))


def _kv_name() -> Any:
    """The KV pool's key in SGLang's hit dict: its own ``PoolName.KV`` (equal to "kv" either way)."""
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolName

        return PoolName.KV
    except ImportError:
        return KV
