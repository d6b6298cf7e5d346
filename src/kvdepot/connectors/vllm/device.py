"""vLLM's paged cache on a GPU, and the three ways its chunks reach kvdepot.

On a GPU vLLM registers one 5-dimensional tensor per layer: FlashAttention's ``[2, blocks, block_size,
H, D]`` (``kv_first``) or FlashInfer's ``[blocks, 2, block_size, H, D]`` (``block_first``); a different
stride order (vLLM's HND layouts) is read through the strides as given. Both are per-token K/V already,
so chunks are kvdepot's shared ``[K, L, T, H, D]`` layout under the plain model id: another engine of
the same model and layout (vLLM on another GPU, SGLang) reads them.

The path (``transport`` in ``kv_connector_extra_config``), decided at the first transfer on each
connected client and said in the log:

- ``cuda_ipc`` (``auto`` picks it when the server offers this GPU): the cache is registered once
  (``KVClient.register_kv_cache``) and the *server* gathers and scatters the blocks, waiting on an event
  the worker recorded on its stream; a load's kernels wait on the server's per-layer events.
- ``shm`` (pinned): the worker maps the arena and pins it (``cudaHostRegister``); the *worker* gathers
  blocks into a staging buffer on the GPU and copies them into the arena slot with one DMA on a side
  stream (and the reverse for loads): ``kvdepot.gpu.mover.DuplexMover`` (saves and loads on streams of
  their own).
- ``inline``: the same mover through pageable host buffers and the socket (another host).

Ordering: a transfer starts after an event recorded on the engine's current stream (the blocks are
written, or free to write: vLLM's next step may be queued before the last one ran), and the engine's
kernels wait for a load's copies before they read a layer. Nothing here blocks the forward on a save.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial

import numpy as np

from kvdepot.client.client import KVClient
from kvdepot.client.blocks import RegisteredKVCache
from kvdepot.client.options import Transport
from kvdepot.errors import KVDepotError, TransportUnavailable
from kvdepot.gpu import runtime
from kvdepot.gpu.memory import EventRing
from kvdepot.gpu.mover import Completion, DuplexMover
from kvdepot.gpu.paged import DevicePagedCache
from kvdepot.layout import PagedFormat

log = logging.getLogger(__name__)

UNPIN_WAIT_S = 30.0  # how long a closing arena's pin waits for the copies still queued into or out of it


def device_format(shape: Sequence[int], block_size: int) -> PagedFormat:
    """kv_first or block_first, from a layer tensor's shape (MLA's 3-dimensional latent cache is refused
    before it gets here)."""
    if len(shape) != 5 or shape[2] != block_size:
        raise NotImplementedError(
            f"kvdepot reads vLLM's GPU caches as [2, blocks, {block_size}, H, D] (FlashAttention) or [blocks, 2, {block_size}, H, D] "
            f"(FlashInfer); this one is {tuple(shape)}"
        )
    if shape[0] == 2 and shape[1] != 2:
        return PagedFormat.KV_FIRST
    if shape[1] == 2 and shape[0] != 2:
        return PagedFormat.BLOCK_FIRST
    raise NotImplementedError(f"a cache of shape {tuple(shape)} could be either layout (2 blocks?)")


Ready = tuple[object | None, bytes]  # an event marking the engine's stream (None on a CPU), its IPC handle


class DeviceKV:
    """The worker's paged cache on its device and the path its chunks take (see the module docstring)."""

    def __init__(self, layers: Sequence, fmt: PagedFormat, block_size: int, blocks_per_chunk: int, transport: Transport,
                 staging_bytes: int, pin_arena: bool = True) -> None:  # fmt: skip
        self.layers = list(layers)
        self.format = fmt
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.transport = Transport(transport)
        self.cache = DevicePagedCache(self.layers, fmt, block_size)
        self.mover = DuplexMover(self.cache, blocks_per_chunk, staging_bytes)  # loads never queue behind saves
        self.on_gpu = self.cache.device.type == "cuda"
        self._ring = EventRing() if self.on_gpu else None
        self._pin_arena = pin_arena
        self._pinned: runtime.PinnedRange | None = None
        self._pinned_arena: bytes | None = None  # the nonce of the arena whose mapping _pinned holds
        self._pin_lock = threading.Lock()  # _pin, its let-go (a path's close, unpin): any thread
        self._client: KVClient | None = None
        self._server: RegisteredKVCache | None = None
        self._refused: TransportUnavailable | None = None  # cuda_ipc asked for and not to be had on this client
        self._layer_events: list | None = None
        self._lock = threading.Lock()
        self.path = "undecided"

    def __repr__(self) -> str:
        return f"DeviceKV({self.path}, {self.cache!r})"

    @property
    def num_layers(self) -> int:
        return self.cache.num_layers

    def server_path(self, client: KVClient) -> RegisteredKVCache | None:
        """The registered cache when the server moves the blocks (cuda_ipc), else None (the mover
        does); decided once per connected client, so a reconnect decides again. Thread-safe (the saver
        and loader threads ask too)."""
        with self._lock:
            if client is self._client:
                if self._refused is not None:
                    raise self._refused  # every transfer is a miss, said in the log by the failure tally
                return self._server
            self._client, self._server, self._refused = client, None, None
            if self.transport in (Transport.AUTO, Transport.CUDA_IPC):
                try:
                    self._server = client.register_kv_cache(self.layers, self.format.value, self.block_size)
                except Exception as exc:
                    # Not only the server's refusals: a cache torch cannot share at all raises here too (memory
                    # from vLLM's CuMemAllocator, its sleep mode: ``_share_cuda_`` raises RuntimeError).
                    why = exc.message if isinstance(exc, KVDepotError) else f"this cache cannot be shared with the server: {type(exc).__name__}: {exc}"
                    if self.transport is Transport.CUDA_IPC:
                        self._refused = TransportUnavailable(f"transport cuda_ipc: {why}")
                        self.path = "cuda_ipc (refused)"
                        raise self._refused from None
                    level = logging.INFO if isinstance(exc, TransportUnavailable) else logging.WARNING
                    log.log(level, "kvdepot: the server-driven path is not available (%s); the worker moves the blocks", why)
            if self._server is not None:
                self.path = self._server.kind
            else:
                pinned = self.on_gpu and client.transport == "shm" and self._pin(client)
                self.path = f"{client.transport} (pinned)" if pinned else client.transport
            log.info("kvdepot worker: %r", self)
            return self._server

    def _pin(self, client: KVClient) -> bool:
        """Pin this process's mapping of the arena, once per arena, known by its nonce (not its address: a
        server that restarted offers a new arena, which may be mapped where the old one was). The pin is
        let go before its mapping: the path calls ``_arena_closing`` before it unmaps the arena, and a pin
        of another arena is let go here."""
        if not self._pin_arena or not self.on_gpu:
            return False
        path = client.link.path
        arena = getattr(path, "arena", None)
        with self._pin_lock:
            if arena is None or arena.forked:
                return False
            if self._pinned is not None and self._pinned_arena == arena.nonce:
                return self._pinned.pinned
            self._unpin_locked()  # another arena's: its path closed without telling us
            memory = arena.buffer
            if not memory.nbytes:  # its path closed meanwhile
                return False
            self._pinned, self._pinned_arena = runtime.pin(memory.__array_interface__["data"][0], memory.nbytes), arena.nonce
            if not path.before_close(partial(self._arena_closing, arena.nonce)):
                self._unpin_locked()  # closed between the two: let go now
                return False
            return self._pinned.pinned

    def _arena_closing(self, nonce: bytes) -> None:
        """The path is about to unmap arena ``nonce``: the mover's copies queued into or out of it end
        first (CUDA must not unpin pages a DMA still uses; past ``UNPIN_WAIT_S`` the pin is kept, the
        safe side), then the pin goes, while the range is still mapped."""
        with self._pin_lock:
            if self._pinned_arena != nonce:
                return
            if not all(m.settled().wait(UNPIN_WAIT_S) for m in (self.mover.saver, self.mover.loader)):
                log.warning("kvdepot: copies into the old arena did not end within %.0f s; its pin is kept", UNPIN_WAIT_S)
                self._pinned, self._pinned_arena = None, None
                return
            self._unpin_locked()

    def _unpin_locked(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
        self._pinned, self._pinned_arena = None, None

    def host_path(self, client: KVClient) -> None:
        """Before the mover copies into or out of ``client``'s arena slots: they are pinned memory."""
        if client.transport == "shm":
            self._pin(client)

    def ready(self) -> Ready:
        """Mark "everything queued on the engine's stream so far" (the event, and its IPC handle for the
        server); (None, b"") on a CPU device, whose copies need no ordering."""
        if self._ring is None:
            return None, b""
        return self._ring.record()

    def layer_events(self) -> list:
        """Events the mover records after each layer of a layer-by-layer load ([] on a CPU device), made
        once and recorded again every step: a wait issued before a later record waits for the earlier."""
        if self._layer_events is None:
            if self.on_gpu:
                torch = runtime.require_torch("a GPU load")
                with torch.cuda.device(self.cache.device):
                    self._layer_events = [torch.cuda.Event() for _ in range(self.num_layers)]
            else:
                self._layer_events = []
        return self._layer_events

    def ids(self, block_ids: Sequence[int], chunks: Sequence[int] | None = None) -> list[np.ndarray]:
        """The op's block ids as the mover takes them (one KV-cache group), for ``chunks`` only if given."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if chunks is not None:
            bpc = self.blocks_per_chunk
            ids = np.concatenate([ids[i * bpc : (i + 1) * bpc] for i in chunks]) if chunks else ids[:0]
        return self.cache.check_ids([ids], ids.size)

    def wait_on_engine_stream(self, completion: Completion) -> None:
        """The engine's next kernels wait for ``completion`` (no host wait)."""
        if completion.event is not None:
            torch = runtime.require_torch("a GPU load")
            torch.cuda.current_stream(self.cache.device).wait_event(completion.event)

    def unpin(self) -> None:
        with self._pin_lock:
            self._unpin_locked()
