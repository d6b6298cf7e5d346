"""``RegisteredKVCache``: a worker's paged KV cache registered with the server, whose blocks the server
moves itself (the server-driven path: CUDA IPC, or a host cache in a shared-memory file).

The worker describes its cache once (``kvdepot.gpu.memory.export_cache``: per layer the memory, offset,
shape, strides, dtype and format, as plain fields) and then names blocks:

- ``store``: the server copies the chunks' blocks into L1 after the worker's ``ready_event`` (recorded
  once the blocks were written); it returns once they have been read, so the worker may reuse them.
- ``retrieve``: the server copies the stored run into the named blocks, never those of the first
  ``skip_first_n_tokens`` tokens. On CUDA it returns as soon as the copies are queued: ``wait_layer(l)``
  makes the worker's stream wait for layer ``l``'s copies (``wait_all`` for every layer), so the
  worker's kernels never read a block before the server's copy into it is done.

A server that forgot the cache (it restarted, or dropped the client) answers UNKNOWN_KV_CACHE: the
cache is registered again once and the request redone (its context is re-registered by ``ContextLink``
the same way).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvdepot.errors import TransportUnavailable, UnknownKVCache
from kvdepot.gpu.memory import ExportedCache, open_event
from kvdepot.protocol import messages as m
from kvdepot.types import ChunkHash, SlotStatus

log = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 300.0  # the first GPU registration pins the server's whole arena


class RegisteredKVCache:
    def __init__(self, link, exported: ExportedCache, block_size: int, device_index: int | None) -> None:
        self._link = link  # client.context.ContextLink
        self.exported = exported
        self.block_size = block_size
        self.device_index = device_index  # None: a host cache
        self.cache_id = 0
        self.num_blocks = 0
        self._layer_events: list = []
        self._lock = threading.Lock()
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
        reply: m.RegisterKVCacheReply = self._link.request(self.exported.request(self.block_size), timeout_s=REGISTER_TIMEOUT_S)
        events = [open_event(h, self.device_index) for h in reply.layer_events] if reply.layer_events else []
        with self._lock:
            self.cache_id, self.num_blocks, self._layer_events = reply.cache_id, reply.num_blocks, events
        log.info("kvdepot: %r registered", self)

    def _request(self, make):
        """``make(cache_id)``'s request; once more after registering again if the server forgot the cache."""
        cache_id = self.cache_id
        try:
            return self._link.request(make(cache_id))
        except UnknownKVCache:
            with self._lock:
                again = self.cache_id == cache_id
            if again:
                log.warning("kvdepot: the server forgot kv cache %d; registering it again", cache_id)
                self.register()
            return self._link.request(make(self.cache_id))

    def store(self, hashes: list[ChunkHash], block_ids: Sequence[Sequence[int]], salt: str = "", *, first: int = 0,
              ready_event: bytes = b"", agent_session: str = "", token_ids: Sequence[int] = ()) -> list[SlotStatus]:  # fmt: skip
        """Chunks ``hashes[first:]`` from their blocks (``block_ids[g]``: group g's, chunk after chunk) into
        L1; returns each one's SlotStatus. Returns once the server has read every block."""
        ids = [list(map(int, g)) for g in block_ids]
        tokens = [int(t) for t in token_ids]

        def make(cache_id: int) -> m.StoreBlocksRequest:
            return m.StoreBlocksRequest(context_id=0, cache_id=cache_id, keys=list(hashes), block_ids=ids, cache_salt=salt, first=first,
                                        ready_event=ready_event, agent_session=agent_session, token_ids=tokens)  # fmt: skip

        return [SlotStatus(s) for s in self._request(make).statuses]

    def retrieve(self, hashes: list[ChunkHash], block_ids: Sequence[Sequence[int]], salt: str = "", *, session_id: str = "",
                 start: int = 0, limit: int = 0, skip_first_n_tokens: int = 0, ready_event: bytes = b"") -> int:  # fmt: skip
        """Copy the leading stored run of ``hashes[start:]`` into the blocks (``block_ids[g]`` from chunk
        ``start`` on); returns how many chunks. CUDA: wait (``wait_layer``/``wait_all``) before reading."""
        ids = [list(map(int, g)) for g in block_ids]

        def make(cache_id: int) -> m.RetrieveBlocksRequest:
            return m.RetrieveBlocksRequest(context_id=0, cache_id=cache_id, keys=list(hashes), block_ids=ids, cache_salt=salt,
                                           session_id=session_id, start=start, limit=limit, skip_first_n_tokens=skip_first_n_tokens,
                                           ready_event=ready_event)  # fmt: skip

        return self._request(make).found

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (the current one if None) wait until the server's copies into layer ``layer``
        are done. Nothing to wait for on a host cache."""
        events = self._layer_events
        if events:
            if stream is None:
                import torch

                stream = torch.cuda.current_stream(self.device_index)
            stream.wait_event(events[layer])

    def wait_all(self, stream=None) -> None:
        """Wait for every layer: the last layer's event follows all the others on the server's stream."""
        if self._layer_events:
            self.wait_layer(len(self._layer_events) - 1, stream)

    def synchronize(self) -> None:
        """This thread waits until every copy the server queued into the cache so far is done."""
        if self._layer_events:
            self._layer_events[-1].synchronize()

    def close(self) -> None:
        if self._closed or not self.cache_id:
            return
        self._closed = True
        try:
            self._link.request(m.UnregisterKVCacheRequest(context_id=0, cache_id=self.cache_id), timeout_s=2.0)
        except Exception as exc:  # the server went first: it dropped the cache with the client
            log.debug("kvdepot: unregistering kv cache %d: %s", self.cache_id, exc)
