"""PeerHiCacheStorage: SGLang HiCache's L3 straight over the peer tier, with no kvdepot server.

Each SGLang process (each TP rank) is a node of a peer cluster (seed 002's own use case: a prefill node
backs pages up, a decode node reads them): ``batch_set_v1`` copies each page from SGLang's host pool
into this node's published pool (one copy, a strided page gathered on the way) and publishes where it
is; ``batch_exists`` asks the directory; ``batch_get_v1`` pulls each page from whichever node holds it
straight into the host pool (a page-first pool) or through one staging copy (a layer-first pool, whose
pages are strided). Loaded by SGLang's dynamic loader::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "kvdepot-peer",
        "module_path": "kvdepot.connectors.sglang.peer_backend", "class_name": "PeerHiCacheStorage",
        "interface_v1": 1, "discovery": "10.0.0.1:31995", "host": "10.0.0.2", "secret": "..."}'

The JSON holds SGLang's loader keys, this backend's (``model_name``, ``budget_share``) and any
``PeerConfig`` key (``kvdepot peer --help``). ``port`` and ``data_port`` default to free ports here (every
TP rank is a node); a head node must be given its ports (or run ``kvdepot peer`` as the head): its first
rank takes them and the others join it (``per_rank``).
``disk_path`` is a folder per rank (a subfolder named by its ranks where there are several): one disk tier
cannot be shared, and every rank gets the same JSON; ``metrics_port`` is the first rank's, the others'
follow it (``per_rank``).

Hybrid models (Mamba states, SWA, DSA indexer pools) use SGLang's v2 interface (``register_mem_host_pool_v2``,
``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``): ``pools.HostPoolsV2``, each extra pool's pages objects of their
own namespace, SGLang's hit policies kept; a pool that cannot be held is a miss, said once.

Object identity is the kvdepot server's: a namespace digest of (model, TP rank, layout, page size)
before SGLang's page key, so two models or two ranks never read each other's pages. The same rules as
the server backend hold: never raise into SGLang's threads, never return None for a list, and end each
lookup and load inside SGLang's own prefetch budget (a slow peer is a miss in time).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvdepot.config import ConfigStruct, option
from kvdepot.connectors.sglang.pages import PageCodec, model_identity, page_hash
from kvdepot.connectors.sglang.pools import ExtraPool, HostPoolsV2, Page, gather, leading, scatter
from kvdepot.connectors.sglang.runtime import SGLangRuntime
from kvdepot.connectors.sglang.settings import without_sglang_keys
from kvdepot.keys import NamespaceSpec
from kvdepot.peer.addresses import node_id
from kvdepot.peer.config import PeerConfig
from kvdepot.peer.store import PeerStore

log = logging.getLogger(__name__)


class PeerSGLangSettings(ConfigStruct, frozen=True, kw_only=True):
    _flag_prefix: ClassVar[str | None] = None

    backend_name: Annotated[str, option("SGLang's name for the backend")] = "kvdepot-peer"
    module_path: Annotated[str, option("for SGLang's dynamic loader")] = "kvdepot.connectors.sglang.peer_backend"
    class_name: Annotated[str, option("for SGLang's dynamic loader")] = "PeerHiCacheStorage"
    interface_v1: Annotated[int, option("1: host-pool indices (one copy); 0: flat page tensors", ge=0, le=1)] = 0
    prefetch_threshold: Annotated[int, option("SGLang's: the fewest uncached tokens worth an L3 lookup", ge=0)] = 256
    prefetch_timeout_base: Annotated[float, option("SGLang's prefetch budget's fixed part, s", ge=0)] | None = None
    prefetch_timeout_per_ki_token: Annotated[float, option("SGLang's prefetch budget per 1,024 tokens, s", ge=0)] | None = None
    model_name: Annotated[str, option("the model part of every key; empty: SGLang's model name")] = ""
    budget_share: Annotated[float, option("the share of SGLang's prefetch budget one lookup or load may use", gt=0, le=1)] = 0.4
    prefill_tokens_per_s: Annotated[
        float, option("this engine's prefill rate: pages are pulled from other nodes only when that is estimated faster (0: always pull)", ge=0)
    ] = 0.0


def split_settings(extra: dict[str, Any] | None) -> tuple[PeerSGLangSettings, PeerConfig]:
    """The one JSON object as (this backend's and SGLang's keys, the node's ``PeerConfig``); an unknown
    key is a ValueError naming it."""
    extra = without_sglang_keys(extra)
    peer_keys = set(PeerConfig.__struct_fields__)
    own_keys = set(PeerSGLangSettings.__struct_fields__)
    unknown = sorted(set(extra) - peer_keys - own_keys)
    if unknown:
        raise ValueError(f"unknown kvdepot peer backend option(s) {unknown}; known: {sorted(peer_keys | own_keys)}")
    peer = {k: v for k, v in extra.items() if k in peer_keys}
    peer.setdefault("port", 0)  # every TP rank is a node: free ports unless told otherwise
    peer.setdefault("data_port", 0)
    try:
        own = msgspec.convert({k: v for k, v in extra.items() if k in own_keys}, PeerSGLangSettings, strict=False)
        node = msgspec.convert(peer, PeerConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(f"kvdepot peer backend option: {exc}") from None
    return own, node


_RANKS = (("pp", "pp_rank", "pp_size"), ("dp", "dp_rank", None), ("cp", "attn_cp_rank", "attn_cp_size"), ("tp", "tp_rank", "tp_size"))


def per_rank(node: PeerConfig, storage_config: HiCacheStorageConfig) -> PeerConfig:
    """The node's settings made this process's own. SGLang hands every rank (TP, PP, attention DP and
    CP) the same JSON, and each rank is a node:
    - ``disk_path``: a disk folder takes one tier (the first rank got it, every other ran with no disk
      tier); each rank that is one of several gets a subfolder named by its ranks, the same on every
      restart, so its pages come back with it; ``disk_size_gb`` bounds each;
    - ``metrics_port``: the first rank's; the others' follow it, one per rank (every rank tried the
      same port and all but one served no metrics);
    - ``port`` and ``data_port`` given (a head's): the first rank's; the others take free ones (each
      tried the first's and failed to start), and where no ``discovery`` is given they join the first
      (the head), or each would have been the head of a cluster of its own."""
    parts, index, span, dp = [], 0, 1, 0
    for name, rank, size in _RANKS:
        r = int(getattr(storage_config, rank, 0) or 0)
        n = int(getattr(storage_config, size, 1) or 1) if size else 1
        if n > 1 or r > 0:
            parts.append(f"{name}{r}")
        if size:
            index, span = index * n + r, span * n
        else:
            dp = r
    # dp's size is not given: it leads the index, whatever it is (it took the index over, dropping the
    # pipeline stage before it: every stage's ranks took the first stage's ports)
    index += dp * span
    if not parts:
        return node
    changes: dict[str, Any] = {}
    if node.disk_path:
        changes["disk_path"] = os.path.join(node.disk_path, "-".join(parts))
    if node.metrics_port:
        port = node.metrics_port + index
        if port > 65535:
            log.warning("kvdepot: rank %s's metrics port would be %d, past 65535: its metrics page is off", "-".join(parts), port)
            port = 0
        changes["metrics_port"] = port
    if index and node.port:
        changes["port"] = changes["data_port"] = 0
        if not node.discovery:
            host = "127.0.0.1" if node.host in ("0.0.0.0", "::", "[::]", "") else node.host
            changes["discovery"] = node_id(host, node.port)
    return msgspec.structs.replace(node, **changes) if changes else node


class PeerHiCacheStorage(HostPoolsV2, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self._init_pools_v2()
        self.settings, self.peer_config = split_settings(storage_config.extra_config)
        self.peer_config = per_rank(self.peer_config, storage_config)
        self.runtime = SGLangRuntime.read().with_budget(self.settings.prefetch_timeout_base, self.settings.prefetch_timeout_per_ki_token)
        mla = storage_config.is_mla_model
        self.writer = storage_config.is_storage_writer
        self.rank, self.world_size = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        self.codec: PageCodec | None = None
        self._prefix = b""
        self._model = ""  # the KV's model identity: extra pools' namespaces are made from it
        self.store = PeerStore(self.peer_config)  # joins now: a bad secret or an unreachable head shows at start
        self.failures = 0

    def __repr__(self) -> str:
        return f"PeerHiCacheStorage({self.store.node_id}, head {self.store.node.head})"

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        codec = PageCodec.of(mem_pool_host)
        # The same identity as over a server: pipeline stages, context-parallel ranks and fp8 variants
        # would otherwise share keys (same names, same page keys, other bytes).
        name = self.settings.model_name or self.storage_config.model_name or ""
        model = model_identity(name, self.storage_config, codec, self.runtime.kv_cache_dtype)
        self._prefix = NamespaceSpec(model, self.world_size, self.rank, codec.layout.fingerprint(), codec.page_size).digest()
        self._model = model
        self.codec = codec
        log.info("kvdepot: SGLang L3 over the peer tier for %s (rank %d/%d, %s, page %d), node %s, head %s; %s",
                 model, self.rank, self.world_size, mem_pool_host.layout, codec.page_size, self.store.node_id,
                 self.store.node.head, self.runtime.describe())  # fmt: skip

    def _keys(self, keys: list[str]) -> list[bytes]:
        return [self._prefix + page_hash(k) for k in keys]

    def deadline_s(self, pages: int) -> float:
        page = self.codec.page_size if self.codec is not None else 0
        return self.runtime.call_deadline_s(pages * page, page, self.settings.budget_share, self.peer_config.timeout_s)

    def _recompute_s(self, pages: int) -> float | None:
        """What prefilling ``pages`` pages would take at ``prefill_tokens_per_s`` (None: not said)."""
        rate = self.settings.prefill_tokens_per_s
        page = self.codec.page_size if self.codec is not None else 0
        return pages * page / rate if rate > 0 else None

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        log.warning("kvdepot (SGLang, peer): %s failed: %s: %s", what, type(exc).__name__, exc)

    # --- lookups --------------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys or self.codec is None:
            return 0
        t0 = time.perf_counter()
        try:
            found = self.store.batch_exists(self._keys(keys), timeout_s=self.deadline_s(len(keys)), recompute_s=self._recompute_s(len(keys)))
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception in SGLang's prefetch thread
            self._failed(f"a lookup of {len(keys)} pages", exc)
            return 0
        log.info("kvdepot: SGLang looked up %d pages in the peer cluster: %d found (%.1f ms)", len(keys), found, (time.perf_counter() - t0) * 1e3)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- pages in and out -------------------------------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys or self.codec is None:
            return [False] * len(keys)
        try:
            starts = self.codec.page_starts(host_indices, len(keys))
            return self._read(keys, [self.codec.host_page(s) for s in starts])
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a load of {len(keys)} pages", exc)
            return [False] * len(keys)

    def batch_set_v1(self, keys: list[str], host_indices, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys or self.codec is None:
            return [False] * len(keys)
        if not self.writer:
            return [True] * len(keys)  # MLA: another rank writes the one shared copy
        try:
            starts = self.codec.page_starts(host_indices, len(keys))
            return self.store.batch_set(self._keys(keys), [self.codec.host_page(s) for s in starts])
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a save of {len(keys)} pages", exc)
            return [False] * len(keys)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        if not keys:
            return []
        if self.codec is None or target_locations is None:
            return [None] * len(keys)
        try:
            done = self._read(keys, [self.codec.chunk_view(t) for t in target_locations])
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a load of {len(keys)} pages", exc)
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(target_locations, done, strict=True)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if self.codec is None or values is None or len(values) != len(keys):
            return False
        if not self.writer:
            return True
        try:
            return all(self.store.batch_set(self._keys(keys), [self.codec.chunk_view(v) for v in values]))
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a save of {len(keys)} pages", exc)
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    def _read(self, keys: list[str], targets: list[np.ndarray]) -> list[bool]:
        """Each page straight into its target where the target is contiguous, else through a staging
        buffer and one copy; only the leading run counts (SGLang uses that)."""
        t0 = time.perf_counter()
        dests = [t if t.flags.c_contiguous else np.empty(t.shape, t.dtype) for t in targets]
        # Pull or recompute was decided at the lookup (SGLang looks up before every load): the pages it
        # counted are read; deciding again could decline what SGLang was told it would get.
        got = self.store.batch_get_into(self._keys(keys), dests, timeout_s=self.deadline_s(len(keys)))
        n = 0
        while n < len(got) and got[n]:
            if dests[n] is not targets[n]:
                np.copyto(targets[n], dests[n])
            n += 1
        log.info("kvdepot: loaded %d of %d pages from the peer cluster into SGLang's host pool (%.1f ms)", n, len(keys), (time.perf_counter() - t0) * 1e3)
        return [True] * n + [False] * (len(keys) - n)

    # --- v2's extra pools (``pools.HostPoolsV2``: the hit policies and the KV pool live there) -------

    def _pool_keys(self, pool: ExtraPool, keys: list[str]) -> list[bytes]:
        """``pool``'s own namespace (model, pool name, page geometry, TP shard) before each page key."""
        model, rank, world = self.pool_identity(self._model, pool)
        prefix = NamespaceSpec(model, world, rank, f"pool:{pool.digest}:{pool.page_bytes}", pool.page_size).digest()
        return [prefix + page_hash(k) for k in keys]

    def _pool_present(self, pool: ExtraPool, keys: list[str]) -> list[bool]:
        if not keys or self.codec is None:
            return [False] * len(keys)
        try:
            return list(self.store.exists_many(self._pool_keys(pool, keys), timeout_s=self.deadline_s(len(keys))))
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception in SGLang's prefetch thread
            self._failed(f"a lookup of {len(keys)} {pool.name!r} pages", exc)
            return [False] * len(keys)

    def _pool_read(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        """A one-view contiguous page is read in place; any other through one staging buffer."""
        if self.codec is None:
            return [False] * len(keys)
        try:
            dests = [p[0] if len(p) == 1 and p[0].flags.c_contiguous else np.empty(pool.page_bytes, np.uint8) for p in pages]
            got = leading(self.store.batch_get_into(self._pool_keys(pool, keys), dests, timeout_s=self.deadline_s(len(keys))))
            for ok, dest, page in zip(got, dests, pages):
                if ok and dest is not page[0]:
                    scatter(dest, page)
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a load of {len(keys)} {pool.name!r} pages", exc)
            return [False] * len(keys)
        return got

    def _pool_write(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        """A one-view page is gathered by the store itself (strided or not); a page of several views
        (Mamba's temporal and conv states) is put together in one staging buffer first."""
        if self.codec is None:
            return [False] * len(keys)
        try:
            values = [p[0] if len(p) == 1 else _gathered(p, pool.page_bytes) for p in pages]
            return self.store.batch_set(self._pool_keys(pool, keys), values)
        except Exception as exc:  # noqa: BLE001
            self._failed(f"a save of {len(keys)} {pool.name!r} pages", exc)
            return [False] * len(keys)

    def clear(self) -> bool:
        """This node's own pages only (the cluster's other nodes keep theirs)."""
        self.store.clear()
        return True

    def get_stats(self):
        return None

    def close(self) -> None:
        self.store.close()


def _gathered(page: Page, nbytes: int) -> np.ndarray:
    flat = np.empty(nbytes, np.uint8)
    gather(page, flat)
    return flat
