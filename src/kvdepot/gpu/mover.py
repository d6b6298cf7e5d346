"""Moving chunks between a paged cache on a device and host memory (L1 arena slots, or received frames),
through a staging buffer on the device, on one stream of the mover's own::

    save:  [wait: the blocks are written] -> per batch: gather blocks -> staging (one batched kernel pair)
                                           -> one copy per chunk, staging -> its host slot
    load:  [wait: the blocks may be written] -> per batch: one copy per chunk, host slot -> staging
                                           -> scatter staging -> blocks (layer by layer in the last batch,
                                              recording each layer's event after it)

Two copies per chunk (the GPU gather, then one DMA to or from pinned host memory), as the CUDA IPC design
has it; staging is reused batch after batch in stream order. A ``Completion`` says when the copies are
done: the caller keeps the host slots (and the leases on them) until then. On a CPU device there is no
stream and no staging: blocks are gathered straight into the host slot and scattered straight out of
it, and the completion is done at once.

One mover serves one thread at a time per call (a lock covers each call's enqueueing: a save's gather
and its copies out of staging must not interleave with a load's copies into it).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np

from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.gpu.runtime import require_torch

DEFAULT_STAGING_BYTES = 256 << 20


class Completion:
    """The end of a batch of copies: an event on the mover's stream, or already done (CPU)."""

    __slots__ = ("event",)

    def __init__(self, event=None) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until done (True), or until ``timeout_s`` passed (False; CUDA has no timed wait, so the
        event is polled, from 20 µs apart up to 1 ms apart)."""
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
            pause = min(pause * 2, 1e-3)
        return True


class Lane:
    """The stream a mover's copies run on (CUDA), or nothing at all (CPU: copies are synchronous)."""

    def __init__(self, device) -> None:
        self.torch = torch = require_torch("moving a paged KV cache")
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __repr__(self) -> str:
        return f"Lane({self.device})"

    def active(self):
        return self.torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

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
    def __init__(self, cache: DevicePagedCache, blocks_per_chunk: int, staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.cache = cache
        self.torch = require_torch("moving a paged KV cache")
        self.blocks_per_chunk = blocks_per_chunk
        self.lane = Lane(cache.device)
        self.bits = cache.views[0].dtype
        self.chunk_shape = cache.chunk_shape(1, blocks_per_chunk)[1:]
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * cache.views[0].element_size()
        self.per_batch = max(1, staging_bytes // self.chunk_bytes)
        self._staging = None  # allocated at the first copy (device memory is the engine's, mostly)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BlockMover({self.cache!r}, {self.per_batch} chunks per batch, {self.lane!r})"

    @property
    def on_device(self) -> bool:
        return self.lane.stream is not None

    def close(self) -> None:
        """Let go of the staging buffer and the cache (after the last copy: the caller knows when)."""
        self._staging = None
        self.cache.close()

    def _staging_for(self, n: int):
        if self._staging is None:
            self._staging = self.torch.empty((self.per_batch, *self.chunk_shape), dtype=self.bits, device=self.cache.device)
        return self._staging[:n]

    def _chunk_ids(self, block_ids: Sequence[np.ndarray], i: int, j: int) -> list[np.ndarray]:
        bpc = self.blocks_per_chunk
        return [ids[i * bpc : j * bpc] for ids in block_ids]

    def save(self, block_ids: Sequence[np.ndarray], slots: Sequence, ready=None) -> Completion:
        """Copy chunk ``i``'s blocks (``block_ids[g][i*bpc:(i+1)*bpc]`` per group, checked by the caller
        with ``cache.check_ids``) into ``slots[i]`` (host memory, ``[K, L, T, H, D]``), after ``ready``."""
        hosts = [host_tensor(s, self.bits) for s in slots]
        with self._lock, self.lane.active():
            self.lane.wait(ready)
            if not self.on_device:
                for i, host in enumerate(hosts):
                    self.cache.gather(self._chunk_ids(block_ids, i, i + 1), host[None])
                return Completion()
            for i in range(0, len(hosts), self.per_batch):
                j = min(i + self.per_batch, len(hosts))
                staging = self._staging_for(j - i)
                self.cache.gather(self._chunk_ids(block_ids, i, j), staging)
                for c in range(i, j):
                    hosts[c].copy_(staging[c - i], non_blocking=True)
            return Completion(self.lane.record())

    def load(self, slots: Sequence, block_ids: Sequence[np.ndarray], skip_blocks: int = 0, layer_events: Sequence | None = None,
             ready=None) -> Completion:  # fmt: skip
        """Copy ``slots[i]`` into chunk ``i``'s blocks, leaving the first ``skip_blocks`` blocks alone,
        after ``ready``. ``layer_events[l]`` (CUDA) is recorded once layer ``l`` of every chunk is written."""
        hosts = [host_tensor(s, self.bits) for s in slots]
        bpc = self.blocks_per_chunk
        with self._lock, self.lane.active():
            self.lane.wait(ready)
            if not self.on_device:
                for i, host in enumerate(hosts):
                    self.cache.scatter(host[None], self._chunk_ids(block_ids, i, i + 1), skip_blocks - i * bpc)
                return Completion()
            starts = list(range(0, len(hosts), self.per_batch))
            for i in starts:
                j = min(i + self.per_batch, len(hosts))
                staging = self._staging_for(j - i)
                for c in range(i, j):
                    staging[c - i].copy_(hosts[c], non_blocking=True)
                ids, skip = self._chunk_ids(block_ids, i, j), skip_blocks - i * bpc
                if layer_events is None or i != starts[-1]:
                    self.cache.scatter(staging, ids, skip)
                    continue
                for layer, event in enumerate(layer_events):  # the last batch: layer by layer
                    self.cache.scatter(staging, ids, skip, range(layer, layer + 1))
                    self.lane.record(event)
            if layer_events is not None and not hosts:
                for event in layer_events:
                    self.lane.record(event)
            return Completion(self.lane.record())
