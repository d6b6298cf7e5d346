"""The scheduler half: which prompt prefixes kvdepot holds, and what each step loads and saves.

One ``RequestState`` per live request (``request_state.py`` draws and enforces its two state machines:
the request's ``Phase`` and the ``Locks`` the server holds for it), driven by vLLM's scheduler hooks. A
load is planned once, handed to the workers by the next ``build_connector_meta``, and its locks are
released when the workers report it done. Saves are planned every step for the chunks that the step
completes. ``request_finished`` ends the session, which drops whatever locks are left. A lease that
ended anyway (TTL: only if this process stopped renewing, or a revocation) makes the load find fewer
chunks; vLLM recomputes them (kv_load_failure_policy=recompute), nothing else.

Failures are classified (``connectors.common``): a transport failure (no connection, a timeout) stops
lookups for ``retry_after_s``; anything else (an expired lease, a chunk evicted since the lookup) is
that request's miss only, counted in the log.

TP > 1: every KV rank stores its own shard under its own context, so the scheduler keeps one client
per rank and a hit is the shortest prefix that all ranks hold.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvdepot.client.client import KVClient
from kvdepot.client.options import Transport
from kvdepot.connectors.common import Breakers, Direction, FailureTally, ResilientClient, is_transport_failure
from kvdepot.connectors.vllm.adapters import AdapterRoots
from kvdepot.connectors.vllm.config import ConnectorConfig
from kvdepot.connectors.vllm.embeds import embeds_extras
from kvdepot.connectors.vllm.hash_cache import ChunkHashCache
from kvdepot.connectors.vllm.hints import PrefillRate, agent_session, source_hint
from kvdepot.connectors.vllm.media import first_offset, media_extras
from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata, KVDepotWorkerMetadata, LoadOp, SaveOp
from kvdepot.connectors.vllm.request_state import Locks, Phase, RequestState
from kvdepot.errors import KVDepotError
from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.layout import KVLayout
from kvdepot.types import ChunkHash

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0


class ClientPool:
    """One client per KV rank (``ResilientClient``s sharing one breaker and one tally): created on
    first use, and switched off for ``retry_after_s`` after a transport failure (the server may still
    hold locks for us meanwhile; their TTL ends them)."""

    def __init__(self, config: ConnectorConfig, model: str, layout: KVLayout, world_size: int, chunk_size: int, sessions) -> None:
        self.breakers = Breakers(config.retry_after_s)
        self.tally = FailureTally(log, "kvdepot scheduler")
        self.ranks = [
            ResilientClient(
                config,
                model,
                layout,
                chunk_size,
                rank=rank,
                world_size=world_size,
                transport=Transport.INLINE,  # the scheduler moves no KV: no need to map the arena
                connect_timeout_s=CONNECT_TIMEOUT_S,
                breakers=self.breakers,
                tally=self.tally,
                prefault=False,
                tune_malloc=False,
            )
            for rank in range(world_size)
        ]
        self._sessions = sessions  # () -> the session ids this scheduler still holds
        self._logged = False

    def get(self) -> list[KVClient] | None:
        """Every rank's client, or None while lookups (or connecting) are switched off."""
        if not self.breakers.admit(Direction.LOOKUP):
            return None
        clients = []
        for r in self.ranks:
            client = r.connected()
            if client is None:
                return None
            client.renew_sessions = self._sessions  # its heartbeat renews the locks of held requests
            clients.append(client)
        if not self._logged:
            self._logged = True
            log.info("kvdepot scheduler: %d context(s) on %s, chunk_size %d", len(clients), self.ranks[0].settings.url, self.ranks[0].chunk_size)
        return clients

    def hash_algorithm(self) -> HashAlgorithm | None:
        """The server's hash algorithm (learnt when connecting), or None while not connected. Asks no
        breaker: hashing calls nobody, so it must not spend the one call that a switched-off direction
        lets through to probe the server (``get``), or the probe never reaches it and lookups stay off."""
        client = self.ranks[0].connected()
        return client.hash_algorithm if client is not None else None

    def failed(self, exc: Exception, what: str) -> None:
        """Count the failure; a transport failure also stops lookups for ``retry_after_s``."""
        self.ranks[0].failed(Direction.LOOKUP, exc, what)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        model: str,
        layout: KVLayout,
        block_size: int,
        world_size: int = 1,
        hash_cache: ChunkHashCache | None = None,
    ) -> None:
        self.config = config
        self.hash_cache = hash_cache  # vLLM's prefix hashes -> ours (hash_cache.py); None: always hash
        self.block_size = block_size
        self.chunk_size = config.chunk_tokens(block_size)
        self.blocks_per_chunk = self.chunk_size // block_size
        self._open_sessions: set[str] = set()  # requests whose session (and locks) the server keeps
        self._open_lock = threading.Lock()  # the clients' heartbeat threads read the set
        self.pool = ClientPool(config, model, layout, world_size, self.chunk_size, self._held_sessions)
        self.states: dict[str, RequestState] = {}
        self.prefill_rate = PrefillRate()
        self.adapters = AdapterRoots()  # each LoRA adapter's chain root (adapters.py)
        self._readmitted: set[str] = set()  # preempted and admitted again within this schedule (see _state)
        # Blocks that synchronous loads of this schedule and the last one write -> the schedule's number. A
        # save computed over one must wait for the workers' verdict on that load (SaveOp.over_loaded_blocks):
        # with async scheduling the next step is planned before this one's load errors are known.
        self._schedule = 0
        self._sync_loaded: dict[int, int] = {}
        self._attempts = itertools.count(1)  # LoadOp.attempt: the workers' reports name the load they ran

    def __repr__(self) -> str:
        return f"SchedulerSide(chunk_size={self.chunk_size}, requests={len(self.states)}, {self.hash_cache!r})"

    # --- vLLM hooks ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if not st.eligible or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False  # (vLLM reads no cache for it: prompt logprobs, for one)
        if st.load_failed:
            # vLLM re-queues a request whose asynchronous load failed and asks again: claiming the same
            # hit would load (and fail) again, step after step, while the lookup keeps answering.
            return 0, False
        # vLLM must compute at least one prompt token itself, so the last token is never claimed.
        max_chunks = max(0, request.num_tokens - 1) // self.chunk_size
        if max_chunks * self.chunk_size <= num_computed_tokens:
            return 0, False
        if st.phase is Phase.NEW:
            self._start_lookup(st, max_chunks)
        elif st.phase is Phase.LOOKING:
            self._poll_lookup(st)
        if st.phase is Phase.LOOKING:
            return None, False  # the server is bringing chunks in from L2: vLLM asks again next step
        hit_tokens = min(st.hit_chunks, max_chunks) * self.chunk_size
        need = max(0, hit_tokens - num_computed_tokens)
        return need, need > 0 and self.config.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self.states.get(request.request_id)
        if st is None:
            return
        groups = blocks.get_block_ids()
        st.block_ids = list(groups[0]) if groups else []
        if st.phase is Phase.ADMITTED:
            return  # the second call of an async load, once the rest of the prompt gets blocks
        if st.phase is Phase.LOOKING:
            # Admitted before its L2 lookup answered (vLLM's own prefix cache came to cover what we
            # could give, or it reads no cache for this request): the lookup is dropped, nothing loads.
            self._end_session(st)
            st.looked(0)
        st.admit()
        hit = st.hit_chunks
        st.stored_chunks = hit
        if st.looked_at:
            self._log_hit(st, num_external_tokens)
        if num_external_tokens <= 0:
            self._free_locks(st)  # vLLM holds (or computes) all of it
            return
        start = hit * self.chunk_size - num_external_tokens
        first = start // self.chunk_size
        skip = start // self.block_size - first * self.blocks_per_chunk
        bpc = self.blocks_per_chunk
        if start < 0 or start % self.block_size or len(st.block_ids) < hit * bpc:
            raise RuntimeError(f"kvdepot: cannot place a load of {num_external_tokens} tokens: {st!r}")
        st.plan_load(
            LoadOp(
                req_id=st.req_id,
                hashes=list(st.hashes[first:hit]),
                cache_salt=st.salt,
                block_ids=st.block_ids[first * bpc : hit * bpc],
                skip_blocks=skip,
                is_async=self.config.load_async,
                attempt=next(self._attempts),
            )
        )
        if first > 0:
            self._free_locks(st, 0, first)  # chunks vLLM found in its own prefix cache

    def build_connector_meta(self, so: SchedulerOutput) -> KVDepotConnectorMetadata:
        self.prefill_rate.step(int(getattr(so, "total_num_scheduled_tokens", 0) or 0))
        meta = KVDepotConnectorMetadata()
        readmitted, self._readmitted = self._readmitted, set()
        for req_id in sorted(set(so.preempted_req_ids or ()) | readmitted):
            meta.preempted.append(req_id)  # the workers let their saves read its blocks first
            st = self.states.get(req_id)
            if st is not None and req_id not in readmitted:  # (those were handled as they came back)
                self._preempted(st)
        self._schedule += 1
        if self._sync_loaded:
            self._sync_loaded = {b: n for b, n in self._sync_loaded.items() if n >= self._schedule - 1}
        for st in self.states.values():
            if st.locks is Locks.PLANNED:
                op = st.hand_to_workers()
                meta.loads.append(op)
                if not op.is_async:  # an async load's request computes nothing before its verdict is in
                    self._sync_loaded.update(dict.fromkeys(op.block_ids[op.skip_blocks :], self._schedule))
        block_state = so.kv_connector_block_state
        for new in so.scheduled_new_reqs:
            st = self.states.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0]) if new.block_ids else st.block_ids
            self._plan_save(st, new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0), block_state, meta)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.states.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._plan_save(st, cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0), block_state, meta)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        done = self._loads_done(output)
        invalid = output.invalid_block_ids or set()
        failed = output.failed_recving or set()
        if invalid:
            # An asynchronous load's failed blocks may come in any step up to the one reporting it done
            # (the loader thread can add them after one step's get_finished and its done before the next).
            for st in self.states.values():
                op = st.in_flight
                if op is not None and op.is_async and not invalid.isdisjoint(op.block_ids[op.skip_blocks :]):
                    st.load_failed = True
        for st in done:
            op = st.in_flight
            assert op is not None
            if st.req_id in failed or not invalid.isdisjoint(op.block_ids[op.skip_blocks :]):
                st.load_failed = True
            if st.load_failed:
                log.info("kvdepot: the load for %s failed; it is served uncached", st.req_id)
            st.loaded()
            self._free_locks(st)  # the workers hold their own locks while they read

    def _loads_done(self, output: KVConnectorOutput) -> list[RequestState]:
        """The requests whose load in flight this output reports done. A synchronous load is reported
        with its attempt (worker metadata): one of an earlier admission (the request was preempted and
        admitted again before the step that ran it was reported) is ignored, so it cannot free the new
        load's locks. An asynchronous load is reported by vLLM's finished_recving, without one; but
        vLLM preempts only running requests, never one waiting for its load, so it is the one in flight."""
        done: dict[str, RequestState] = {}
        for req_id in output.finished_recving or ():
            st = self.states.get(req_id)
            op = st.in_flight if st is not None else None
            if st is not None and op is not None and op.is_async and st.is_loading(op.attempt):
                done[req_id] = st
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVDepotWorkerMetadata):
            for req_id, attempt in meta.loaded.items():
                st = self.states.get(req_id)
                if st is not None and st.is_loading(attempt):
                    done[req_id] = st
        return list(done.values())

    def request_finished(self, request: Request, block_ids: list[int] | None = None) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the blocks vLLM still holds for the request (None: not known)."""
        st = self.states.pop(request.request_id, None)
        if st is None:
            return False, None
        # An asynchronous load may still write its blocks (it was aborted while waiting for them): vLLM
        # frees them when the workers report the load done (finished_recving). Asynchronous saves may
        # still read them: the workers report it in get_finished once every one has run (saves.py).
        # Never both: a request waiting for its load has computed nothing since its admission.
        loading = st.locks is Locks.LOADING and self.config.load_async
        # vLLM holds no blocks of it: preempted between schedules (reset_prefix_cache) and aborted before
        # build_connector_meta said so. The workers drain and forget its saves when that preemption
        # reaches them, so none is reported: waiting for one would keep the request in vLLM for good.
        # (Told by vLLM's preemption count, not by an empty ``block_ids``: vLLM passes the blocks of the
        # computed tokens only, and a synchronous load whose first block failed leaves a request that
        # still holds all its blocks with none computed; the workers do report that one.)
        if hasattr(request, "num_preemptions"):
            preempted_unseen = request.num_preemptions > st.preemptions
        else:  # a vLLM without the count: the blocks it still holds are all there is to go by
            preempted_unseen = block_ids is not None and not block_ids
        saving = self.config.async_saves and st.saves_planned > 0 and not preempted_unseen
        self._end_session(st)
        return loading or saving, None

    def shutdown(self) -> None:
        for st in list(self.states.values()):
            self._end_session(st)
        self.states.clear()
        self.pool.close()

    # --- lookups -------------------------------------------------------------------------------------

    def _state(self, request: Request) -> RequestState:
        st = self.states.get(request.request_id)
        if st is None or st.request is not request:
            params = getattr(request, "kv_transfer_params", None)
            root = self._root(request)
            st = RequestState(request.request_id, request, request.cache_salt or "", root is not None,
                              source_hint(params), agent_session(params), root=root or b"",
                              preemptions=getattr(request, "num_preemptions", 0))  # fmt: skip
            self.states[request.request_id] = st
        elif st.phase is Phase.ADMITTED:
            # Admitted again before build_connector_meta told us of its preemption (vLLM preempted and
            # re-admitted it within one schedule): handled here, once; the workers still hear of it.
            self._preempted(st)
            self._readmitted.add(st.req_id)
        return st

    def _root(self, request: Request) -> bytes | None:
        """Where the request's hash chain starts: b"" for the base model, its adapter's root for a LoRA
        request (``adapters.py``); None: an adapter kvdepot cannot name, served uncached."""
        lora = getattr(request, "lora_request", None)
        return b"" if lora is None else self.adapters.root(lora)

    def _hashes(self, st: RequestState, n_chunks: int) -> list[ChunkHash]:
        """The first ``n_chunks`` chained hashes, extending the cached chain as tokens arrive."""
        if not self._media_still_named(st):
            return []
        if len(st.hashes) >= n_chunks:
            return st.hashes[:n_chunks]
        algorithm = self.pool.hash_algorithm()  # (not get(): see hash_algorithm)
        if algorithm is None:
            return st.hashes
        cache = self.hash_cache
        seen = st.request.block_hashes if cache is not None else ()
        if cache is not None:
            cache.use(algorithm)  # a server restarted with another algorithm: nothing cached holds
            known = cache.known(seen, len(st.hashes), n_chunks, st.root)  # a prefix this engine saw before: not hashed again
            st.hashes.extend(known[len(st.hashes) :])
        have = len(st.hashes)
        if have < n_chunks:
            cs = self.chunk_size
            tokens = st.request.all_token_ids[have * cs : n_chunks * cs]
            prefix = st.hashes[-1] if st.hashes else st.root
            extras = self._extras(st.request, have, n_chunks)
            st.hashes.extend(chunk_hashes(tokens, cs, algorithm, prefix, extras))  # (a list: no numpy detour)
            if cache is not None:
                cache.put(seen, have, st.hashes, st.root)
        return st.hashes[:n_chunks]

    def _media_still_named(self, st: RequestState) -> bool:
        """False (and the request served uncached from now on) when media joined the request at places
        whose chunks were hashed already: a streaming-input session appends them after its tokens, so
        this is a check, not a case vLLM makes."""
        features = getattr(st.request, "mm_features", None) or ()
        if len(features) > st.media_seen:
            offset = first_offset(features, st.media_seen)
            st.media_seen = len(features)
            if offset is not None and offset < len(st.hashes) * self.chunk_size:
                st.eligible = False
                log.warning("kvdepot: request %s gained media inside chunks already hashed; it is served uncached from now on", st.req_id)
        return st.eligible

    def _extras(self, request: Request, first: int, end: int) -> list[bytes] | None:
        """What chunks ``[first, end)`` hold besides tokens: media items (``media.py``) and prompt
        embeddings (``embeds.py``); None for neither (the plain chain)."""
        media = getattr(request, "mm_features", None)
        extras = media_extras(media, first, end, self.chunk_size) if media else None
        embeds = getattr(request, "prompt_embeds", None)
        if embeds is not None:
            rows = embeds_extras(embeds, getattr(request, "prompt_is_token_ids", None), first, end, self.chunk_size)
            if rows is not None:
                extras = rows if extras is None else [a + b for a, b in zip(extras, rows)]
        return extras

    def _start_lookup(self, st: RequestState, max_chunks: int) -> None:
        clients = self.pool.get()
        hashes = self._hashes(st, max_chunks) if clients else []
        if not clients or len(hashes) < max_chunks:
            st.looked(0)
            return
        st.looked_at = time.monotonic()
        self._open_session(st)
        try:
            rate = self.prefill_rate.tokens_per_s
            replies = [
                c.lookup_reply(hashes, st.salt, session_id=st.req_id, source_hint=st.source_hint, prefill_tokens_per_s=rate,
                               agent_session=st.agent_session)  # fmt: skip
                for c in clients
            ]
            st.rank_hits, st.rank_in_l1 = [r.hits for r in replies], [r.in_l1 for r in replies]
        except KVDepotError as exc:
            self._lookup_failed(st, exc)
            return
        if any(h is None for h in st.rank_hits):
            st.begin_lookup()
        else:
            self._lookup_done(st, clients)

    def _poll_lookup(self, st: RequestState) -> None:
        clients = self.pool.get()
        if clients is None:
            self._lookup_failed(st, None)
            return
        try:
            for rank, hits in enumerate(st.rank_hits):
                if hits is None:
                    reply = clients[rank].session(st.req_id).answer()
                    st.rank_hits[rank], st.rank_in_l1[rank] = reply.hits, reply.in_l1
        except KVDepotError as exc:
            self._lookup_failed(st, exc)
            return
        if any(h is None for h in st.rank_hits):
            if time.monotonic() - st.looked_at > self.config.prefetch_timeout_s:
                log.warning("kvdepot: the L2 prefetch for %s took over %.1fs; serving it uncached", st.req_id, self.config.prefetch_timeout_s)
                self._end_session(st)
                st.looked(0)
            return
        self._lookup_done(st, clients)

    def _lookup_done(self, st: RequestState, clients: list[KVClient]) -> None:
        st.looked(min(st.rank_hits))  # type: ignore[type-var]
        if st.hit_chunks < max(st.rank_hits):  # type: ignore[type-var]
            # Ranks that hold more than all of them do: unlock the surplus.
            for rank, hits in enumerate(st.rank_hits):
                if hits and hits > st.hit_chunks:
                    self._call(clients[rank].free_lookup_locks, st.req_id, st.hit_chunks, -1)

    def _log_hit(self, st: RequestState, loading: int) -> None:
        """One line per looked-up request: what it asked, what kvdepot had (in L1, or brought in from
        L2), and how much of it this engine loads (vLLM's own prefix cache may have had the rest)."""
        cs = self.chunk_size
        asked = (max(0, st.request.num_tokens - 1) // cs) * cs
        found = st.hit_chunks * cs
        in_l1 = min(min(st.rank_in_l1, default=0), st.hit_chunks) * cs
        log.info(
            "kvdepot: request %s: %d of its %d cacheable tokens found (%d in L1, %d from L2), %d loaded, %d from vLLM's own cache",
            st.req_id, found, asked, in_l1, found - in_l1, loading, max(0, found - loading) if loading else found,
        )

    def _lookup_failed(self, st: RequestState, exc: Exception | None) -> None:
        """This request is served uncached. Its session (if the server kept one) ends with its TTL, or
        with END_SESSION when the request finishes."""
        if exc is not None:
            self.pool.failed(exc, f"the lookup of {st.req_id}")
        st.looked(0)
        if exc is not None and not is_transport_failure(exc):
            self._end_session(st)  # the server is there: end whatever it keeps for the request now
        else:
            self._close_session(st)  # unreachable: the session's TTL ends it

    # --- saves ---------------------------------------------------------------------------------------

    def _plan_save(self, st: RequestState, done_tokens: int, block_state, meta: KVDepotConnectorMetadata) -> None:
        """Save the chunks whose KV is complete once this step has run."""
        if not st.eligible:
            return
        request = st.request
        known = request.num_tokens if self.config.save_decode else request.num_prompt_tokens
        full = min(done_tokens, known) // self.chunk_size
        if full <= st.stored_chunks:
            return
        if block_state is not None:
            ids = block_state.get_block_ids(st.req_id)
            if ids is not None and ids:
                st.block_ids = list(ids[0])
        bpc = self.blocks_per_chunk
        full = min(full, len(st.block_ids) // bpc)
        hashes = self._hashes(st, full)
        full = min(full, len(hashes))
        if full <= st.stored_chunks:
            return
        first = st.stored_chunks
        cs = self.chunk_size
        # Chunks whose keys name more than tokens (an adapter, media, embeddings) go to KV events without
        # tokens: the events name none of that, and a router that hashes tokens itself would index them
        # as the plain prompt's.
        plain = not st.root and not getattr(request, "mm_features", None) and getattr(request, "prompt_embeds", None) is None
        tokens = list(request.all_token_ids[first * cs : full * cs]) if self.config.kv_events_token_ids and plain else []
        loaded = self._sync_loaded
        over = [b for b in st.block_ids[: full * bpc] if b in loaded] if loaded else []
        meta.saves.append(SaveOp(st.req_id, list(hashes[first:full]), st.salt, st.block_ids[first * bpc : full * bpc], tokens, over))
        st.stored_chunks = full
        st.saves_planned += 1

    # --- locks and sessions --------------------------------------------------------------------------

    def _preempted(self, st: RequestState) -> None:
        """vLLM freed the request's blocks; on re-admission it is looked up afresh. Its saves so far were
        drained by the workers before the blocks could be reused, so none is owed a report any more."""
        self._end_session(st)
        st.saves_planned = 0
        st.preemptions = getattr(st.request, "num_preemptions", st.preemptions)
        if st.phase is not Phase.NEW:
            st.preempt()

    def _free_locks(self, st: RequestState, start: int = 0, end: int = -1) -> None:
        if st.locks is Locks.NONE:
            return
        clients = self.pool.get()
        for c in clients or ():
            self._call(c.free_lookup_locks, st.req_id, start, end)

    def _end_session(self, st: RequestState) -> None:
        if st.locks is Locks.NONE:
            return
        self._close_session(st)
        for c in self.pool.get() or ():
            self._call(c.end_session, st.req_id)

    def _open_session(self, st: RequestState) -> None:
        st.open_session()
        with self._open_lock:
            self._open_sessions.add(st.req_id)

    def _close_session(self, st: RequestState) -> None:
        """Stop renewing the request's locks (they end now, or with their TTL)."""
        if st.locks is Locks.NONE:
            return
        st.close_session()
        with self._open_lock:
            self._open_sessions.discard(st.req_id)

    def _held_sessions(self) -> list[str]:
        """For the clients' heartbeat threads: the requests whose locks are still wanted."""
        with self._open_lock:
            return list(self._open_sessions)

    def _call(self, fn, *args) -> None:
        try:
            fn(*args)
        except KVDepotError as exc:
            self.pool.failed(exc, fn.__name__)  # what the server still holds for us ends with its TTL
