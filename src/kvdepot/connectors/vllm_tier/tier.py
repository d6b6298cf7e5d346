"""KVDepotTier: a kvdepot server as a secondary tier of vLLM's native KV offloading.

vLLM's native offloading (``--kv-offloading-backend native``) keeps offloaded KV in a CPU tier of its
own (the *primary* tier, one row per offload chunk, in shared memory of the scheduler process) and, with
``TieringOffloadingSpec``, cascades every row it stores to its *secondary* tiers and promotes rows back
from them on a miss. This class is such a secondary tier: rows go to a kvdepot server and come back
from it, so every engine on that server (and every restart of one) finds what any of them stored.

Contract with vLLM (its ``SecondaryTierManager``), all on vLLM's scheduler thread:

- ``lookup`` never blocks: a key not answered yet is RETRY, and the key goes to kvdepot on a lookup
  thread (vLLM's own ``AsyncLookupManager``, one batch per request per step, sent at ``on_schedule_end``);
  vLLM asks again next step and gets HIT or MISS.
- ``submit_store`` / ``submit_load`` only hand the job to a transfer thread (``transfers.py``); the
  thread copies between vLLM's rows (``primary_kv_view``: slots vLLM pinned for the job) and kvdepot
  (arena slots on the shm transport: one copy; frames on inline), and ``get_finished_jobs`` hands the
  outcome back once. A load that got only the leading k keys reports those k as loaded.
- A failure is a miss, never an exception into vLLM: a dead or slow server makes lookups MISS, loads
  fail (vLLM recomputes) and stores fail (vLLM keeps serving from its own tiers). After a transport
  failure the failing direction leaves the server alone for ``retry_after_s`` (``ResilientClient``).
- ``drain_jobs`` returns once no transfer thread touches vLLM's rows; ``shutdown`` stops the threads
  and closes the client.

What a row is called in kvdepot (namespace, layout, chunk hash): ``identity.py``. Nothing received is
unpickled; the tier stores bytes and reads bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import Locality, LookupResult, OffloadKey, ReqContext, RequestOffloadingContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvdepot.connectors.common import Direction, FailureTally, ResilientClient, ensure_logging
from kvdepot.connectors.vllm_tier.config import TierSettings
from kvdepot.connectors.vllm_tier.identity import KEY_SCHEME, TierIdentity, chunk_hash, lookup_chains, namespace_fields, tokens_per_chunk
from kvdepot.connectors.vllm_tier.transfers import Completions, JobQueue, Outcome
from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.limits import MAX_KEYS
from kvdepot.runs import copy_all
from kvdepot.types import SlotStatus

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

_HELD = (SlotStatus.ALLOCATED, SlotStatus.EXISTS, SlotStatus.BUSY)  # written now, already there, or by another writer
_CLOSE_TIMEOUT_S = 30.0


class _Lookups(AsyncLookupManager):
    """vLLM's asynchronous lookup bookkeeping, answered by the tier (on the lookup thread)."""

    def __init__(self, tier: KVDepotTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        return self._tier.stored(keys, req_context)


class KVDepotTier(SecondaryTierManager):
    """A kvdepot server as one of vLLM's secondary offload tiers (see the module docstring)."""

    # kvdepot holds KV in a server's memory and its L2 tiers: none of vLLM's media exactly. Unknown
    # medium: per-request tier filters match it on locality alone; hits count as external.
    medium: ClassVar = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        """``options``: the tier's entry in ``secondary_tiers`` less what vLLM keeps (``TierSettings``);
        a bad one raises ValueError naming the key, which fails vLLM's start."""
        settings = TierSettings.from_tier_options(options)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        ensure_logging()
        self.settings = settings
        self.locality = Locality(settings.locality.upper()) if settings.locality else None
        config = offloading_spec.config
        self._tokens = tokens_per_chunk(config)
        fields = namespace_fields(config, current_platform.device_type, _fp8_format(), _canonical_format(config))
        self.identity = TierIdentity.of(fields, self.block_size_bytes, list(self._tokens.values()), settings.model_name)
        # Rows as bytes; vLLM's view is (num_chunks, row stride) and may be typed int8.
        self._rows = np.asarray(primary_kv_view).view(np.uint8).reshape(len(primary_kv_view), self.block_size_bytes)
        self.tally = FailureTally(log, "kvdepot (vLLM tier)")
        self._resilient = ResilientClient(
            settings, self.identity.model, self.identity.layout, self.identity.chunk_tokens, tally=self.tally, hash_scheme=KEY_SCHEME
        )
        self._completions = Completions()
        self._loads = JobQueue("vllm-tier-load", self._completions)
        self._stores = JobQueue("vllm-tier-store", self._completions)
        self._load_keys: dict[int, list[OffloadKey]] = {}  # scheduler thread only: a failed load's keys become misses
        self._lookups: _Lookups | None = None  # started with the first lookup (it runs a thread)
        self._closed = False
        log.info(
            "kvdepot: vLLM offload tier on %s as %s (%d-byte rows, %d tokens each)",
            settings.url, self.identity.model, self.block_size_bytes, self.identity.chunk_tokens,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"KVDepotTier({self.settings.url}, {self.identity.model!r}, open jobs={self._completions.open}, {self._resilient!r})"

    # --- vLLM's scheduler thread --------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()  # chunk level: every new row is offered once

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._closed:
            return LookupResult.MISS
        if self._lookups is None:
            self._lookups = _Lookups(self)
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._lookups is not None:
            self._lookups.flush()  # this step's new keys go to kvdepot together

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        self._stores.submit(job_metadata.job_id, len(keys), lambda: self._store(keys, chunk_ids))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        self._load_keys[job_metadata.job_id] = keys
        self._loads.submit(job_metadata.job_id, len(keys), lambda: self._load(keys, chunk_ids))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [self._result(outcome) for outcome in self._completions.take()]

    def has_pending_work(self) -> bool:
        return self._completions.open > 0

    def drain_jobs(self) -> None:
        self._completions.wait_idle()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lookups is not None:
            self._lookups.shutdown()
        # Jobs not started yet end as failures: a slow server must not hold vLLM's exit for each of them.
        loads_ended = self._loads.close(_CLOSE_TIMEOUT_S, cancel=True)
        stores_ended = self._stores.close(_CLOSE_TIMEOUT_S, cancel=True)
        self._resilient.close()
        if loads_ended and stores_ended:
            # vLLM unmaps its CPU tier right after this: a view of it kept here makes that fail and keeps
            # the whole region mapped. (A thread still copying keeps it, so the mapping outlives the copy.)
            self._rows = None

    @property
    def transport(self) -> str:
        """"shm" or "inline" once connected ("" before): how rows travel."""
        client = self._resilient.client
        return client.transport if client is not None else ""

    def failures(self) -> dict[str, int]:
        """Failures so far by direction/class (what the log summarises)."""
        return self.tally.snapshot()

    def _result(self, outcome: Outcome) -> JobResult:
        keys = self._load_keys.pop(outcome.job_id, None)
        if keys is not None and not outcome.complete:
            # Those keys were answered HIT and are not there now: a miss from here on, so vLLM does not
            # try the same promotion again and again.
            if self._lookups is not None:
                self._lookups.mark_miss(keys[outcome.done :])
        partial = keys[: outcome.done] if keys is not None and 0 < outcome.done < outcome.total else None
        return JobResult(
            job_id=outcome.job_id,
            success=outcome.complete,
            successful_keys=tuple(partial) if partial else None,
            transfer_time=outcome.seconds,
            transfer_bytes=outcome.nbytes,
        )

    # --- the lookup thread --------------------------------------------------------------------------

    def _client(self, direction: Direction, what: str):
        """The connected client for a call in ``direction``; None while that direction is switched off or
        connecting failed (counted; a miss for the caller)."""
        try:
            return self._resilient.get(direction)
        except Exception as exc:  # noqa: BLE001 - e.g. a server that registered another chunk size
            self._resilient.failed(Direction.CONNECT, exc, what)
            return None

    def stored(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        """Which of ``keys`` kvdepot holds (False for any it could not be asked about)."""
        found = [False] * len(keys)
        client = self._client(Direction.LOOKUP, "connecting for a lookup") if keys else None
        if client is None:
            return found
        size = client.hash_algorithm.digest_size
        positions = [req_context.get_offload_key_position(k) for k in keys]
        try:
            for chain in lookup_chains(keys, positions, self._tokens):
                # One request names at most MAX_KEYS chunks: a longer chain is asked piece by piece,
                # the next piece only while every key so far was found.
                for start in range(0, len(chain), MAX_KEYS):
                    piece = chain[start : start + MAX_KEYS]
                    hits = client.stored_chunks([chunk_hash(keys[i], size) for i in piece], "")
                    for i in piece[:hits]:
                        found[i] = True
                    if hits < len(piece):
                        break
        except Exception as exc:  # noqa: BLE001 - a miss, never an error in vLLM
            self._resilient.failed(Direction.LOOKUP, exc, f"a lookup of {len(keys)} offload chunks")
        return found

    # --- the transfer threads -----------------------------------------------------------------------

    def _store(self, keys: list[OffloadKey], chunk_ids: list[int]) -> tuple[int, int]:
        """Rows ``chunk_ids`` (pinned by vLLM until the job ends) into kvdepot under ``keys``."""
        what = f"a store of {len(keys)} offload chunks"
        client = self._client(Direction.SAVE, what)
        if client is None:
            return 0, 0
        size = client.hash_algorithm.digest_size
        try:
            with client.prepare_store([chunk_hash(k, size) for k in keys]) as slots:
                copy_all((slot, self._rows[c].reshape(slot.shape)) for slot, c in zip(slots, chunk_ids) if slot is not None)
        except Exception as exc:  # noqa: BLE001
            self._resilient.failed(Direction.SAVE, exc, what)
            return 0, 0
        written = sum(slot is not None for slot in slots) * self.block_size_bytes
        held = [status in _HELD for status in slots.statuses]
        if not all(held):  # L1 full of locked objects, or a quota: a later miss, nothing more
            refused = next(s for s in slots.statuses if s not in _HELD)
            code = ErrorCode.NO_SPACE if refused is SlotStatus.NO_SPACE else ErrorCode.BAD_REQUEST
            self.tally.add(Direction.SAVE, KVDepotError(f"{held.count(False)} of {len(keys)} chunks {refused.name}", code), what)
        return (held.index(False) if not all(held) else len(keys)), written

    def _load(self, keys: list[OffloadKey], chunk_ids: list[int]) -> tuple[int, int]:
        """The leading stored ``keys`` into rows ``chunk_ids`` (slots vLLM allocated for them)."""
        what = f"a load of {len(keys)} offload chunks"
        client = self._client(Direction.LOAD, what)
        if client is None:
            return 0, 0
        size = client.hash_algorithm.digest_size
        t0 = time.perf_counter()
        copied = 0
        try:
            # One request names at most MAX_KEYS chunks: a longer job is read piece by piece, the next
            # piece only while every key so far was there.
            for start in range(0, len(keys), MAX_KEYS):
                piece = [chunk_hash(k, size) for k in keys[start : start + MAX_KEYS]]
                with client.prepare_retrieve(piece) as views:
                    n = min(len(views), len(chunk_ids) - start)
                    copy_all((self._rows[c].reshape(v.shape), v) for v, c in zip(views[:n], chunk_ids[start:]))
                copied += n
                if n < len(piece):
                    break
        except Exception as exc:  # noqa: BLE001 - also a lease that ended before the copy did: those bytes may have changed
            self._resilient.failed(Direction.LOAD, exc, what)
            return copied, copied * self.block_size_bytes  # the pieces read before this one are sound
        log.debug("kvdepot: loaded %d of %d offload chunks (%.1f ms)", copied, len(keys), (time.perf_counter() - t0) * 1e3)
        return copied, copied * self.block_size_bytes


def _fp8_format() -> str:
    """The platform's fp8 encoding, "" where vLLM cannot say (no fp8 there)."""
    try:
        return str(current_platform.fp8_dtype()).removeprefix("torch.")
    except Exception:  # noqa: BLE001 - a platform without fp8
        return ""


def _canonical_format(config) -> str:
    """vLLM's canonical byte format id for this cache layout, "" where this vLLM has none."""
    layout = getattr(config, "kv_cache_layout", None)
    if not layout:
        return ""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id

        return canonical_format_id(getattr(layout, "name", str(layout)))  # an enum member or its name
    except Exception:  # noqa: BLE001 - another vLLM, or a layout it does not name
        return ""
