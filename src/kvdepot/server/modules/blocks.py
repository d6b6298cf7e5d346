"""The server-driven path: a worker registers its paged KV cache once, and the server moves its blocks.

A worker (a vLLM worker on a GPU) sends REGISTER_KV_CACHE with, per layer, where its cache lives (CUDA
IPC handles; or a shared-memory file for a host cache) and how it is laid out. The server opens that
memory once and keeps it until UNREGISTER_KV_CACHE, the context's end or the client's. Then:

- **STORE_BLOCKS**: reserve L1 slots for the chunks L1 lacks, wait on the worker's "blocks written"
  event on the cache's own stream, gather the chunks' blocks into a device staging buffer and copy them
  into the slots (the arena, pinned with ``cudaHostRegister``); answer when the copies are done (the
  worker may reuse the blocks then) and commit.
- **RETRIEVE_BLOCKS**: read-lock the stored run (a session's lookup locks are taken over), copy the slots
  into staging and scatter them into the worker's blocks (never those of the first
  ``skip_first_n_tokens``: the engine's own prefix cache shares them), recording one exported event per
  layer; answer as soon as the copies are queued. The locks end when the copies are done
  (``CopyWatcher``), not before. Past the request's deadline no further piece is queued (the worker
  gave up on the load, and its blocks are no longer the load's to write).

Each registered cache (``RegisteredCache``) moves through::

    OPEN ──unregister / its context gone / its client gone──► CLOSING ──its last copy done──► CLOSED
      └ begin() / end(): copies in flight (refused once CLOSING)      (memory and staging let go)

The stores of one cache run one after another on streams of their own, and so do its retrieves (a
retrieve never queues behind a store: ``DuplexMover``); the arena slots are the L1 leases' (toucher
SERVER: a lease that ends while a copy runs keeps its space until the copy's finish call). Every id
from the wire is checked before a kernel sees it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvdepot.config import BlockTransfer, GpuConfig
from kvdepot.errors import BadRequest, IllegalTransition, KVDepotError, KVDepotTimeout, TransportUnavailable, UnknownKVCache
from kvdepot.gpu import runtime
from kvdepot.gpu.memory import OpenedMemory, event_handle, layer_tensor, new_event, open_event, open_memory
from kvdepot.gpu.mover import BlockMover, Completion, DuplexMover
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.layout import PagedFormat
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.server.modules import ServerContext
from kvdepot.server.modules.common import context_and_keys, count_short_retrieve, lock_for_retrieve, store_protects, touch_after_store
from kvdepot.server.state import Context
from kvdepot.storage.manager import Toucher
from kvdepot.types import ClientId, LeaseId

log = logging.getLogger(__name__)

MAX_CACHES_PER_CLIENT = 64
MAX_OPEN_EVENTS = 256  # a worker's "ready" events this server keeps open per cache (a worker reuses a few)
POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3  # how often pending copies are looked at
# The most a store holds a BLOCKING worker waiting for its copy (its deadline may be sooner): the client's
# default request timeout, past which nobody waits for the reply. Four stores that waited 120 s for a ready
# event that never fires held every worker, and every BLOCKING request of every client waited behind them.
STORE_PATIENCE_S = 10.0


class CacheState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(eq=False)
class RegisteredCache:
    id: int
    owner: ClientId
    context_id: int
    memories: list[OpenedMemory]
    cache: DevicePagedCache
    mover: DuplexMover  # stores and retrieves on streams of their own
    layer_events: list  # CUDA: the events a retrieve records after each layer (exported to the worker)
    label: str  # the transfer path, for metrics: cuda_ipc or host_file
    state: CacheState = CacheState.OPEN
    busy: int = 0
    # A store's copy that outlived its patience (its ready event did not fire): the stores after it
    # would queue on the same stream behind it, so they are refused at once until it ends.
    stalled: Completion | None = None
    _events: OrderedDict = field(default_factory=OrderedDict)  # the worker's exported events, opened
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __repr__(self) -> str:
        return f"RegisteredCache({self.id}, {self.state.value}, busy={self.busy}, {self.mover!r})"

    def begin(self) -> None:
        with self._lock:
            if self.state is not CacheState.OPEN:
                raise UnknownKVCache(f"kv cache {self.id} is {self.state.value}")
            self.busy += 1

    def end(self) -> None:
        with self._lock:
            if self.busy <= 0:
                raise IllegalTransition(f"kv cache {self.id}: end() without begin()")
            self.busy -= 1
            last = self.state is CacheState.CLOSING and self.busy == 0
        if last:
            self._release()

    def close(self) -> None:
        """OPEN -> CLOSING; CLOSED at once when no copy runs, else when the last one ends."""
        with self._lock:
            if self.state is not CacheState.OPEN:
                return
            self.state = CacheState.CLOSING
            idle = self.busy == 0
        if idle:
            self._release()

    def _release(self) -> None:
        with self._lock:
            if self.state is CacheState.CLOSED:
                return
            self.state = CacheState.CLOSED
        self.mover.close()  # the staging buffer, and the views of the worker's layers
        for mem in self.memories:
            mem.close()
        self._events.clear()
        self.layer_events = []
        log.info("kv cache %d of context %d closed", self.id, self.context_id)

    def worker_event(self, handle: bytes):
        """The worker's exported event, opened once (None: nothing to wait for)."""
        if not handle:
            return None
        device = self.memories[0].device_index
        if device is None:
            raise BadRequest("a host-memory cache takes no CUDA events")
        event = self._events.get(handle)
        if event is None:
            try:
                event = open_event(handle, device)
            except Exception as exc:  # a handle that CUDA refuses: that request's problem
                raise BadRequest(f"the worker's CUDA event handle cannot be opened: {exc}") from None
            self._events[handle] = event
            if len(self._events) > MAX_OPEN_EVENTS:
                self._events.popitem(last=False)
        else:
            self._events.move_to_end(handle)
        return event


class CopyWatcher:
    """Runs each callback once its copies are done (one thread, started with the first copy it is handed,
    stopped at close). It polls every pending completion in turn rather than waiting on the oldest, so a
    copy that never ends (a worker whose event never fires) holds only its own locks, never the others'."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Completion, Callable[[], None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def after(self, completion: Completion, then: Callable[[], None]) -> None:
        if completion.done():
            then()
            return
        self._ensure_started()
        self._queue.put((completion, then))

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvdepot-copy-watcher", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        pending: list[tuple[Completion, Callable[[], None]]] = []
        pause = POLL_MIN_S
        stopping = False
        while pending or not stopping:
            try:
                item = self._queue.get(timeout=pause if pending else None)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        pending.append(item)
                        pause = POLL_MIN_S
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            still = []
            for completion, then in pending:
                try:
                    done = completion.done()
                except Exception:  # the device said the copy failed: it is over either way
                    log.exception("kvdepot: a copy to a worker's cache failed on the device")
                    done = True
                if not done:
                    still.append((completion, then))
                    continue
                try:
                    then()
                except Exception:
                    log.exception("kvdepot: finishing a copy failed")
            pause = min(pause * 2, POLL_MAX_S) if len(still) == len(pending) else POLL_MIN_S
            pending = still
            if stopping and pending:
                for completion, _ in pending:
                    completion.wait()  # at close: every copy ends before its memory goes

    def close(self) -> None:
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=30)


class BlockTransferModule:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.storage = ctx.storage
        self.config: GpuConfig = ctx.config.gpu
        self._caches: dict[int, RegisteredCache] = {}
        self._caches_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._watcher = CopyWatcher()
        self._arena = None  # the arena as a torch byte tensor, made at the first registration
        self._pinned: runtime.PinnedRange | None = None
        self._arena_lock = threading.Lock()
        self.devices = runtime.cuda_devices() if self.config.transfer is not BlockTransfer.OFF else {}
        # What REGISTER_CONTEXT tells workers (None: no server-driven path here); fixed for the server's life.
        self.offer: m.BlockTransferOffer | None = None
        if self.config.transfer is not BlockTransfer.OFF and runtime.torch_installed():
            self.offer = m.BlockTransferOffer(devices=sorted(self.devices), host_files=True, shm_dir=ctx.config.storage.shm_dir)
        ctx.contexts_gone.append(self._contexts_gone)
        ctx.block_offer = self.offer

    def snapshot(self) -> dict:
        """``/status`` → ``gpu``: what is offered, the registered caches, whether L1 is pinned."""
        offer = self.offer
        with self._caches_lock:
            caches = [
                {"id": rc.id, "context": rc.context_id, "path": rc.label, "state": rc.state.value, "copies_running": rc.busy,
                 "layers": rc.cache.num_layers, "blocks": rc.cache.num_blocks, "device": f"cuda:{rc.memories[0].device_index}"
                 if rc.memories and rc.memories[0].device_index is not None else "host"}
                for rc in self._caches.values()
            ]  # fmt: skip
        pinned = self._pinned
        return {
            "transfer": self.config.transfer.value,
            "devices": offer.devices if offer else [],
            "host_files": bool(offer and offer.host_files),
            "arena_pinned": bool(pinned and pinned.pinned),
            "caches": caches,
        }

    def handlers(self) -> list[HandlerSpec]:
        R, B = m.RequestType, HandlerMode.BLOCKING
        return [
            HandlerSpec(R.REGISTER_KV_CACHE, self.register, B),
            HandlerSpec(R.UNREGISTER_KV_CACHE, self.unregister, B),
            HandlerSpec(R.STORE_BLOCKS, self.store, B),
            HandlerSpec(R.RETRIEVE_BLOCKS, self.retrieve, B),
        ]

    def close(self) -> None:
        with self._caches_lock:
            caches, self._caches = list(self._caches.values()), {}
        for rc in caches:
            rc.close()
        self._watcher.close()  # every queued finish runs first
        with self._arena_lock:
            if self._pinned is not None:
                self._pinned.close()
                self._pinned = None
            self._arena = None  # storage unmaps the arena after this

    # --- registration -----------------------------------------------------------------------------------

    def register(self, call: Call) -> Reply:
        body: m.RegisterKVCacheRequest = call.body
        context = self.ctx.context_of(body.context_id, call.client)
        if self.offer is None:
            why = "it is turned off (--gpu-transfer off)" if self.config.transfer is BlockTransfer.OFF else f"torch is not installed ({runtime.INSTALL_HINT})"
            raise TransportUnavailable(f"this server has no server-driven path: {why}; use the shm or inline path")
        with self._caches_lock:
            if sum(1 for c in self._caches.values() if c.owner == call.client) >= MAX_CACHES_PER_CLIENT:
                raise BadRequest(f"at most {MAX_CACHES_PER_CLIENT} registered caches per client")
        rc = self._open(context, call.client, body)
        with self._caches_lock:
            try:  # its context may have gone while the memory was opened: then its goodbye missed this cache
                self.ctx.context_of(context.id, call.client)
            except KVDepotError:
                rc.close()
                raise
            self._caches[rc.id] = rc
        log.info("kv cache %d registered for context %d: %r", rc.id, context.id, rc.cache)
        return Reply(m.RegisterKVCacheReply(cache_id=rc.id, num_blocks=rc.cache.num_blocks, layer_events=[event_handle(e) for e in rc.layer_events]))

    def _open(self, context: Context, owner: ClientId, body: m.RegisterKVCacheRequest) -> RegisteredCache:
        lay = context.layout
        if len(body.layers) != lay.num_layers:
            raise BadRequest(f"{len(body.layers)} layers registered; the context's layout has {lay.num_layers}")
        if not body.memories or any(not 0 <= s.memory < len(body.memories) for s in body.layers):
            raise BadRequest("every layer must name one of the registered memories")
        kinds = {type(mem) for mem in body.memories}
        if len(kinds) != 1 or len({s.format for s in body.layers}) != 1:
            raise BadRequest("one cache is all CUDA memory or all host files, in one format")
        if body.block_size <= 0 or context.chunk_size % body.block_size:
            raise BadRequest(f"block_size {body.block_size} does not divide the context's chunk_size {context.chunk_size}")
        try:
            fmt = PagedFormat(body.layers[0].format)
        except ValueError:
            raise BadRequest(f"unknown cache format {body.layers[0].format!r}") from None
        memories: list[OpenedMemory] = []
        try:
            for spec in body.memories:
                memories.append(open_memory(spec, self.devices, self.ctx.config.storage.shm_dir))
            if len({mem.device_index for mem in memories}) != 1:
                raise BadRequest("every layer of one cache must be on one device")
            layers = [layer_tensor(memories[s.memory], s) for s in body.layers]
            try:
                cache = DevicePagedCache(layers, fmt, body.block_size, [s.group for s in body.layers], lay.kv_factor)
            except (ValueError, IndexError) as exc:
                raise BadRequest(f"the registered cache: {exc}") from None
            if (cache.heads, cache.head_dim) != (lay.num_kv_heads, lay.head_dim) or runtime.dtype_name(cache.dtype) != lay.dtype:
                raise BadRequest(
                    f"the cache holds H={cache.heads} D={cache.head_dim} {runtime.dtype_name(cache.dtype)}; the context's layout is "
                    f"H={lay.num_kv_heads} D={lay.head_dim} {lay.dtype}"
                )
            on_gpu = memories[0].device_index is not None
            if on_gpu:
                self._pin_arena()
            mover = DuplexMover(cache, context.chunk_size // body.block_size, self.config.staging_mb << 20)
            events = []
            if on_gpu:
                torch = runtime.require_torch("the server-driven path")
                with torch.cuda.device(memories[0].device_index):
                    events = [new_event() for _ in range(lay.num_layers)]
                    for event in events:
                        event_handle(event)  # torch creates an event at its first use, on the current device: this one
        except BaseException:
            for mem in memories:
                mem.close()
            raise
        return RegisteredCache(next(self._ids), owner, context.id, memories, cache, mover, events, "cuda_ipc" if on_gpu else "host_file")

    def _pin_arena(self) -> None:
        with self._arena_lock:
            if self._pinned is None and self.config.pin_arena:
                arena = self._arena_tensor()
                self._pinned = runtime.pin(arena.data_ptr(), arena.numel())
                log.info("L1 arena (%d MiB) %s for GPU copies", arena.numel() >> 20, "pinned" if self._pinned.pinned else "NOT pinned")

    def _arena_tensor(self):
        if self._arena is None:
            torch = runtime.require_torch("the server-driven path")
            self._arena = torch.from_numpy(self.storage.arena_bytes())
        return self._arena

    def _slots(self, rc: RegisteredCache, offsets: list[int], size: int) -> list:
        arena = self._arena_tensor()
        shape = rc.mover.chunk_shape
        return [arena[o : o + size].view(rc.mover.bits).view(shape) for o in offsets]

    def unregister(self, call: Call) -> Reply:
        body: m.UnregisterKVCacheRequest = call.body
        self.ctx.context_of(body.context_id, call.client)
        with self._caches_lock:
            rc = self._caches.get(body.cache_id)
            if rc is None or rc.owner != call.client:
                raise UnknownKVCache(f"no kv cache {body.cache_id} of this client")
            del self._caches[body.cache_id]
        rc.close()
        return Reply(m.Ack())

    def _contexts_gone(self, contexts: list[Context]) -> None:
        """Their caches close (after any copy in flight); on the loop thread, so nothing here waits."""
        gone = {(c.owner, c.id) for c in contexts}
        with self._caches_lock:
            closing = [rc for rc in self._caches.values() if (rc.owner, rc.context_id) in gone]
            for rc in closing:
                del self._caches[rc.id]
        for rc in closing:
            rc.close()

    def _cache_of(self, call: Call, context: Context) -> RegisteredCache:
        with self._caches_lock:
            rc = self._caches.get(call.body.cache_id)
        if rc is None or rc.owner != call.client or rc.context_id != context.id:
            raise UnknownKVCache(f"no kv cache {call.body.cache_id} of this context (unregistered, or the server restarted): register it again")
        return rc

    def _block_ids(self, rc: RegisteredCache, call: Call, chunks: int) -> list[np.ndarray]:
        try:
            return rc.cache.check_ids(call.body.block_ids, chunks * rc.mover.blocks_per_chunk)
        except (ValueError, IndexError) as exc:
            raise BadRequest(f"block_ids: {exc}") from None

    # --- store ---------------------------------------------------------------------------------------

    def store(self, call: Call) -> Reply:
        body: m.StoreBlocksRequest = call.body
        context, keys = context_and_keys(self.ctx, call)
        rc = self._cache_of(call, context)
        if not 0 <= body.first <= len(keys):
            raise BadRequest(f"first={body.first} is outside the {len(keys)} keys")
        sent = keys[body.first :]
        ids = self._block_ids(rc, call, len(sent))
        protect = store_protects(call, keys, keys[: body.first])
        self.ctx.chunk_tokens(context, sent, body.token_ids)
        size = context.chunk_bytes
        # SERVER: the copy below writes the slots; a lease that ends meanwhile keeps them until abort/commit.
        res = self.storage.reserve(sent, size, call.client, body.cache_salt, protect=protect, toucher=Toucher.SERVER)
        chosen = [i for i, s in enumerate(res.statuses) if s == m.SlotStatus.ALLOCATED]
        if chosen:  # aborts the reservation itself if the copy fails
            self._copy_out(call, rc, ids, chosen, [res.offsets[i] for i in chosen], size, res.lease_id)
        # The turn only once the copy ended: a store refused behind a stalled one, or that timed out
        # waiting for its ready event, stored nothing. Before the commit, so the chain stays protected.
        try:
            touch_after_store(self.ctx, call, keys, res.statuses)
        except BaseException:
            self.ctx.abort_quietly(res.lease_id, call.client)
            raise
        committed = self.storage.commit(res.lease_id, call.client)
        self.ctx.metrics.stored(context.spec.model, committed, committed * size, rc.label)
        self.ctx.chunk_request_done("store", call, context, body.keys, committed)
        return Reply(m.StoreBlocksReply(statuses=[int(s) for s in res.statuses]))

    def _copy_out(self, call: Call, rc: RegisteredCache, ids: list[np.ndarray], chosen: list[int], offsets: list[int], size: int,
                  lease: int) -> None:  # fmt: skip
        """Copy the chosen chunks' blocks into their reserved slots and wait for the copy, within the
        request's deadline. On any failure the reservation is aborted, but never while a copy into its
        slots may still run: past the deadline the abort waits for the copy, and after a save that raised
        part way for the copies it queued (on the watcher, both)."""
        owner = call.client
        try:
            _refuse_behind_stall(rc)
            rc.begin()
        except BaseException:
            self.storage.abort(LeaseId(lease), owner)
            raise

        def abort_late() -> None:
            if rc.stalled is done:
                rc.stalled = None
            self.storage.abort(LeaseId(lease), owner)
            rc.end()

        done: Completion | None = None

        handed_over = started = False
        try:
            bpc = rc.mover.blocks_per_chunk
            picked = [np.concatenate([g[i * bpc : (i + 1) * bpc] for i in chosen]) for g in ids]
            slots, ready = self._slots(rc, offsets, size), rc.worker_event(call.body.ready_event)
            started = True  # from here copies into the slots may be queued
            done = rc.mover.save(picked, slots, ready)
            patience = min(STORE_PATIENCE_S, max(0.0, call.deadline - time.monotonic()))
            if not done.wait(patience):
                handed_over = True
                rc.stalled = done
                self._watcher.after(done, abort_late)
                raise KVDepotTimeout(
                    f"the copy out of the worker's blocks did not end within {patience:.1f} s (does its ready event ever fire?): "
                    f"this store is a miss; its slots are freed once the copy ends"
                )
        except BaseException:
            if not handed_over:
                if started:  # another writer may reuse the slots only once the DMA already queued into them has landed
                    handed_over = True
                    self._after_queued(rc.mover.saver, abort_late)
                else:
                    self.storage.abort(LeaseId(lease), owner)
            raise
        finally:
            if not handed_over:
                rc.end()

    def _after_queued(self, mover: BlockMover, then: Callable[[], None]) -> None:
        """``then`` once every copy ``mover`` has queued so far is done: a call that raised part way may
        have queued some to or from its arena slots, which stay reserved or locked until those end. A
        device that cannot say so has failed, and copies nothing more: ``then`` at once."""
        try:
            settled = mover.settled()
        except Exception:
            log.exception("kvdepot: the device failed while a copy stopped part way")
            then()
            return
        self._watcher.after(settled, then)

    # --- retrieve ------------------------------------------------------------------------------------

    def retrieve(self, call: Call) -> Reply:
        body: m.RetrieveBlocksRequest = call.body
        context, keys = context_and_keys(self.ctx, call)
        rc = self._cache_of(call, context)
        if not 0 <= body.start <= len(keys) or body.limit < 0:
            raise BadRequest(f"start={body.start}, limit={body.limit} do not fit the {len(keys)} keys")
        asked = min(body.limit or len(keys), len(keys) - body.start)
        ids = self._block_ids(rc, call, asked)
        if body.skip_first_n_tokens < 0 or body.skip_first_n_tokens % rc.cache.block_size:
            raise BadRequest(f"skip_first_n_tokens={body.skip_first_n_tokens} is not a whole number of {rc.cache.block_size}-token blocks")
        ready = rc.worker_event(body.ready_event)
        # SERVER: our copy reads the slots until it is done; the locks end only then.
        context, lock = lock_for_retrieve(self.ctx, call, Toucher.SERVER)
        count_short_retrieve(self.ctx, call, len(lock.offsets))
        found = len(lock.offsets)
        owner = call.client

        def release() -> None:
            if lock.lease_id:
                self.ctx.release_quietly(LeaseId(lock.lease_id), owner)

        if not found:
            release()
            if rc.layer_events:  # a waiter is never left with an older copy's events
                rc.mover.load([], ids, 0, rc.layer_events)
            return Reply(m.RetrieveBlocksReply(found=0))
        try:
            rc.begin()
        except BaseException:
            release()
            raise

        def finished() -> None:
            release()
            rc.end()

        try:
            bpc = rc.mover.blocks_per_chunk
            slots = self._slots(rc, lock.offsets, context.chunk_bytes)
            # Past the call's deadline the worker has given up on this load (its blocks are recomputed, or
            # handed to another request): no further piece is written into them.
            done = rc.mover.load(slots, [g[: found * bpc] for g in ids], body.skip_first_n_tokens // rc.cache.block_size,
                                 rc.layer_events or None, ready, call.deadline)  # fmt: skip
        except BaseException:
            self._after_queued(rc.mover.loader, finished)  # the slots are read until the pieces already queued land
            raise

        self._watcher.after(done, finished)
        self.ctx.metrics.retrieved(context.spec.model, found, found * context.chunk_bytes, rc.label)
        self.ctx.chunk_request_done("retrieve", call, context, body.keys, found)
        return Reply(m.RetrieveBlocksReply(found=found))


def _refuse_behind_stall(rc: RegisteredCache) -> None:
    """A store on a cache whose earlier store's copy is stuck (its ready event never fired) would only
    queue behind it on the cache's save stream and hold a BLOCKING worker for its whole patience: it is
    refused at once instead, until that copy ends."""
    stalled = rc.stalled
    if stalled is not None and not stalled.done():
        raise KVDepotTimeout(
            f"an earlier store into kv cache {rc.id} is still waiting for its ready event; stores queue behind it, "
            f"so this one is a miss (refused until that copy ends)"
        )
