"""KVDepotHiCacheStorage: kvdepot as SGLang HiCache's L3 (its "storage backend").

SGLang keeps KV in three tiers: device, host (its HiCache host pool) and storage. It backs pages up
from the host pool to storage on a backup thread, and on a prefix miss asks storage how many leading
pages it has (``batch_exists``, prefetch thread) and then reads them into the host pool
(``batch_get_v1`` or ``batch_get``, prefetch I/O thread). One SGLang page is one kvdepot chunk
(``pages.PageCodec``); SGLang's page key, a sha256 chain over the page's tokens, is kvdepot's chunk hash
byte for byte, and the registered context adds what the key lacks (model, TP rank, layout, page size).

Rules this class keeps, because SGLang's threads depend on them:

- never raise out of a call SGLang makes from its threads, and never return None where a list or a
  number is expected (a None kills SGLang's daemon thread); a failure is a miss (reads) or a
  not-stored (writes), counted by class (``connectors.common``);
- end every lookup and load inside SGLang's own prefetch budget (``runtime.SGLangRuntime``: a share,
  ``budget_share``, of the budget SGLang gives a prefetch of those pages, and never more than
  ``timeout_s``), so a dead or slow kvdepot is a miss before SGLang stops waiting, and SGLang's
  prefetch thread is free for the next request; after a transport failure the failing direction
  (lookup, load, save) leaves the server alone for ``retry_after_s``;
- a repeated write of a stored page is one round trip and no copy (the server answers EXISTS).

Zero copy: with ``"interface_v1": 1`` SGLang passes host-pool indices, and each page is copied straight
between the host pool and the server's shared-memory arena (one copy); off-host (or ``transport:
"inline"``) it travels inline. Without it, SGLang hands flat page tensors to ``batch_set`` and
``batch_get`` (one more copy, in SGLang).

Hybrid models (Mamba states, SWA, DSA indexer pools) use SGLang's v2 interface (``register_mem_host_pool_v2``,
``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2``): ``pools.HostPoolsV2``, each extra pool's pages objects of their
own namespace, SGLang's hit policies kept; a pool that cannot be held is a miss, said once.

Lifecycle: constructed by SGLang's loader (settings checked: a bad key fails SGLang's start with the
key named; SGLang's own settings read, and a warning naming the flag where they keep L3 hits from
working), ``register_mem_pool_host`` fixes the layout (an unsupported host layout fails the start or
the attach) and connects (a missing server is tried again at later calls); ``close`` (SGLang's
detach) closes the client. Attach and detach at run time (``POST /attach_hicache_storage_backend``)
build and close a fresh instance each time.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvdepot.connectors.common import Direction, FailureTally, ResilientClient
from kvdepot.connectors.sglang.pages import PageCodec, model_identity, page_hash
from kvdepot.connectors.sglang.pools import ExtraPool, HostPoolsV2, Page, gather, leading, scatter
from kvdepot.connectors.sglang.runtime import SGLangRuntime
from kvdepot.connectors.sglang.settings import SGLangSettings
from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.hashing import HashAlgorithm
from kvdepot.layout import KVLayout
from kvdepot.runs import copy_all
from kvdepot.types import ChunkHash, SlotStatus

log = logging.getLogger(__name__)

def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


_STORED = (SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY)  # written now, or already there / by another writer


class KVDepotHiCacheStorage(HostPoolsV2, HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self._init_pools_v2()
        self.settings = SGLangSettings.from_extra(storage_config.extra_config, "kvdepot SGLang backend option")
        self.runtime = SGLangRuntime.read().with_budget(self.settings.prefetch_timeout_base, self.settings.prefetch_timeout_per_ki_token)
        for note in self.runtime.notes:
            log.debug("kvdepot (SGLang): %s", note)
        for problem in self.runtime.problems():
            log.warning("kvdepot (SGLang): %s", problem)
        self.codec: PageCodec | None = None
        self._resilient: ResilientClient | None = None
        self.tally = FailureTally(log, "kvdepot (SGLang)")
        mla = storage_config.is_mla_model
        # MLA's latent is the same on every TP rank: one copy, written by SGLang's designated writer.
        self.writer = storage_config.is_storage_writer
        self.rank, self.world_size = (0, 1) if mla else (storage_config.tp_rank, storage_config.tp_size)
        self._pool_clients: dict[str, ResilientClient] = {}  # v2's extra pools: one namespace (context) each
        self._pool_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KVDepotHiCacheStorage({self.settings.url}, {self._resilient!r})"

    # --- set-up ---------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        codec = PageCodec.of(mem_pool_host)
        if self.settings.chunk_size not in (0, codec.page_size):
            raise ValueError(f"chunk_size {self.settings.chunk_size}: with SGLang a chunk is one page ({codec.page_size} tokens); leave it out")
        if self._resilient is not None:
            self._resilient.close()
        self._close_pool_clients()
        self.codec = codec
        self._resilient = ResilientClient(
            self.settings,
            self.model_identity(),
            codec.layout,
            codec.page_size,
            rank=self.rank,
            world_size=self.world_size,
            tally=self.tally,
            hash_algorithm=HashAlgorithm.SHA256.value,  # SGLang's page keys: refused at registration by any other server
        )
        log.info(
            "kvdepot: SGLang storage backend for %s (rank %d/%d, %s, page %d, %s) on %s, %s interface; %s",
            self._resilient.model, self.rank, self.world_size, mem_pool_host.layout, codec.page_size,
            codec.layout.fingerprint(), self.settings.url, "v1 (host indices)" if self.settings.interface_v1 else "flat-page",
            self.runtime.describe(),
        )
        # Connect now rather than in the first prefetch, whose budget is short (a missing server is
        # logged and tried again later, as any transport failure).
        self._client(Direction.CONNECT)

    def model_identity(self) -> str:
        """The model part of every object's identity (``pages.model_identity``): the extra-config's
        ``model_name``, else SGLang's, with the shard and the KV's own dtype."""
        assert self.codec is not None
        name = self.settings.model_name or self.storage_config.model_name or ""
        return model_identity(name, self.storage_config, self.codec, self.runtime.kv_cache_dtype)

    def _client(self, direction: Direction):
        if self._resilient is None:
            return None
        client = self._resilient.get(direction)
        if client is not None and client.hash_algorithm is not HashAlgorithm.SHA256:
            # SGLang's keys are sha256: a server hashing otherwise keys objects SGLang can never name.
            exc = KVDepotError(f"the kvdepot server hashes with {client.hash_algorithm.value}; SGLang needs sha256", ErrorCode.BAD_REQUEST)
            self._resilient.failed(Direction.CONNECT, exc, "checking the server")
            return None
        return client

    def deadline_s(self, pages: int) -> float:
        """How long a lookup or load of ``pages`` may take: inside SGLang's budget for them."""
        page = self.codec.page_size if self.codec is not None else 0
        return self.runtime.call_deadline_s(pages * page, page, self.settings.budget_share, self.settings.timeout_s)

    def _failed(self, direction: Direction, exc: BaseException, what: str) -> None:
        if self._resilient is not None:
            self._resilient.failed(direction, exc, what)
        else:
            log.warning("kvdepot (SGLang): %s failed: %s", what, exc)

    # --- lookups --------------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of ``keys`` kvdepot holds (L2 hits are brought into L1 first)."""
        if not keys:
            return 0
        t0 = time.perf_counter()
        try:
            client = self._client(Direction.LOOKUP)
            if client is None:
                return 0
            with client.deadline(self.deadline_s(len(keys))):
                found = int(client.stored_chunks([page_hash(k) for k in keys], ""))
            page = self.codec.page_size if self.codec is not None else 0
            log.info("kvdepot: SGLang looked up %d pages (%d tokens): %d stored (%.1f ms)", len(keys), len(keys) * page, found, _ms(t0))
            return found
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception in SGLang's prefetch thread
            self._failed(Direction.LOOKUP, exc, f"a lookup of {len(keys)} pages (ended after {_ms(t0):.0f} ms)")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- the zero-copy interface (extra-config "interface_v1": 1) ---------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Copy the leading stored pages of ``keys`` into the host pool at ``host_indices``; True for
        each page copied (SGLang uses the leading run of True)."""
        done = [False] * len(keys)
        if not keys or self.codec is None:
            return done
        codec = self.codec
        try:
            starts = codec.page_starts(host_indices, len(keys))
            targets = [codec.host_page(s) for s in starts]
            return self._read([page_hash(k) for k in keys], targets, f"a load of {len(keys)} pages")
        except Exception as exc:  # noqa: BLE001
            self._failed(Direction.LOAD, exc, f"a load of {len(keys)} pages")
            return done

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``; True for each page stored (now or before)."""
        if not keys or self.codec is None:
            return [False] * len(keys)
        codec = self.codec
        try:
            starts = codec.page_starts(host_indices, len(keys))
            return self._write([page_hash(k) for k in keys], lambda i: codec.host_page(starts[i]), f"a save of {len(keys)} pages")
        except Exception as exc:  # noqa: BLE001
            self._failed(Direction.SAVE, exc, f"a save of {len(keys)} pages")
            return [False] * len(keys)

    # --- the flat-page interface (SGLang's default for dynamic backends) --------------------------------

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Fill each flat page tensor of ``target_locations``; the tensor for a page fetched, None for the
        first page missing and every page after it."""
        if not keys:
            return []
        if self.codec is None or target_locations is None:
            return [None] * len(keys)
        codec = self.codec
        try:
            targets = [codec.chunk_view(t) for t in target_locations]
            done = self._read([page_hash(k) for k in keys], targets, f"a load of {len(keys)} pages")
        except Exception as exc:  # noqa: BLE001
            self._failed(Direction.LOAD, exc, f"a load of {len(keys)} pages")
            return [None] * len(keys)
        return [t if ok else None for t, ok in zip(target_locations, done)]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if self.codec is None or values is None or len(values) != len(keys):
            return False
        codec = self.codec
        try:
            return all(self._write([page_hash(k) for k in keys], lambda i: codec.chunk_view(values[i]), f"a save of {len(keys)} pages"))
        except Exception as exc:  # noqa: BLE001
            self._failed(Direction.SAVE, exc, f"a save of {len(keys)} pages")
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    # --- the two copies -------------------------------------------------------------------------------

    def _read(self, hashes: list[ChunkHash], targets, what: str) -> list[bool]:
        done = [False] * len(hashes)
        client = self._client(Direction.LOAD)
        if client is None:
            return done
        copied = 0
        t0 = time.perf_counter()
        try:
            with client.deadline(self.deadline_s(len(hashes))), client.prepare_retrieve(hashes) as views:
                copied = min(len(views), len(targets))
                copy_all(zip(targets[:copied], views[:copied]))
        except KVDepotError as exc:
            # Also a lease that ended before the copy did: those bytes may have changed under us.
            self._failed(Direction.LOAD, exc, f"{what} (ended after {_ms(t0):.0f} ms)")
            return done
        done[:copied] = [True] * copied
        page = self.codec.page_size if self.codec is not None else 0
        log.info("kvdepot: loaded %d of %d pages (%d tokens) into SGLang's host pool (%.1f ms)", copied, len(hashes), copied * page, _ms(t0))  # fmt: skip
        return done

    def _write(self, hashes: list[ChunkHash], source, what: str) -> list[bool]:
        if not self.writer:
            return [True] * len(hashes)  # MLA: another rank writes the one shared copy
        client = self._client(Direction.SAVE)
        if client is None:
            return [False] * len(hashes)
        try:
            with client.prepare_store(hashes) as slots:
                copy_all((slot, source(i)) for i, slot in enumerate(slots) if slot is not None)
        except KVDepotError as exc:
            self._failed(Direction.SAVE, exc, what)
            return [False] * len(hashes)
        stored = [status in _STORED for status in slots.statuses]
        refused = [s for s in slots.statuses if s not in _STORED]
        if refused:  # L1 full of locked objects, or a quota: a future miss, nothing more
            code = ErrorCode.NO_SPACE if refused[0] is SlotStatus.NO_SPACE else ErrorCode.BAD_REQUEST
            self.tally.add(Direction.SAVE, KVDepotError(f"{len(refused)} of {len(slots)} pages {refused[0].name}", code), what)
        return stored

    # --- v2's extra pools (``pools.HostPoolsV2``: the hit policies and the KV pool live there) -------

    def _pool_registered(self, pool: ExtraPool) -> None:
        with self._pool_lock:
            old = self._pool_clients.pop(pool.name, None)
        if old is not None:
            old.close()

    def _close_pool_clients(self) -> None:
        with self._pool_lock:
            clients, self._pool_clients = list(self._pool_clients.values()), {}
        for c in clients:
            c.close()

    def _pool_client(self, pool: ExtraPool, direction: Direction):
        """The client of ``pool``'s own namespace, made on first use; it shares the KV client's
        breakers (one server: a dead one is dead for every pool) and tally."""
        if self._resilient is None or self.codec is None:
            return None
        with self._pool_lock:
            resilient = self._pool_clients.get(pool.name)
            if resilient is None:
                model, rank, world = self.pool_identity(self._resilient.model, pool)
                # A chunk is page_size tokens of one byte row; the row is padded up so the page fits.
                width = max(1, -(-pool.page_bytes // self.codec.page_size))
                resilient = ResilientClient(
                    self.settings, model, KVLayout(1, 1, width, dtype="uint8", use_mla=True), self.codec.page_size,
                    rank=rank, world_size=world, breakers=self._resilient.breakers, tally=self.tally,
                    hash_algorithm=HashAlgorithm.SHA256.value,
                )  # fmt: skip
                self._pool_clients[pool.name] = resilient
        return resilient.get(direction)

    def _pool_present(self, pool: ExtraPool, keys: list[str]) -> list[bool]:
        """Which of ``keys`` the pool holds, page by page (a trailing-pages policy needs the holes): the
        server answers leading runs, so one lookup per run, skipping the page that ended it."""
        present = [False] * len(keys)
        what = f"a lookup of {len(keys)} {pool.name!r} pages"
        try:
            client = self._pool_client(pool, Direction.LOOKUP)
            if client is None or not keys:
                return present
            hashes = [page_hash(k) for k in keys]
            with client.deadline(self.deadline_s(len(keys))):
                i = 0
                while i < len(hashes):
                    run = int(client.stored_chunks(hashes[i:], ""))
                    present[i : i + run] = [True] * run
                    i += run + 1
        except Exception as exc:  # noqa: BLE001 - a miss, never an exception in SGLang's prefetch thread
            self._failed(Direction.LOOKUP, exc, what)
            return [False] * len(keys)
        return present

    def _pool_read(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        done = [False] * len(keys)
        what = f"a load of {len(keys)} {pool.name!r} pages"
        try:
            client = self._pool_client(pool, Direction.LOAD)
            if client is None:
                return done
            with client.deadline(self.deadline_s(len(keys))), client.prepare_retrieve([page_hash(k) for k in keys]) as views:
                for i, (view, page) in enumerate(zip(views, pages)):
                    scatter(view.reshape(-1), page)
                    done[i] = True
        except Exception as exc:  # noqa: BLE001 - also a lease that ended before the copy did
            self._failed(Direction.LOAD, exc, what)
            return [False] * len(keys)
        return leading(done)

    def _pool_write(self, pool: ExtraPool, keys: list[str], pages: list[Page]) -> list[bool]:
        what = f"a save of {len(keys)} {pool.name!r} pages"
        try:
            client = self._pool_client(pool, Direction.SAVE)
            if client is None:
                return [False] * len(keys)
            with client.prepare_store([page_hash(k) for k in keys]) as slots:
                for slot, page in zip(slots, pages):
                    if slot is not None:  # None: stored already (one round trip, no copy)
                        gather(page, slot.reshape(-1))
        except Exception as exc:  # noqa: BLE001
            self._failed(Direction.SAVE, exc, what)
            return [False] * len(keys)
        return [status in _STORED for status in slots.statuses]

    # --- the rest of SGLang's interface ----------------------------------------------------------------

    def clear(self) -> bool:
        """Not from SGLang: kvdepot is shared with other engines and models. Clear it through its admin
        port (``POST /cache/clear``)."""
        log.warning("kvdepot: SGLang asked to clear L3; kvdepot is shared, so nothing was dropped (use its POST /cache/clear)")
        return False

    def get_stats(self):
        return None  # SGLang then logs its own counters; kvdepot's are on its /status and /metrics

    def failures(self) -> dict[str, int]:
        """Failures so far by direction/class (what the log summarises)."""
        return self.tally.snapshot()

    def close(self) -> None:
        if self._resilient is not None:
            self._resilient.close()
        self._close_pool_clients()
