"""The worker half: scatter retrieved chunks into vLLM's paged blocks and gather blocks into new chunks.

Transfers follow the metadata the scheduler half built for the step:

- loads: ``prepare_retrieve`` gives read-only views of the chunks (the server's shared-memory arena
  on the shm transport, received frames on the inline one) and each is scattered straight into its
  blocks. Synchronous loads run in ``start_load_kv`` before the forward; with ``layerwise`` a helper
  thread scatters layer by layer and ``wait_for_layer_load`` waits for one layer; asynchronous loads
  run on a loader thread between steps and are reported through ``get_finished``.
- saves: ``prepare_store`` gives writable slots (arena memory on shm: the one copy is the gather)
  for the chunks the server lacks; they are committed when the block ends. With ``async_saves`` (the
  default) ``wait_for_save`` hands them to a saver thread and returns; ``saves.py`` says how no block
  is freed by vLLM before its save has read it.

On a GPU (vLLM's 5-dimensional FlashAttention or FlashInfer caches) the same hooks run the device
paths of ``device.py`` instead: the server copies the blocks itself (``cuda_ipc``), or this worker's
``BlockMover`` does (pinned shm, inline), ordered by events on the engine's stream (``DeviceLoad``).

A chunk that cannot be fetched (evicted, server gone) is never half-used: its blocks are reported as
load errors, and vLLM recomputes them (``kv_load_failure_policy="recompute"``) or fails the request.
A failed save is only a future miss. Only a transport failure (no connection, a timeout) stops the
failing direction (loads or saves) for ``retry_after_s``; a request's own problem (an expired lease, a
chunk gone since its lookup, a full L1) is that request's alone (``connectors.common``).

Leases held while loading are renewed by the client's heartbeat, so a slow load (a loaded machine, a
long layerwise pass) keeps its locks for as long as it runs.

Ownership: the loader threads write only blocks of requests that wait for them (vLLM does not run
them meanwhile) and never blocks below ``skip_blocks`` (vLLM's own prefix-cache blocks, which other
running requests may read).
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import numpy as np

from kvdepot.client.client import KVClient
from kvdepot.connectors.common import Breakers, Direction, FailureTally, ResilientClient
from kvdepot.connectors.vllm.config import ConnectorConfig
from kvdepot.connectors.vllm.copies import ChunkCopier
from kvdepot.connectors.vllm.device import DeviceKV, Ready, device_format
from kvdepot.connectors.vllm.metadata import KVDepotConnectorMetadata, KVDepotWorkerMetadata, LoadOp, SaveOp
from kvdepot.connectors.vllm.paged_layout import PagedKV, choose_format, make_layout, probe_cpu_layout
from kvdepot.connectors.vllm.saves import SaveQueue
from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.gpu.mover import Completion
from kvdepot.types import SlotStatus

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, model: str, block_size: int, cache_dtype: str, kv_rank: int, kv_world: int) -> None:
        self.config = config
        self.model = model
        self.block_size = block_size
        self.chunk_size = config.chunk_tokens(block_size)
        self.blocks_per_chunk = self.chunk_size // block_size
        self.cache_dtype = cache_dtype
        self.kv_rank = kv_rank
        self.kv_world = kv_world
        self._resilient: ResilientClient | None = None
        self.paged: PagedKV | None = None  # vLLM's CPU cache, or
        self.device: DeviceKV | None = None  # its cache on a GPU
        self._layout = None
        self._model_id = model
        self.layer_index: dict[str, int] = {}
        self._lock = threading.Lock()  # guards the three result sets below (loader threads add to them)
        self._load_errors: set[int] = set()
        self._errors_taken: set[int] = set()  # this step's load errors vLLM already took (take_load_errors)
        self._failed_loaded: dict[int, int] = {}  # blocks whose synchronous load failed (any rank) -> step
        self._step = 0
        self._finished_async: set[str] = set()
        self._loaded: dict[str, int] = {}  # synchronous loads done -> their attempt (LoadOp.attempt)
        self._layerwise: LayerwiseLoad | None = None
        self._device_layerwise: DeviceLayerwiseLoad | None = None
        self._async_queue: queue.Queue[tuple[LoadOp, Ready | None] | None] | None = None
        self._async_thread: threading.Thread | None = None
        self.breakers = Breakers(config.retry_after_s)
        self.tally = FailureTally(log, f"kvdepot worker {kv_rank}")
        self._to_dump: list[LoadOp] = []  # debug_dump_dir: this step's loads, dumped after the forward
        self._saves: SaveQueue | None = SaveQueue(config.async_save_limit) if config.async_saves else None
        self._save_gate: LayerGate | None = None  # layerwise saves: this step's, until wait_for_save
        self._copier = ChunkCopier(config.copy_threads)  # synchronous loads' copies into the blocks

    def __repr__(self) -> str:
        return f"WorkerSide(rank={self.kv_rank}/{self.kv_world}, {self.paged or self.device!r}, {self._copier!r}, client={self.client!r})"

    # --- set-up --------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        names = _layer_order(kv_caches)
        first = kv_caches[names[0]]
        if first.dim() == 5:  # a GPU attention backend's layout (FlashAttention, FlashInfer)
            self._register_device(names, kv_caches)
            return
        if first.device.type != "cpu":
            raise NotImplementedError(f"unsupported KV cache shape {tuple(first.shape)} on {first.device} (MLA's latent cache is not supported)")
        if first.dim() != 4:
            raise NotImplementedError(f"unsupported KV cache shape {tuple(first.shape)} (MLA and fused layouts are not supported)")
        _, heads, block_size, fused = first.shape
        if block_size != self.block_size:
            raise NotImplementedError(f"kernel block size {block_size} differs from the scheduler's {self.block_size}")
        head_size = fused // 2
        fmt = choose_format(probe_cpu_layout(str(first.dtype), block_size, head_size, self.cache_dtype), self.config.cpu_kv_layout)
        self.paged = PagedKV([kv_caches[n] for n in names], block_size, head_size, fmt)
        self.layer_index = {n: i for i, n in enumerate(names)}
        self._layout = make_layout(len(names), heads, head_size, first.dtype)
        self._model_id = self.model + fmt.model_suffix
        self._start_client()

    def _register_device(self, names: list[str], kv_caches: dict) -> None:
        """vLLM on a GPU: per-token layouts, so chunks are the shared layout under the plain model id."""
        layers = [kv_caches[n] for n in names]
        first = layers[0]
        fmt = device_format(first.shape, self.block_size)
        self.device = DeviceKV(layers, fmt, self.block_size, self.blocks_per_chunk, self.config.transport,
                               self.config.staging_mb << 20, self.config.pin_arena)  # fmt: skip
        self.layer_index = {n: i for i, n in enumerate(names)}
        self._layout = make_layout(len(names), self.device.cache.heads, self.device.cache.head_dim, first.dtype)
        self._model_id = self.model
        self._start_client()
        client = self.client
        if client is not None:  # decide the path now, so the log says it at start (else at the first transfer)
            try:
                self.device.server_path(client)
            except KVDepotError as exc:
                log.warning("kvdepot worker: %s; every load and save is a miss until that changes", exc)

    def _start_client(self) -> None:
        self._resilient = ResilientClient(
            self.config,
            self._model_id,
            self._layout,
            self.chunk_size,
            rank=self.kv_rank,
            world_size=self.kv_world,
            breakers=self.breakers,
            tally=self.tally,
        )
        self._connect()
        log.info("kvdepot worker: %r", self)

    def _connect(self) -> KVClient | None:
        """The client, connected on first need; None while connecting is switched off after a failed
        attempt (the engine runs uncached meanwhile rather than not at all)."""
        return self._resilient.connected() if self._resilient is not None else None

    def shutdown(self) -> None:
        if self._saves is not None:
            self._saves.close(timeout=30.0)
        if self._async_queue is not None:
            self._async_queue.put(None)
            if self._async_thread is not None:
                self._async_thread.join(timeout=10)
        if self._layerwise is not None:
            self._layerwise.join()
        if self._resilient is not None:
            self._resilient.close()
        if self.device is not None:
            self.device.unpin()  # after the client: its arena mapping is still ours until then
        self._copier.close()

    @property
    def model_id(self) -> str:
        """The model part of this worker's keys: ``model_name`` plus its chunk format's suffix."""
        return self._model_id

    @property
    def client(self) -> KVClient | None:
        return self._resilient.client if self._resilient is not None else None

    # --- loads ---------------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVDepotConnectorMetadata) -> None:
        self._step += 1
        with self._lock:
            self._errors_taken = set()
        if self.device is not None:
            self._device_start_load(meta)
            return
        self._stage_layerwise_saves(meta)  # (a step with synchronous loads: before the forward)
        sync_ops: list[LoadOp] = []
        for op in meta.loads:
            if op.is_async:
                self._submit_async(op)
            else:
                sync_ops.append(op)
        if not sync_ops:
            return
        if self.config.layerwise and self.paged is not None and self.paged.num_layers > 1:
            self._layerwise = LayerwiseLoad(self, sync_ops)
            self._layerwise.start()
            return
        for op in sync_ops:
            self.load(op, parallel=True)
        with self._lock:
            self._loaded.update((op.req_id, op.attempt) for op in sync_ops)
        if self.config.debug_dump_dir:
            self._to_dump.extend(sync_ops)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._layerwise or self._device_layerwise
        if job is not None:
            index = self.layer_index.get(layer_name)
            if index is not None:
                job.wait(index)

    def load(self, op: LoadOp, parallel: bool = False, ready: Ready | None = None) -> None:
        """Scatter the chunks of ``op`` into their blocks; blocks left unwritten become load errors.
        ``parallel``: the engine waits for this load (``start_load_kv``), so the copies run on the
        copier's threads; an asynchronous load runs beside the forward and keeps to one. Logged at INFO
        with its time: the server's answer (views of the chunks) and the copy into the blocks, apart.
        ``ready``: on a device, the engine's stream marked when the load was asked for."""
        if self.device is not None:  # (an asynchronous load: this thread waits for the copies, then it is reported)
            self._device_load(op, ready=ready).finish(engine_waits=False)
            return
        t0 = time.perf_counter()
        with self.retrieve(op) as views:
            t1 = time.perf_counter()
            if parallel:
                self._copier.each(len(views), lambda i: self._scatter(op, i, views[i]))
            else:
                for i, view in enumerate(views):
                    self._scatter(op, i, view)
            copied = sum(view.nbytes for view in views)
            t2 = time.perf_counter()
        if views:
            log.info("kvdepot: %s loaded %d chunks (%.1f MiB) in %.1f ms: retrieve %.1f ms, copy into blocks %.1f ms",
                     op.req_id, len(views), copied / 2**20, (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3)  # fmt: skip

    @contextmanager
    def retrieve(self, op: LoadOp, client: KVClient | None = None) -> Iterator[list[np.ndarray]]:
        """The views of the op's chunks (a prefix of them: what the server still has). Chunks not
        given are reported as errors at once, before the views are used: a layer-by-layer load ends
        only in ``wait_for_save``, which vLLM calls after ``get_block_ids_with_load_errors`` when it
        defers it past the drafter (speculative decoding), and that step's token must not be kept.
        Chunks whose block failed to end are reported then. (A shm block's release goes behind and
        cannot fail it: the server keeps a live reader's pins, so what was read is sound.)"""
        stack = ExitStack()
        found = 0
        reported = len(op.hashes)  # chunks from here on are reported missing already
        try:
            views: list[np.ndarray] = []
            if client is None and self._resilient is not None:
                client = self._resilient.get(Direction.LOAD)
            if client is not None:
                try:
                    views = stack.enter_context(client.prepare_retrieve(op.hashes, op.cache_salt))
                except KVDepotError as exc:
                    self._failed(Direction.LOAD, exc, f"the load for {op.req_id}")
            found = len(views)
            if found < reported:
                self._report_missing(op, found)
                reported = found
            if self.config.debug_load_delay_s:
                time.sleep(self.config.debug_load_delay_s)  # (its lease is renewed meanwhile)
            yield views
        finally:
            try:
                stack.close()
            except KVDepotError as exc:  # the block's end failed: its bytes are not trusted
                self._failed(Direction.LOAD, exc, f"the load for {op.req_id}")
                found = 0
            if found < reported:
                self._report_missing(op, found)

    def _scatter(self, op: LoadOp, i: int, view: np.ndarray, layer: int | None = None) -> None:
        assert self.paged is not None
        bpc = self.blocks_per_chunk
        self.paged.scatter(view, op.block_ids[i * bpc : (i + 1) * bpc], op.skip_blocks if i == 0 else 0, layer)

    def _failed(self, direction: Direction, exc: Exception, what: str) -> None:
        """Count it; a transport failure also stops this direction for ``retry_after_s``."""
        assert self._resilient is not None
        self._resilient.failed(direction, exc, what)

    def _report_missing(self, op: LoadOp, found: int) -> None:
        first_block = max(found * self.blocks_per_chunk, op.skip_blocks)
        missing = op.block_ids[first_block:]
        log.info("kvdepot: %s got %d of %d chunks; %d blocks to recompute", op.req_id, found, len(op.hashes), len(missing))
        with self._lock:
            self._load_errors.update(missing)

    def _submit_async(self, op: LoadOp) -> None:
        if self._async_queue is None:
            self._async_queue = queue.Queue()
            self._async_thread = threading.Thread(target=self._async_loop, name="kvdepot-async-load", daemon=True)
            self._async_thread.start()
        # "After the engine's work so far" is marked here, on the engine's thread and stream: the load
        # thread's own current stream is another one (on another device, for ranks past the first).
        self._async_queue.put((op, self.device.ready() if self.device is not None else None))

    def _async_loop(self) -> None:
        assert self._async_queue is not None
        while (item := self._async_queue.get()) is not None:
            op, ready = item
            try:
                self.load(op, ready=ready)
            except Exception:  # never leave the request waiting forever
                log.exception("kvdepot: async load for %s failed", op.req_id)
                with self._lock:
                    self._load_errors.update(op.block_ids[op.skip_blocks :])
            with self._lock:  # after its errors, so both reach the scheduler in the same step
                self._finished_async.add(op.req_id)

    # --- saves ---------------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVDepotConnectorMetadata) -> None:
        # vLLM calls this in a ``finally`` after the forward: an exception on its way out means the
        # forward raised, and the blocks this step wrote may be half written.
        forward_failed = sys.exc_info()[0] is not None
        device_job, self._device_layerwise = self._device_layerwise, None
        if device_job is not None:
            self._settle_layerwise(device_job, device_job.finish)
        if self.device is not None:
            self._device_saves(meta, self._unsafe_saves(meta, forward_failed))
            return
        job, self._layerwise = self._layerwise, None
        if job is not None:
            self._settle_layerwise(job, job.join)
            if self.config.debug_dump_dir:
                self._to_dump.extend(job.ops)
        if self._to_dump:
            self._dump_loaded()
        unsafe = self._unsafe_saves(meta, forward_failed)
        gate, self._save_gate = self._save_gate, None
        if gate is not None:
            if unsafe:  # one job reads the whole step's blocks: it goes whole, or not at all
                gate.abandon()
            else:
                gate.open_all()  # the forward is done: every layer's KV is in place (hooks or not)
        elif self._saves is None:
            for op in meta.saves:
                if op.req_id not in unsafe:
                    self.save(op)
        else:
            for op in meta.saves:
                if op.req_id in unsafe:
                    self._saves.submit([op.req_id], _nothing)  # still reported once run: vLLM frees its blocks then
                else:
                    self._submit_save([op], None)

    def _settle_layerwise(self, job, end: Callable[[], None]) -> None:
        """The step's layer-by-layer load is over: its requests are reported loaded. A load that fails to
        end cleanly leaves its blocks as load errors (vLLM recomputes them) rather than raise here: every
        rank must reach the saves' verdict below, which is collective over the TP group."""
        try:
            end()
        except Exception:
            log.exception("kvdepot: a layer-by-layer load did not end cleanly; its blocks are recomputed")
            with self._lock:
                for op in job.ops:
                    self._load_errors.update(op.block_ids[op.skip_blocks :])
        with self._lock:
            self._loaded.update((op.req_id, op.attempt) for op in job.ops)

    def _unsafe_saves(self, meta: KVDepotConnectorMetadata, forward_failed: bool) -> set[str]:
        """The requests whose saves of this step must not be committed (a future miss, never a wrong
        hit): every one when the forward raised; else each whose chunks were computed over a block that
        a synchronous load of this step or the last one failed to write, on any rank. The forward still
        ran over that block, so what it computed after it is wrong; vLLM recomputes it once it reads the
        load errors, but a save would have kept it. That covers the request's own load, another request
        sharing the block (vLLM's prefix cache hands out a loading request's blocks), the step after
        (async scheduling plans it before the errors are known), and the other TP ranks (their layers
        past the first mixed the bad heads in through the all-reduce)."""
        failed = self._record_failed_loads(meta)  # every rank, every step with sync loads: a collective
        if not meta.saves:
            return set()
        if forward_failed:
            unsafe = {op.req_id for op in meta.saves}
            why = "the forward raised"
        else:
            unsafe = {op.req_id for op in meta.saves if failed and not failed.keys().isdisjoint(op.over_loaded_blocks)}
            # (and, whatever the scheduler named, a request whose own load of this step failed here)
            unsafe |= {op.req_id for op in meta.loads if not op.is_async and not failed.keys().isdisjoint(op.block_ids[op.skip_blocks :])}
            unsafe &= {op.req_id for op in meta.saves}
            why = "the KV they hold was computed over blocks whose load failed"
        if unsafe:
            log.warning("kvdepot: not saving this step's KV of %s: %s (a future miss, never a wrong hit)", ", ".join(sorted(unsafe)), why)
        return unsafe

    def _record_failed_loads(self, meta: KVDepotConnectorMetadata) -> dict[int, int]:
        """Blocks of this step's synchronous loads that failed on any rank join those of the last step;
        older ones are dropped (the scheduler names only the last two steps' loads in a save)."""
        sync_ops = [op for op in meta.loads if not op.is_async]
        if sync_ops:
            with self._lock:
                errors = self._load_errors | self._errors_taken
            failed = [not errors.isdisjoint(op.block_ids[op.skip_blocks :]) for op in sync_ops]
            if self.kv_world > 1:
                failed = self._any_rank(failed)
            for op, bad in zip(sync_ops, failed):
                if bad:
                    self._failed_loaded.update(dict.fromkeys(op.block_ids[op.skip_blocks :], self._step))
        if self._failed_loaded:
            self._failed_loaded = {b: n for b, n in self._failed_loaded.items() if n >= self._step - 1}
        return self._failed_loaded

    def _any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the tensor-parallel group (every rank runs the same loads in the same
        order, from the same metadata). Replaced in tests; without torch.distributed, this rank's own."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return flags
        from vllm.distributed.parallel_state import get_tp_group

        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return [bool(v) for v in t.tolist()]

    def save_kv_layer(self, layer_name: str, meta: KVDepotConnectorMetadata | None = None) -> None:
        """Layer ``layer_name`` of this step is written: its part of the step's saves may go. ``meta``:
        the step's, bound by vLLM; the first layer's call hands the step's saves over if start_load_kv
        has not (vLLM calls it after the forward in a step without synchronous loads)."""
        gate = self._save_gate if meta is None else self._stage_layerwise_saves(meta)
        if gate is not None:
            index = self.layer_index.get(layer_name)
            if index is not None:
                gate.open(index)

    def _stage_layerwise_saves(self, meta: KVDepotConnectorMetadata) -> LayerGate | None:
        """With ``layerwise_saves``: the step's saves, handed to the saver once, at the first of
        start_load_kv (before the forward only in a step with synchronous loads) and the first
        save_kv_layer, so layer N is copied while layer N+1 computes whatever the step loads. The saver
        gathers each layer once its gate opens; ``wait_for_save`` ends the step's gate."""
        if self._save_gate is None and meta.saves and self.config.layerwise_saves and self._saves is not None and self.paged is not None:
            self._save_gate = LayerGate(self.paged.num_layers)
            self._submit_save(meta.saves, self._save_gate)
        return self._save_gate

    def _submit_save(self, ops: Sequence[SaveOp], gate: LayerGate | None) -> None:
        assert self._saves is not None
        waited = self._saves.submit([op.req_id for op in ops], partial(self._save_ops, ops, gate))
        if waited > 0.001:
            log.info("kvdepot: %s waited %.1f ms for room among %d queued saves (async_save_limit)",
                     ",".join(op.req_id for op in ops), waited * 1e3, self.config.async_save_limit)  # fmt: skip

    def handle_preemptions(self, meta: KVDepotConnectorMetadata) -> None:
        """Before a step that may reuse preempted requests' blocks: let every save read its blocks."""
        if meta.preempted and self._saves is not None:
            self._saves.drain()
            self._saves.forget(meta.preempted)  # vLLM freed their blocks: no report is owed for those saves

    def take_finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose saves have all run (vLLM may free their blocks now)."""
        return self._saves.finished(finished_req_ids) if self._saves is not None else set()

    def save(self, op: SaveOp) -> None:
        """One save, whole (synchronous saves run it in the step; async ones on the saver thread)."""
        if self.device is not None:
            self._device_save_ops([op], self.device.ready())
            return
        self._save_ops([op], None)

    def _save_ops(self, ops: Sequence[SaveOp], gate: LayerGate | None) -> None:
        """Gather the blocks of ``ops`` into the slots the server gives, all layers at once, or with a
        ``gate`` layer by layer as each is written. A slot is committed only whole: a failure drops
        the op's slots. Logged at INFO with its time: the server's answer (slots), the gather out of
        the blocks (with a gate: until the last layer was written and copied) and the commit, apart."""
        assert self.paged is not None
        client = self._resilient.get(Direction.SAVE) if self._resilient is not None else None
        if client is None:
            return  # the server failed us a moment ago: do not stall every step on it
        if self.config.debug_save_delay_s:
            time.sleep(self.config.debug_save_delay_s)
        bpc = self.blocks_per_chunk
        names = ",".join(op.req_id for op in ops)
        t0 = time.perf_counter()
        t1 = t2 = t0
        copied = saved = 0
        opened: list[tuple[SaveOp, list]] = []
        try:
            with ExitStack() as stack:
                for op in ops:
                    opened.append((op, stack.enter_context(client.prepare_store(op.hashes, op.cache_salt, token_ids=op.token_ids))))
                t1 = time.perf_counter()
                for layer in range(self.paged.num_layers) if gate is not None else (None,):
                    if gate is not None:
                        gate.wait(layer)
                    for op, slots in opened:
                        for i, slot in enumerate(slots):
                            if slot is not None:
                                self.paged.gather(op.block_ids[i * bpc : (i + 1) * bpc], slot, layer)
                if gate is not None:
                    gate.wait_done()
                for op, slots in opened:
                    for i, slot in enumerate(slots):
                        if slot is not None:
                            copied += slot.nbytes
                            saved += 1
                            if self.config.debug_dump_dir:
                                self._dump("saved", op.hashes[i], slot)
                t2 = time.perf_counter()
        except KVDepotError as exc:
            self._failed(Direction.SAVE, exc, f"the save for {names} (a future miss)")
            return
        except SaveAbandoned:
            return  # its slots were dropped on the way out (said when it was abandoned)
        if copied:
            t3 = time.perf_counter()
            log.info("kvdepot: %s saved %d chunks (%.1f MiB) in %.1f ms: slots %.1f ms, copy out of blocks %.1f ms, commit %.1f ms",
                     names, saved, copied / 2**20, (t3 - t0) * 1e3, (t1 - t0) * 1e3,
                     (t2 - t1) * 1e3, (t3 - t2) * 1e3)  # fmt: skip
        for op, slots in opened:
            self._tally_refused(op, slots.statuses)

    def _tally_refused(self, op: SaveOp, statuses: Sequence[SlotStatus]) -> None:
        refused = [s for s in statuses if s in (SlotStatus.NO_SPACE, SlotStatus.OVER_QUOTA)]
        if refused:  # L1 full of locked objects, or the tenant's quota: a future miss, nothing more
            code = ErrorCode.NO_SPACE if refused[0] is SlotStatus.NO_SPACE else ErrorCode.BAD_REQUEST
            error = KVDepotError(f"{len(refused)} of {len(statuses)} chunks {refused[0].name}", code)
            self.tally.add(Direction.SAVE, error, f"the save for {op.req_id}")

    # --- the device paths (vLLM on a GPU: connectors/vllm/device.py) ----------------------------------

    def _device_start_load(self, meta: KVDepotConnectorMetadata) -> None:
        sync_ops = [op for op in meta.loads if not op.is_async]
        for op in meta.loads:
            if op.is_async:
                self._submit_async(op)
        if not sync_ops:
            return
        layer_events = self.device.layer_events() if self.config.layerwise and self.device.num_layers > 1 else None
        loads = [self._device_load(op, layer_events) for op in sync_ops]
        if self.config.debug_dump_dir:
            self._to_dump.extend(sync_ops)
        if layer_events is not None:  # each layer's kernels wait for its copies; released after the forward
            self._device_layerwise = DeviceLayerwiseLoad(self.device, sync_ops, loads, layer_events)
            return
        for load in loads:
            load.finish(engine_waits=True)
        with self._lock:
            self._loaded.update((op.req_id, op.attempt) for op in sync_ops)

    def _device_load(self, op: LoadOp, layer_events: list | None = None, ready: Ready | None = None) -> DeviceLoad:
        """Start ``op``'s copies into its blocks (after the engine's stream's work so far, or after
        ``ready``, marked earlier on the engine's thread); the returned load's ``finish`` ends it.
        Chunks not found become load errors (vLLM recomputes them)."""
        assert self.device is not None
        event, handle = ready if ready is not None else self.device.ready()
        client = self._resilient.get(Direction.LOAD) if self._resilient is not None else None
        load = DeviceLoad(self, op)
        if client is None:
            return load.missing(0)
        t0 = time.perf_counter()
        try:
            server = self.device.server_path(client)
            if server is not None:
                found, copies = server.retrieve_copies(op.hashes, [op.block_ids], op.cache_salt, skip_first_n_tokens=op.skip_blocks * self.block_size,
                                                       ready_event=handle)  # fmt: skip
                if self.config.debug_load_delay_s:
                    time.sleep(self.config.debug_load_delay_s)
                load.by_server(copies, found, t0)  # waits on this retrieve's events, whatever registers meanwhile
                return load
        except KVDepotError as exc:
            self._failed(Direction.LOAD, exc, f"the load for {op.req_id}")
            return load.missing(0)
        self.device.host_path(client)
        # (the client admitted above: see retrieve) reports what it lacks when the stack closes
        views = load.stack.enter_context(self.retrieve(op, client))
        if views:
            try:
                ids = self.device.ids(op.block_ids, range(len(views)))
                load.by_mover(self.device.mover.load(views, ids, op.skip_blocks, layer_events, ready=event), sum(v.nbytes for v in views), t0)
            except Exception:  # never half a load: its blocks are recomputed
                log.exception("kvdepot: the copies of %s's load into its blocks failed", op.req_id)
                load.missing(0)
        return load

    def _device_saves(self, meta: KVDepotConnectorMetadata, unsafe: set[str]) -> None:
        """After the forward: mark the blocks written, and hand the step's saves over (or run them),
        but for those of ``unsafe`` requests (see ``_unsafe_saves``)."""
        if self._to_dump:
            self._dump_loaded()
        if not meta.saves:
            return
        ready = self.device.ready()
        for op in meta.saves:
            if op.req_id in unsafe:
                if self._saves is not None:
                    self._saves.submit([op.req_id], _nothing)  # still reported once run: vLLM frees its blocks then
            elif self._saves is None:
                self._device_save_ops([op], ready)
            else:
                self._saves.submit([op.req_id], partial(self._device_save_ops, [op], ready))

    def _device_save_ops(self, ops: Sequence[SaveOp], ready: Ready) -> None:
        """Copy each op's new chunks out of its blocks once ``ready`` (recorded after the forward) has
        passed: by the server (cuda_ipc) or by the mover into arena slots / staging. Returns once the
        blocks were read (vLLM may free them then)."""
        assert self.device is not None
        client = self._resilient.get(Direction.SAVE) if self._resilient is not None else None
        if client is None:
            return
        if self.config.debug_save_delay_s:
            time.sleep(self.config.debug_save_delay_s)
        event, handle = ready
        for op in ops:
            t0 = time.perf_counter()
            try:
                server = self.device.server_path(client)
                if server is not None:
                    statuses = server.store(op.hashes, [op.block_ids], op.cache_salt, ready_event=handle, token_ids=op.token_ids)
                else:
                    self.device.host_path(client)
                    with client.prepare_store(op.hashes, op.cache_salt, token_ids=op.token_ids) as slots:
                        chosen = [i for i, slot in enumerate(slots) if slot is not None]
                        if chosen:
                            self.device.mover.save(self.device.ids(op.block_ids, chosen), [slots[i] for i in chosen], ready=event).wait()
                    statuses = slots.statuses
            except KVDepotError as exc:
                self._failed(Direction.SAVE, exc, f"the save for {op.req_id} (a future miss)")
                continue
            saved = sum(1 for st in statuses if st is SlotStatus.ALLOCATED)
            if saved:
                mib = saved * self._layout.chunk_bytes(self.chunk_size) / 2**20
                log.info("kvdepot: %s saved %d chunks (%.1f MiB) in %.1f ms (%s)", op.req_id, saved, mib, (time.perf_counter() - t0) * 1e3,
                         self.device.path)  # fmt: skip
            self._tally_refused(op, statuses)

    def _dump_loaded(self) -> None:
        """debug_dump_dir: what this step's loads left in vLLM's paged cache, read back after the forward,
        for tests that compare it with what was stored (``saved/``). Chunks a load did not bring (its
        blocks are recomputed) are not dumped."""
        assert (self.paged is not None or self.device is not None) and self._layout is not None
        ops, self._to_dump = self._to_dump, []
        with self._lock:
            failed = set(self._load_errors)
        bpc = self.blocks_per_chunk
        for op in ops:
            for i, h in enumerate(op.hashes):
                blocks = op.block_ids[i * bpc : (i + 1) * bpc]
                if len(blocks) < bpc or failed.intersection(blocks[op.skip_blocks if i == 0 else 0 :]):
                    break
                chunk = self._layout.empty(self.chunk_size)
                if self.device is not None:
                    self.device.mover.save(self.device.ids(blocks), [chunk]).wait()
                else:
                    self.paged.gather(blocks, chunk)
                self._dump("loaded", h, chunk)

    def _dump(self, kind: str, chunk_hash: bytes, chunk: np.ndarray) -> None:
        folder = os.path.join(self.config.debug_dump_dir, kind)
        os.makedirs(folder, exist_ok=True)
        np.save(os.path.join(folder, f"{chunk_hash.hex()}.npy"), chunk)

    # --- reports -------------------------------------------------------------------------------------

    def take_finished_async(self) -> set[str]:
        with self._lock:
            done, self._finished_async = self._finished_async, set()
        return done

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            self._errors_taken |= errors  # (vLLM may ask before wait_for_save: the saves still need them)
        return errors

    def take_worker_meta(self) -> KVDepotWorkerMetadata | None:
        with self._lock:
            loaded, self._loaded = self._loaded, {}
        return KVDepotWorkerMetadata(loaded) if loaded else None


class LayerwiseLoad:
    """Scatter a step's synchronous loads one layer at a time on a helper thread; attention of layer
    N waits for ``events[N]`` only. Every event is set when the thread ends, whatever happened, so a
    waiter never hangs (a failure shows as load errors)."""

    def __init__(self, worker: WorkerSide, ops: list[LoadOp]) -> None:
        assert worker.paged is not None
        self.worker = worker
        self.ops = ops
        self.events = [threading.Event() for _ in range(worker.paged.num_layers)]
        self._thread = threading.Thread(target=self._run, name="kvdepot-layerwise-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait(self, layer: int) -> None:
        self.events[layer].wait()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        try:
            with ExitStack() as stack:
                t0 = time.perf_counter()
                fetched = [(op, stack.enter_context(self.worker.retrieve(op))) for op in self.ops]
                t1 = time.perf_counter()
                for layer, event in enumerate(self.events):
                    for op, views in fetched:
                        for i, view in enumerate(views):
                            self.worker._scatter(op, i, view, layer)
                    event.set()
                t2 = time.perf_counter()
                chunks = sum(len(views) for _, views in fetched)
                if chunks:  # as load() logs it; the copy ran beside the forward, layer by layer
                    who = self.ops[0].req_id if len(self.ops) == 1 else f"a step of {len(self.ops)} requests"
                    mib = sum(v.nbytes for _, views in fetched for v in views) / 2**20
                    log.info("kvdepot: %s loaded %d chunks (%.1f MiB) in %.1f ms: retrieve %.1f ms, copy into blocks %.1f ms (layer by layer)",
                             who, chunks, mib, (t2 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3)  # fmt: skip
        except Exception:
            log.exception("kvdepot: layerwise load failed")
            with self.worker._lock:
                for op in self.ops:
                    self.worker._load_errors.update(op.block_ids[op.skip_blocks :])
        finally:
            for event in self.events:
                event.set()


class DeviceLoad:
    """One op's load on the device paths, from its start to ``finish``: the server's copies (cuda_ipc) or
    the mover's, the views of the chunks it copies from (held until its copies are done), and the blocks
    it could not bring (load errors)."""

    def __init__(self, worker: WorkerSide, op: LoadOp) -> None:
        self.worker = worker
        self.op = op
        self.stack = ExitStack()
        self.server = None
        self.completion: Completion | None = None
        self._t0 = 0.0
        self._bytes = 0

    def missing(self, found: int) -> DeviceLoad:
        if found < len(self.op.hashes):
            self.worker._report_missing(self.op, found)
        return self

    def by_server(self, server, found: int, t0: float) -> None:
        self.server, self._t0 = server, t0
        self.missing(found)
        if found:
            log.info("kvdepot: %s: the server copies %d chunks into its blocks (%s)", self.op.req_id, found, server.kind)

    def by_mover(self, completion: Completion, nbytes: int, t0: float) -> None:
        self.completion, self._bytes, self._t0 = completion, nbytes, t0

    def wait_layer(self, layer: int, layer_events: list) -> None:
        """The engine's stream waits for this load's copies into ``layer``."""
        if self.server is not None:
            self.server.wait_layer(layer)
        elif self.completion is not None and layer_events:
            self.worker.device.wait_on_engine_stream(Completion(layer_events[layer]))

    def finish(self, engine_waits: bool) -> None:
        """End the load: ``engine_waits``: the engine's stream waits for the copies (a load in the step);
        else this thread waits for them (an asynchronous load, reported done after). Views are released
        once the copies are done."""
        try:
            if self.server is not None:
                if engine_waits:
                    self.server.wait_all()
                else:
                    self.server.synchronize()
            elif self.completion is not None:
                self.completion.wait()  # the views go back to the server only after the copies read them
                if self._bytes:
                    log.info("kvdepot: %s loaded %.1f MiB in %.1f ms (%s)", self.op.req_id, self._bytes / 2**20,
                             (time.perf_counter() - self._t0) * 1e3, self.worker.device.path)  # fmt: skip
        finally:
            self.stack.close()


class DeviceLayerwiseLoad:
    """A step's synchronous loads on the device paths, layer by layer: attention of layer N waits (on the
    engine's stream, not the host) for the copies into layer N only; the views are released after the
    forward (``finish``, from ``wait_for_save``)."""

    def __init__(self, device, ops: list[LoadOp], loads: list[DeviceLoad], layer_events: list) -> None:
        self.device = device
        self.ops = ops
        self.loads = loads
        self.layer_events = layer_events

    def wait(self, layer: int) -> None:
        for load in self.loads:
            load.wait_layer(layer, self.layer_events)

    def finish(self) -> None:
        for load in self.loads:
            load.finish(engine_waits=True)


def _nothing() -> None:
    """A save job that reads no block (its request's save was dropped; it is still reported)."""


class SaveAbandoned(Exception):
    """A step's layerwise save must not be committed (see ``WorkerSide._unsafe_saves``)."""


class LayerGate:
    """One step's layerwise saves: layer N opens when ``save_kv_layer`` says its KV is written, and
    every layer when the forward is done (``wait_for_save``), or the whole step is abandoned (its forward
    raised, or a load it depended on failed). A step that never ends gives up after ``WAIT_S``. Either
    way the save's slots are dropped, never committed half-written or wrong."""

    WAIT_S = 300.0

    def __init__(self, num_layers: int) -> None:
        self._events = [threading.Event() for _ in range(num_layers)]
        self._done = threading.Event()  # wait_for_save's verdict: every layer written, or abandoned
        self._abandoned = False

    def open(self, layer: int) -> None:
        self._events[layer].set()

    def open_all(self) -> None:
        for event in self._events:
            event.set()
        self._done.set()

    def abandon(self) -> None:
        self._abandoned = True  # before the events: a waiter that wakes sees it
        self.open_all()

    def wait(self, layer: int) -> None:
        self._wait(self._events[layer], f"layer {layer} of a layerwise save was not written")

    def wait_done(self) -> None:
        """Before the commit: the last layer's hook comes before the step's end, and only the end
        says whether the step's KV may be kept."""
        self._wait(self._done, "the step of a layerwise save did not end")

    def _wait(self, event: threading.Event, what: str) -> None:
        if not event.wait(self.WAIT_S):
            raise TimeoutError(f"{what} within {self.WAIT_S:.0f} s")
        if self._abandoned:
            raise SaveAbandoned("its step was abandoned")


def _layer_order(kv_caches: dict) -> list[str]:
    """Layer names in model order (the order chunks store layers in), each KV cache once. A layer that
    reuses an earlier layer's KV cache (cross-layer KV sharing: Gemma 3n, Gemma 4) comes as that
    layer's tensor again, and vLLM leaves it out of the KV-cache groups the scheduler half counts its
    layers from: counted here too, the two halves' layouts (part of every key) differed, so every
    lookup missed and every save stored the shared layers twice. Its own calls (``wait_for_layer_load``,
    ``save_kv_layer``) name no layer of ours and do nothing: its target's did the work."""
    names = list(kv_caches)
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(names, key=extract_layer_index)
    except Exception:
        pass
    first_of: dict[tuple, str] = {}  # (address, shape, dtype) -> the first layer that has that cache
    for name in names:
        t = kv_caches[name]
        first_of.setdefault((t.data_ptr(), tuple(t.shape), t.dtype), name)
    return list(first_of.values())
