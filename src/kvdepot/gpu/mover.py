"""Moving chunks between a paged cache on a device and host memory (L1 arena slots, or received frames),
through a staging buffer on the device, on two streams of the mover's own: one for the gathers and
scatters (kernels), one for the copies to and from host memory (the copy engine), so the two overlap::

    save:  kernels: [wait: the blocks are written] -> gather piece 0 -> gather piece 1 -> ...
           copies:                                    └─► copy piece 0 to its slots └─► copy piece 1 ...
    load:  copies:  copy piece 0 into staging -> copy piece 1 -> ...
           kernels: [wait: the blocks may be written] └─► scatter piece 0 └─► scatter piece 1 ...
                    (the last piece layer by layer, recording each layer's event after it)

A piece is a few chunks (at least ``PIECE_BYTES`` per kernel it launches: two for a cache in one
allocation, one per layer for a cache whose layers were allocated apart, as vLLM's are, unless those
are replayed as one CUDA graph a piece, ``kvdepot.gpu.graphs``, which launches two); pieces
take turns in the staging buffer's slots, and a slot is written again only after the stream that read
it is past that read (an event each way). The copy of piece k runs while piece k+1 is gathered (or
piece k is scattered while piece k+1 arrives), so a transfer costs the copy-engine time plus one
piece's kernels, not the sum of both, as the CUDA IPC design has it (two copies per chunk: the GPU
gather, then one DMA to or from pinned host memory). A ``Completion`` says when the copies are done:
the caller keeps the host slots (and the leases on them) until then. On a CPU device there are no
streams and no staging: blocks are gathered straight into the host slot and scattered straight out of
it, and the completion is done at once.

One mover serves one thread at a time per call (a lock covers each call's enqueueing: a save's gathers
and its copies out of staging must not interleave with a load's copies into it). A call that raises part
way may have queued some of its copies: ``settled`` says when everything queued so far is done, and the
caller keeps the host slots until then. A load given a ``deadline`` stops before the first piece that
would start past it (the caller's caller gave up on it: its blocks are no longer the load's to write).
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Sequence

import numpy as np

from kvdepot.errors import KVDepotTimeout
from kvdepot.gpu.graphs import PieceGraphs, graphs_enabled
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.gpu.runtime import require_torch

DEFAULT_STAGING_BYTES = 256 << 20
PIECE_BYTES = 4 << 20  # the least a piece moves per kernel it launches: below that, launches cost more than they overlap


class Completion:
    """The end of a batch of copies: an event on the mover's stream, or already done (CPU)."""

    __slots__ = ("event",)

    def __init__(self, event=None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done (True), or until ``timeout_s`` passed (False; CUDA has no timed wait, so the
        event is polled, from 20 µs apart up to 100 µs apart: a copy of tens of MiB takes milliseconds,
        and a coarser poll would add a tenth to it)."""
        if self.event is None:
            return True
        if timeout_s is None:
            self.event.synchronize()
            return True
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self.event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 100e-6)
        return True


class Lane:
    """The stream a mover's copies run on (CUDA), or nothing at all (CPU: copies are synchronous)."""

    def __init__(self, device) -> None:
        self.torch = torch = require_torch("moving a paged KV cache")
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"Lane({self.device})"

    def wait(self, event) -> None:
        if event is not None and self.stream is not None:
            self.stream.wait_event(event)

    def record(self, event=None):
        """Record ``event`` (a new one if None) here, after everything queued so far; None on CPU."""
        if self.stream is None:
            return None
        event = event if event is not None else self.torch.cuda.Event()
        event.record(self.stream)
        return event


def host_tensor(chunk, dtype):
    """A host chunk (numpy array over the arena or a frame, or a CPU tensor) as a CPU tensor of ``dtype``'s
    width, sharing its memory."""
    torch = require_torch("moving a paged KV cache")
    if isinstance(chunk, np.ndarray):
        with warnings.catch_warnings():  # read-only views (a retrieve's): torch only reads them
            warnings.simplefilter("ignore", UserWarning)
            chunk = torch.from_numpy(chunk)
    return chunk.view(dtype)


class BlockMover:
    """``graphs``: replay a cache of layers allocated apart as CUDA graphs (``kvdepot.gpu.graphs``); None:
    the environment's word (on unless ``KVDEPOT_CUDA_GRAPHS=0``)."""

    def __init__(self, cache: DevicePagedCache, blocks_per_chunk: int, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 graphs: bool | None = None) -> None:  # fmt: skip
        self.cache = cache
        self.torch = require_torch("moving a paged KV cache")
        self.blocks_per_chunk = blocks_per_chunk
        self.lane = Lane(cache.device)  # gathers and scatters
        self.copies = Lane(cache.device)  # copies to and from host memory
        self.bits = cache.views[0].dtype
        self.chunk_shape = cache.chunk_shape(1, blocks_per_chunk)[1:]
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * cache.views[0].element_size()
        self.per_batch = max(1, staging_bytes // self.chunk_bytes)
        self._staging = None  # allocated at the first copy (device memory is the engine's, mostly)
        self._lock = threading.Lock()
        # One launch a piece for a cache of layers apart (one kernel per layer otherwise): made with the staging.
        self._want_graphs = (graphs if graphs is not None else graphs_enabled()) and cache.kernels > 2
        self.graphs: PieceGraphs | None = None

    def __repr__(self) -> str:
        return f"BlockMover({self.cache!r}, {self.per_batch} chunks of staging, {self.lane!r})"

    @property
    def on_device(self) -> bool:
        return self.lane.stream is not None

    def close(self) -> None:
        """Let go of the staging buffer and the cache (after the last copy: the caller knows when)."""
        self._staging = None
        if self.graphs is not None:
            self.graphs.close()
        self.cache.close()

    def _staging_buffer(self):
        """``per_batch`` chunks of device memory, made at the first copy and kept (used on both streams:
        never freed while a copy may run, so the allocator's per-stream reuse never sees it early).

        Allocated on the mover's own kernel stream: the caching allocator hands a stream memory that
        ops on that stream freed. Made on the caller's stream (the engine's), it could be memory the
        engine freed while kernels still queued there use it, and the mover's streams, which do not
        wait for the engine's, would write it under them."""
        if self._staging is None:
            with self.torch.cuda.stream(self.lane.stream):
                self._staging = self.torch.empty((self.per_batch, *self.chunk_shape), dtype=self.bits, device=self.cache.device)
            if self._want_graphs and self.on_device:
                self.graphs = PieceGraphs(self.cache, self._staging, self.blocks_per_chunk)
        return self._staging

    def _chunk_ids(self, block_ids: Sequence, i: int, j: int) -> list:
        bpc = self.blocks_per_chunk
        return [ids[i * bpc : j * bpc] for ids in block_ids]

    def _pieces(self, n: int) -> list[tuple[int, int, int]]:
        """``(first chunk, end, staging slot)`` of each piece of ``n`` chunks. A piece moves at least
        ``PIECE_BYTES`` per kernel: a cache of separate layer allocations launches one per layer per
        piece, so its pieces are that many times larger (fewer, with less of the copy overlapped), unless
        its pieces are replayed as graphs (two launches a piece: the ids' copy and the graph)."""
        least = PIECE_BYTES * (2 if self.graphs is not None and self.graphs.on else self.cache.kernels)
        per_piece = min(max(1, self.per_batch // 2), max(1, -(-least // self.chunk_bytes)))  # two slots at least: overlap
        slots = self.per_batch // per_piece
        return [(i, min(i + per_piece, n), (k % slots) * per_piece) for k, i in enumerate(range(0, n, per_piece))]

    def _event(self, stream):
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def settled(self) -> Completion:
        """When everything queued on this mover's streams so far is done (done at once on a CPU, whose
        copies are synchronous): after a call that raised part way, its host slots are read or written
        until then."""
        if not self.on_device:
            return Completion()
        with self._lock:
            self.lane.stream.wait_event(self._event(self.copies.stream))
            return Completion(self.lane.record())

    def _fence(self) -> None:
        """Both streams wait for everything either queued before: one call's staging slots are never
        written while an earlier call's copies or kernels still use them (calls are ordered as on one
        stream; only the pieces inside a call overlap)."""
        kernels, copies = self.lane.stream, self.copies.stream
        after_copies, after_kernels = self._event(copies), self._event(kernels)
        kernels.wait_event(after_copies)
        copies.wait_event(after_kernels)

    def save(self, block_ids: Sequence[np.ndarray], slots: Sequence, ready=None) -> Completion:
        """Copy chunk ``i``'s blocks (``block_ids[g][i*bpc:(i+1)*bpc]`` per group, checked by the caller
        with ``cache.check_ids``) into ``slots[i]`` (host memory, ``[K, L, T, H, D]``), after ``ready``."""
        hosts = [host_tensor(s, self.bits) for s in slots]
        with self._lock:
            if not self.on_device:
                for i, host in enumerate(hosts):
                    self.cache.gather(self._chunk_ids(block_ids, i, i + 1), host[None])
                return Completion()
            torch, kernels, copies = self.torch, self.lane.stream, self.copies.stream
            staging = self._staging_buffer()
            freed: dict[int, object] = {}  # staging slot -> the copy stream is past reading it
            self._fence()
            self.lane.wait(ready)
            with torch.cuda.stream(kernels):
                block_ids = [self.cache.device_ids(ids) for ids in block_ids]
            for i, j, at in self._pieces(len(hosts)):
                piece = staging[at : at + j - i]
                with torch.cuda.stream(kernels):
                    if at in freed:
                        kernels.wait_event(freed[at])
                    ids = self._chunk_ids(block_ids, i, j)
                    if self.graphs is None or not self.graphs.gather(at, j - i, ids):
                        self.cache.gather(ids, piece)
                    gathered = self._event(kernels)
                with torch.cuda.stream(copies):
                    copies.wait_event(gathered)
                    for c in range(i, j):
                        hosts[c].copy_(piece[c - i], non_blocking=True)
                    freed[at] = self._event(copies)
            if not hosts:
                return Completion(self.lane.record())
            return Completion(self.copies.record())

    def load(self, slots: Sequence, block_ids: Sequence[np.ndarray], skip_blocks: int = 0, layer_events: Sequence | None = None,
             ready=None, deadline: float = math.inf) -> Completion:  # fmt: skip
        """Copy ``slots[i]`` into chunk ``i``'s blocks, leaving the first ``skip_blocks`` blocks alone,
        after ``ready``. ``layer_events[l]`` (CUDA) is recorded once layer ``l`` of every chunk is written.
        Past ``deadline`` (monotonic) no further piece starts: KVDepotTimeout, once ``layer_events`` are
        recorded after what was queued (a waiter on them never waits for copies that will not come);
        ``settled`` says when the pieces already queued are done."""
        hosts = [host_tensor(s, self.bits) for s in slots]
        with self._lock:
            if not self.on_device:
                for i, host in enumerate(hosts):
                    self._check_deadline(deadline, i, len(hosts))
                    self.cache.scatter(host[None], self._chunk_ids(block_ids, i, i + 1), skip_blocks - i * self.blocks_per_chunk)
                return Completion()
            torch, kernels, copies = self.torch, self.lane.stream, self.copies.stream
            staging = self._staging_buffer()
            freed: dict[int, object] = {}  # staging slot -> the kernels are past reading it
            pieces = self._pieces(len(hosts))
            self._fence()
            self.lane.wait(ready)
            with torch.cuda.stream(kernels):  # before any data copy is queued (see DevicePagedCache.device_ids)
                block_ids = [self.cache.device_ids(ids) for ids in block_ids]
            for i, j, at in pieces:
                if time.monotonic() > deadline:
                    for event in layer_events or ():
                        self.lane.record(event)
                    self._check_deadline(deadline, i, len(hosts))
                piece = staging[at : at + j - i]
                with torch.cuda.stream(copies):
                    if at in freed:
                        copies.wait_event(freed[at])
                    for c in range(i, j):
                        piece[c - i].copy_(hosts[c], non_blocking=True)
                    arrived = self._event(copies)
                with torch.cuda.stream(kernels):
                    kernels.wait_event(arrived)
                    ids, skip = self._chunk_ids(block_ids, i, j), skip_blocks - i * self.blocks_per_chunk
                    if layer_events is None or i != pieces[-1][0]:
                        if skip > 0 or self.graphs is None or not self.graphs.scatter(at, j - i, ids):
                            self.cache.scatter(piece, ids, skip)
                    else:  # the last piece: layer by layer
                        for layer, event in enumerate(layer_events):
                            self.cache.scatter(piece, ids, skip, range(layer, layer + 1))
                            self.lane.record(event)
                    freed[at] = self._event(kernels)
            if layer_events is not None and not hosts:
                for event in layer_events:
                    self.lane.record(event)
            return Completion(self.lane.record())

    @staticmethod
    def _check_deadline(deadline: float, done: int, total: int) -> None:
        if time.monotonic() > deadline:
            raise KVDepotTimeout(f"the load's deadline passed after {done} of its {total} chunks: the rest are not copied")


class DuplexMover:
    """A cache's saves and its loads on movers of their own, each with its streams and half the staging:
    a load (on the engine's critical path: the step waits for it) never queues behind a save's copies,
    and the two run at once (a save's DMA goes device-to-host, a load's host-to-device: separate copy
    engines). Safe because a worker never loads into blocks a save still reads (vLLM frees a request's
    blocks only after its saves are reported done)."""

    def __init__(self, cache: DevicePagedCache, blocks_per_chunk: int, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 graphs: bool | None = None) -> None:  # fmt: skip
        self.cache = cache
        self.saver = BlockMover(cache, blocks_per_chunk, staging_bytes // 2, graphs)
        self.loader = BlockMover(cache, blocks_per_chunk, staging_bytes // 2, graphs)
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_shape = self.saver.chunk_shape
        self.chunk_bytes = self.saver.chunk_bytes
        self.bits = self.saver.bits

    def __repr__(self) -> str:
        return f"DuplexMover(saves: {self.saver!r}; loads: {self.loader.per_batch} chunks of staging, {self.loader.lane!r})"

    @property
    def on_device(self) -> bool:
        return self.saver.on_device

    def save(self, block_ids: Sequence[np.ndarray], slots: Sequence, ready=None) -> Completion:
        return self.saver.save(block_ids, slots, ready)

    def load(self, slots: Sequence, block_ids: Sequence[np.ndarray], skip_blocks: int = 0, layer_events: Sequence | None = None,
             ready=None, deadline: float = math.inf) -> Completion:  # fmt: skip
        return self.loader.load(slots, block_ids, skip_blocks, layer_events, ready, deadline)

    def close(self) -> None:
        self.saver.close()
        self.loader.close()
