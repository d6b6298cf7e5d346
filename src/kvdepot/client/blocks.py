"""``RegisteredKVCache``: a worker's paged KV cache registered with the server, whose blocks the server
moves itself (the server-driven path: CUDA IPC, or a host cache in a shared-memory file).

The worker describes its cache once (``kvdepot.gpu.memory.export_cache``: per layer the memory, offset,
shape, strides, dtype and format, as plain fields) and then names blocks:

- ``store``: the server copies the chunks' blocks into L1 after the worker's ``ready_event`` (recorded
  once the blocks were written); it returns once they have been read, so the worker may reuse them.
- ``retrieve``: the server copies the stored run into the named blocks, never those of the first
  ``skip_first_n_tokens`` tokens. On CUDA it returns as soon as the copies are queued: ``wait_layer(l)``
  makes the worker's stream wait for layer ``l``'s copies (``wait_all`` for every layer), so the
  worker's kernels never read a block before the server's copy into it is done. ``retrieve_copies``
  also returns the events that retrieve's copies record (``LayerEvents``): wait on those, not on the
  cache's events later, whenever another thread may register the cache again meanwhile.

A server that forgot the cache (it restarted, or dropped the client) answers UNKNOWN_KV_CACHE: the
cache is registered again once, by one thread (the others wait for it and use the new id), and the
request redone (its context is re-registered by ``ContextLink`` the same way). Registering again makes
new events: the old ones are never recorded again, so a wait on them waits for nothing, and a wait on
the new ones for nothing of a retrieve made before.

The cache's registration::

    REGISTERED(id) ──UNKNOWN_KV_CACHE──► REGISTERING ──registered──► REGISTERED(new id, new events)
                                              │
                                              └─failed──► FORGOTTEN (id 0) ──next request──► REGISTERING

A registration that failed (a timeout, say) never leaves the old id in use: a restarted server may have
made the cache under that very id, with events the worker never opened (see ``_register``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvdepot.errors import TransportUnavailable, UnknownKVCache
from kvdepot.gpu.memory import ExportedCache, open_event
from kvdepot.protocol import messages as m
from kvdepot.types import ChunkHash, SlotStatus, slot_statuses

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 300.0  # the first GPU registration pins the server's whole arena


class LayerEvents:
    """The server's per-layer events as the cache was registered at one moment: what the copies of a
    retrieve made then record (``RegisteredKVCache.retrieve_copies``), none on a host cache."""

    __slots__ = ("events", "device_index", "kind")

    def __init__(self, events: list, device_index: int | None, kind: str) -> None:
        self.events = events
        self.device_index = device_index
        self.kind = kind

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (the current one if None) wait until the server's copies into layer ``layer``
        are done. Nothing to wait for on a host cache."""
        if self.events:
            if stream is None:
                import torch

                stream = torch.cuda.current_stream(self.device_index)
            stream.wait_event(self.events[layer])

    def wait_all(self, stream=None) -> None:
        """Wait for every layer: the last layer's event follows all the others on the server's stream."""
        if self.events:
            self.wait_layer(len(self.events) - 1, stream)

    def synchronize(self) -> None:
        """This thread waits until every copy the server queued into the cache so far is done."""
        if self.events:
            self.events[-1].synchronize()


class RegisteredKVCache:
    def __init__(self, link, exported: ExportedCache, block_size: int, device_index: int | None) -> None:
        self._link = link  # client.context.ContextLink
        self.exported = exported
        self.block_size = block_size
        self.device_index = device_index  # None: a host cache
        self.cache_id = 0
        self.num_blocks = 0
        self._layer_events: list = []
        self._lock = threading.Lock()  # cache_id and _layer_events, read and replaced together
        self._register_lock = threading.Lock()  # one registration at a time: a second would orphan the first
        self._closed = False

    def __repr__(self) -> str:
        where = f"cuda:{self.device_index}" if self.device_index is not None else "host file"
        return f"RegisteredKVCache({self.cache_id}, {len(self.exported.layers)} layers x {self.num_blocks} blocks, {where})"

    @property
    def kind(self) -> str:
        """The path's name: cuda_ipc, or host_file."""
        return "cuda_ipc" if self.device_index is not None else "host_file"

    def check_offer(self, offer: m.BlockTransferOffer | None) -> None:
        """TransportUnavailable unless the server can reach this cache's memory."""
        if offer is None:
            raise TransportUnavailable("the server has no server-driven path (no torch there, or --gpu-transfer off): use shm or inline")
        for mem in self.exported.memories:
            if isinstance(mem, m.CudaIpcMemory) and mem.device_uuid not in offer.devices:
                raise TransportUnavailable(
                    f"the server does not see this worker's GPU {mem.device_uuid} (it sees {offer.devices or 'none'}): "
                    f"it must run on this host with the GPU visible"
                )
            if isinstance(mem, m.HostFileMemory) and not offer.host_files:
                raise TransportUnavailable("the server does not map host cache files")

    def register(self) -> None:
        with self._register_lock:
            self._register()

    def _register(self) -> None:
        try:
            reply: m.RegisterKVCacheReply = self._link.request(self.exported.request(self.block_size), timeout_s=REGISTER_TIMEOUT_S)
        except BaseException:
            # Forgotten (0): a restarted server numbers its caches from 1 again, so a registration whose
            # reply came too late may have made a cache there under the old id. Kept, that id would be
            # accepted while the events stayed the old server's, never recorded again: a worker would
            # read blocks before the server's copies into them were done. The next request registers.
            with self._lock:
                self.cache_id, self.num_blocks, self._layer_events = 0, 0, []
            raise
        events = [open_event(h, self.device_index) for h in reply.layer_events] if reply.layer_events else []
        with self._lock:
            self.cache_id, self.num_blocks, self._layer_events = reply.cache_id, reply.num_blocks, events
        log.info("kvdepot: %r registered", self)

    def _current(self) -> tuple[int, LayerEvents]:
        """The cache's id and the events its copies record, as registered now (one registration's both)."""
        with self._lock:
            return self.cache_id, LayerEvents(self._layer_events, self.device_index, self.kind)

    def _request(self, make) -> tuple:
        """``make(cache_id)``'s reply, and the events of the registration whose id it named; once more
        after registering again if the server forgot the cache. Of the threads the server told so at
        once, one registers (under the lock) and the others find the new id when they get it."""
        cache_id, events = self._current()
        if not cache_id:  # forgotten by a registration that failed
            with self._register_lock:
                if not self.cache_id:
                    self._register()
                cache_id, events = self._current()
        try:
            return self._link.request(make(cache_id)), events
        except UnknownKVCache:
            with self._register_lock:
                if self.cache_id == cache_id:
                    log.warning("kvdepot: the server forgot kv cache %d; registering it again", cache_id)
                    self._register()
                cache_id, events = self._current()
            return self._link.request(make(cache_id)), events

    def store(self, hashes: list[ChunkHash], block_ids: Sequence[Sequence[int]], salt: str = "", *, first: int = 0,
              ready_event: bytes = b"", agent_session: str = "", token_ids: Sequence[int] = ()) -> list[SlotStatus]:  # fmt: skip
        """Chunks ``hashes[first:]`` from their blocks (``block_ids[g]``: group g's, chunk after chunk) into
        L1; returns each one's SlotStatus. Returns once the server has read every block."""
        ids = [list(map(int, g)) for g in block_ids]
        tokens = [int(t) for t in token_ids]

        def make(cache_id: int) -> m.StoreBlocksRequest:
            return m.StoreBlocksRequest(context_id=0, cache_id=cache_id, keys=list(hashes), block_ids=ids, cache_salt=salt, first=first,
                                        ready_event=ready_event, agent_session=agent_session, token_ids=tokens)  # fmt: skip

        return slot_statuses(self._request(make)[0].statuses)

    def retrieve(self, hashes: list[ChunkHash], block_ids: Sequence[Sequence[int]], salt: str = "", *, session_id: str = "",
                 start: int = 0, limit: int = 0, skip_first_n_tokens: int = 0, ready_event: bytes = b"") -> int:  # fmt: skip
        """Copy the leading stored run of ``hashes[start:]`` into the blocks (``block_ids[g]`` from chunk
        ``start`` on); returns how many chunks. CUDA: wait (``wait_layer``/``wait_all``) before reading."""
        return self.retrieve_copies(hashes, block_ids, salt, session_id=session_id, start=start, limit=limit,
                                    skip_first_n_tokens=skip_first_n_tokens, ready_event=ready_event)[0]  # fmt: skip

    def retrieve_copies(self, hashes: list[ChunkHash], block_ids: Sequence[Sequence[int]], salt: str = "", *, session_id: str = "",
                        start: int = 0, limit: int = 0, skip_first_n_tokens: int = 0,
                        ready_event: bytes = b"") -> tuple[int, LayerEvents]:  # fmt: skip
        """``retrieve``, and the events its copies record: wait on those (a registration made meanwhile by
        another thread has events these copies never record)."""
        ids = [list(map(int, g)) for g in block_ids]

        def make(cache_id: int) -> m.RetrieveBlocksRequest:
            return m.RetrieveBlocksRequest(context_id=0, cache_id=cache_id, keys=list(hashes), block_ids=ids, cache_salt=salt,
                                           session_id=session_id, start=start, limit=limit, skip_first_n_tokens=skip_first_n_tokens,
                                           ready_event=ready_event)  # fmt: skip

        reply, events = self._request(make)
        return reply.found, events

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (the current one if None) wait until the server's copies into layer ``layer``
        are done, as the cache is registered now (``retrieve_copies`` for one retrieve's). Nothing to wait
        for on a host cache."""
        self._current()[1].wait_layer(layer, stream)

    def wait_all(self, stream=None) -> None:
        """Wait for every layer: the last layer's event follows all the others on the server's stream."""
        self._current()[1].wait_all(stream)

    def synchronize(self) -> None:
        """This thread waits until every copy the server queued into the cache so far is done."""
        self._current()[1].synchronize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.cache_id:  # never registered, or forgotten: nothing of ours the server knows by id
            return
        try:
            self._link.request(m.UnregisterKVCacheRequest(context_id=0, cache_id=self.cache_id), timeout_s=2.0)
        except Exception as exc:  # the server went first: it dropped the cache with the client
            log.debug("kvdepot: unregistering kv cache %d: %s", self.cache_id, exc)
