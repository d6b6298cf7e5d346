"""KVClient: what an engine worker uses to store, find and fetch KV chunks.

A thin facade over parts that each own one thing:

- ``ContextLink`` (``context.py``): the registered context on one server: the ``RpcChannel``
  (``kvdepot.rpc``), the registration, the transfer path it allows, requests on the context (registering
  again when the server forgot it), and the ``LeaseRenewer`` (``renewal.py``) whose heartbeat keeps the
  client's leases and registration alive.
- a ``TransferPath`` (``transfer.py``): ``ShmPath`` (same host: the worker copies straight into or out
  of the server's arena, one copy) or ``InlinePath`` (raw payload frames), chosen at each registration
  (``registration.choose_path``), which says why (``transport_reason``).
- ``ClientOptions`` (``options.py``): how it behaves; the context it registers (model, layout, rank,
  world size) is its identity.

It is safe to share between threads: every zero-copy block gets memory of its own (arena slots on shm,
a staging buffer checked out for that block alone on inline), so a view stays valid until its own block
exits, whatever other threads or nested blocks do.

Constructing a KVClient connects it (the public contract in ARCHITECTURE §10); ``connect=False`` builds
it without I/O or threads, for ``connect()`` later, which may be tried again after it failed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TypeVar

import numpy as np

from kvdepot.client.blocks import RegisteredKVCache
from kvdepot.client.context import ContextLink
from kvdepot.client.options import ClientOptions, Transport
from kvdepot.client.registration import ContextIdentity, Registration
from kvdepot.client.transfer import PathChanged, StoreSlots, TransferPath
from kvdepot.errors import BadRequest, KVDepotError
from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.layout import KVLayout, kv_array
from kvdepot.protocol import messages as m
from kvdepot.rpc.security import CurveClientKeys
from kvdepot.types import ChunkHash, ClearScope

Tokens = Sequence[int] | np.ndarray
T = TypeVar("T")
__all__ = ["ClientOptions", "ClientSession", "CurveClientKeys", "KVClient", "StoreSlots", "Transport", "check_url"]


class KVClient:
    def __init__(
        self,
        url: str,
        model: str,
        layout: KVLayout,
        *,
        rank: int = 0,
        world_size: int = 1,
        options: ClientOptions | None = None,
        connect: bool = True,
        curve: CurveClientKeys | None = None,
    ) -> None:
        """``curve``: CurveZMQ keys for a server that requires them (``CurveClientKeys.from_files(
        server_public, client_secret)``); the same as ``options.curve``."""
        check_url(url)
        self.url = url
        self.options = options or ClientOptions()
        if curve is not None:
            self.options = replace(self.options, curve=curve)
        self.link = ContextLink(url, ContextIdentity(model, layout, rank, world_size), self.options)
        self._caches: list[RegisteredKVCache] = []
        self._closed = False
        if connect:
            self.connect()

    def connect(self) -> KVClient:
        """Open the channel, register the context (choosing the transport) and start the heartbeat. One
        that failed (the server was not up yet) may be called again; on a connected client it does
        nothing, on a closed one it is refused."""
        self.link.open()
        return self

    # --- public properties ---------------------------------------------------------------------------

    @property
    def model(self) -> str:
        return self.link.identity.model

    @property
    def layout(self) -> KVLayout:
        return self.link.identity.layout

    @property
    def rank(self) -> int:
        return self.link.identity.rank

    @property
    def world_size(self) -> int:
        return self.link.identity.world_size

    @property
    def timeout_s(self) -> float:
        return self.options.timeout_s

    @property
    def registration(self) -> Registration:
        return self.link.registration

    @property
    def chunk_size(self) -> int:
        return self.registration.chunk_size

    @property
    def chunk_bytes(self) -> int:
        return self.registration.chunk_bytes

    @property
    def context_id(self) -> int:
        return self.registration.context_id

    @property
    def hash_algorithm(self) -> HashAlgorithm:
        return self.registration.algorithm

    @property
    def transport(self) -> str:
        """"shm" or "inline": the path in use (what "auto" picked)."""
        path = self.link.path
        return path.name.value if path is not None else Transport.INLINE.value

    @property
    def transport_reason(self) -> str:
        return self.link.transport_reason

    @property
    def renew_sessions(self) -> Callable[[], Iterable[str]] | None:
        """The owner's sessions still in use (e.g. an engine's requests waiting or computing): their
        locks are renewed with the heartbeat (see ``LeaseRenewer``). Called from the heartbeat thread."""
        return self.link.renewer.renew_sessions

    @renew_sessions.setter
    def renew_sessions(self, names: Callable[[], Iterable[str]] | None) -> None:
        self.link.renewer.renew_sessions = names

    def __repr__(self) -> str:
        reg = self.link._reg
        return f"KVClient({self.url!r}, model={self.model!r}, transport={self.transport!r}, chunk_size={reg.chunk_size if reg else 0})"

    # --- life cycle ----------------------------------------------------------------------------------

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            for cache in self._caches:
                cache.close()
            self.link.close()

    # --- simple API ----------------------------------------------------------------------------------

    def wait_prefault(self, timeout_s: float | None = None) -> bool:
        """Block until this process's mapping of the arena is populated (shm transport only)."""
        prefaulter = getattr(self.link.path, "prefaulter", None)
        return prefaulter is None or prefaulter.wait(timeout_s)

    def deadline(self, seconds: float):
        """A context manager: every request this thread makes inside it ends within ``seconds`` (a
        KVDepotTimeout otherwise), e.g. to stay inside an engine's own budget for a prefetch. Other
        threads sharing the client are not affected."""
        return self.link.deadline(seconds)

    def arena_memory(self) -> np.ndarray | None:
        """This process's mapping of the server's arena as a uint8 array (the shm path), else None: what a
        GPU worker pins with ``cudaHostRegister`` so its copies into arena slots are DMA."""
        arena = getattr(self.link.path, "arena", None)
        return arena.buffer if arena is not None else None

    def ping(self) -> bool:
        return self.link.channel.ping(self.timeout_s)

    def hashes(self, tokens: Tokens) -> list[ChunkHash]:
        """Chunk hashes of every complete chunk of ``tokens`` (the keys the server stores them under)."""
        return chunk_hashes(tokens, self.chunk_size, self.registration.algorithm)

    def lookup(self, tokens: Tokens, cache_salt: str | None = None, agent_session: str = "") -> int:
        """How many leading tokens are stored (a multiple of chunk_size). Takes no lock.

        ``agent_session``: this lookup is a turn of that conversation (of ``cache_salt``): the server
        opens or renews it and keeps these tokens' chunks from eviction until the session's deadline
        (``--agent-session-ttl-s`` after its last turn). The answer is then L1's (no wait for L2)."""
        hashes = self.hashes(tokens)
        if agent_session:
            return (self.link.lookup_reply(hashes, cache_salt or "", agent_session=agent_session).hits or 0) * self.chunk_size
        return self.stored_chunks(hashes, cache_salt or "") * self.chunk_size

    def store(self, tokens: Tokens, kv, cache_salt: str | None = None, raw: bool = False, agent_session: str = "") -> int:
        """Store the complete chunks of ``kv`` ``[K, L, len(tokens), H, D]``; returns the leading tokens
        now stored. ``kv``'s dtype must be the layout's exactly (a torch tensor, or a numpy array; for
        bfloat16 and fp8 an ml_dtypes array); ``raw=True`` also accepts the same-width unsigned integers
        holding those bits (which is what kvdepot hands back for them). ``agent_session``: a turn of
        that conversation (see ``lookup``); its protection covers these chunks before they are reserved."""
        n_tokens = len(tokens)
        hashes = self.hashes(tokens)
        kv = self._check_kv(kv, n_tokens, raw, exact=True)
        tokens_sent = tokens if self.options.send_token_ids else ()
        return self._on_path(lambda path: path.store(hashes, kv, cache_salt or "", agent_session, tokens_sent)) * self.chunk_size

    def retrieve(self, tokens: Tokens, cache_salt: str | None = None, out: np.ndarray | None = None, raw: bool = False) -> np.ndarray:
        """The KV of the leading stored chunks of ``tokens``: ``[K, L, n, H, D]``, as an array of the
        layout's storage dtype (bfloat16 and fp8 come as same-width unsigned integers holding the bits).

        ``out`` (optional, ``[K, L, >= n, H, D]``, of the layout's dtype, or its raw bits with ``raw=True``)
        is filled instead of allocating a new array.
        """
        hashes = self.hashes(tokens)
        if out is not None:
            out = self._check_kv(out, 0, raw)
        salt = cache_salt or ""
        # Each path brings L2 hits into L1 as it needs: shm when L1 holds less than asked, inline first.
        return self._on_path(lambda path: path.retrieve_into(hashes, salt, out))

    def clear(self, scope: ClearScope | str = ClearScope.L1) -> int:
        """Drop every unlocked object of L1 (``"l1"``), of every L2 tier (``"tiers"``), or both
        (``"all"``); returns how many went (a tier that failed to clear counts none). It may take the
        server a minute, so it goes aside (``ContextLink.call_aside``): the heartbeat goes on renewing
        the leases of blocks that other threads hold open meanwhile."""
        reply = self.link.call_aside(m.ClearRequest(scope=ClearScope(scope)), timeout_s=max(self.timeout_s, 60.0))
        return reply.removed + sum(n for n in reply.tiers_removed.values() if n > 0)

    def stored_chunks(self, hashes: list[ChunkHash], salt: str) -> int:
        """Leading chunks stored, waiting for the server to bring missing ones in from L2 first (an
        engine's lookup: the server counts it, and its hits and misses)."""
        return self.link.stored_chunks(hashes, salt)

    # --- zero-copy API -------------------------------------------------------------------------------

    @contextmanager
    def prepare_store(self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None, token_ids: Sequence[int] = ()) -> Iterator[StoreSlots]:
        """Writable slots, one per complete chunk; committed on a clean exit, dropped on an exception.

        ``tokens`` may also be the chunk hashes from ``hashes()``. On the shm path the slots are the
        server's arena itself; never use them after the block.
        """
        hashes = self._as_hashes(tokens)
        if not len(token_ids) and hashes is not tokens and self.options.send_token_ids:
            token_ids = tokens  # given tokens, and asked to send them
        with ExitStack() as stack:
            yield self._on_path(lambda path: stack.enter_context(path.prepare_store(hashes, cache_salt or "", token_ids=token_ids)))

    @contextmanager
    def prepare_retrieve(
        self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None, session_id: str = "", start: int = 0
    ) -> Iterator[list[np.ndarray]]:
        """Read-only views of the leading stored chunks (from chunk ``start``); released on exit."""
        hashes = self._as_hashes(tokens)
        salt = cache_salt or ""
        # The path brings L2 hits into L1 as it needs (transfer.ShmPath.prepare_retrieve: L1 first).
        with ExitStack() as stack:
            yield self._on_path(lambda path: stack.enter_context(path.prepare_retrieve(hashes, salt, session_id, start)))

    # --- the server-driven path (paged caches the server moves itself) ---------------------------------

    def register_kv_cache(self, layers: Sequence, fmt: str, block_size: int, groups: Sequence[int] | None = None) -> RegisteredKVCache:
        """Register a paged KV cache whose blocks the server copies itself: ``layers`` are torch tensors in
        model order, CUDA (shared with the server through CUDA IPC handles) or host memory in a
        ``kvdepot.gpu.memory.HostCacheFile``, in ``fmt`` (``kv_first`` or ``block_first``); ``groups[l]`` the
        KV-cache group of layer ``l``. TransportUnavailable when the server cannot reach that memory.
        Unregistered when the client closes."""
        from kvdepot.gpu.memory import export_cache  # torch: only for workers that register a cache

        exported = export_cache(layers, fmt, groups)
        device = layers[0].device
        cache = RegisteredKVCache(self.link, exported, block_size, device.index if device.type == "cuda" else None)
        if device.type == "cuda" and cache.device_index is None:
            import torch

            cache.device_index = torch.cuda.current_device()
        cache.check_offer(self.registration.blocks)
        cache.register()
        self._caches.append(cache)
        return cache

    # --- sessions (engine connectors) ----------------------------------------------------------------

    def session(self, session_id: str) -> ClientSession:
        """The verbs of one engine request's session (see ``ClientSession``)."""
        return ClientSession(self, session_id)

    def lookup_chunks(self, hashes: list[ChunkHash], cache_salt: str | None = None, session_id: str = "") -> int | None:
        """Leading chunks stored. With ``session_id`` they stay locked for that session until it
        retrieves, frees them, or ends. None means a prefetch is still running: ask again."""
        return self.link.lookup(hashes, cache_salt or "", session_id)

    def lookup_reply(self, hashes: list[ChunkHash], cache_salt: str | None = None, session_id: str = "", *, source_hint: str = "",
                     prefill_tokens_per_s: float = 0.0, agent_session: str = "") -> m.LookupReply:  # fmt: skip
        """``lookup_chunks`` with the server's whole reply: ``hits`` (None while prefetching), whether
        they are locked, and ``in_l1``, how many were in L1 at the lookup (the rest come from L2).
        ``source_hint``: a router's ``HOST[:PORT]`` of where this prompt's KV was computed (the peer
        tier asks that node first); ``prefill_tokens_per_s``: the engine's prefill rate, so the peer
        tier skips a pull that would be slower than recomputing; ``agent_session``: this lookup is a
        turn of that conversation (see ``lookup``)."""
        return self.link.lookup_reply(
            hashes, cache_salt or "", session_id, source_hint=source_hint, prefill_tokens_per_s=prefill_tokens_per_s, agent_session=agent_session
        )

    def query_prefetch_status(self, session_id: str) -> int | None:
        return self.session(session_id).status()

    def free_lookup_locks(self, session_id: str, start: int = 0, end: int = -1) -> int:
        return self.session(session_id).free(start, end)

    def end_session(self, session_id: str) -> None:
        self.session(session_id).end()

    def report_block_allocation(self, allocated: int = 0, freed: int = 0) -> None:
        self.link.request(m.ReportBlockAllocationRequest(context_id=0, allocated_blocks=allocated, freed_blocks=freed))

    def renew(self, sessions: Iterable[str] = (), lease_ids: Iterable[int] = ()) -> int:
        """Push the TTL of these sessions' locks and of these leases (this client's own) to now + TTL;
        returns how many leases were renewed (ended ones are skipped, not an error)."""
        return self.link.renew(sessions, lease_ids)

    # --- lifecycle controls --------------------------------------------------------------------------

    def pin(self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None, ttl_s: float | None = None) -> m.PinReply:
        """Keep the stored prefix of ``tokens`` (or chunk hashes) from eviction: until ``unpin`` (a hard
        pin), or for ``ttl_s`` seconds (a soft pin). Only what is in L1 now is pinned: ``pinned`` in the
        reply says how many chunks. Pinned bytes count against the salt's quota; a pin over it raises
        (NO_SPACE). A pin is the server's, not this client's: it outlives the client, and whoever holds its
        ``pin_id`` (random, unguessable) may unpin it."""
        body = m.PinPrefixRequest(context_id=0, keys=self._as_hashes(tokens), cache_salt=cache_salt or "", ttl_s=ttl_s or 0.0)
        return self.link.request(body)

    def unpin(self, pin_id: int) -> m.PinReply:
        """End a pin (IllegalTransition if it ended already)."""
        return self.link.channel.call(m.UnpinRequest(pin_id=pin_id), timeout_s=self.timeout_s)

    def close_agent_session(self, name: str, cache_salt: str | None = None) -> None:
        """End the agent session ``name`` (opened by a ``lookup``/``store`` with ``agent_session=name``):
        its prefix is evicted normally from now on. IllegalTransition if it ended already."""
        self.link.channel.call(m.CloseAgentSessionRequest(name=name, cache_salt=cache_salt or ""), timeout_s=self.timeout_s)

    # --- internals -----------------------------------------------------------------------------------

    def _on_path(self, use: Callable[[TransferPath], T]) -> T:
        """``use(path)``; when registering again replaced the path meanwhile (a restarted server: a new
        arena, whose offsets the old path cannot read), once more on the new one."""
        try:
            return use(self._path())
        except PathChanged:
            return use(self._path())

    def _path(self) -> TransferPath:
        if self.link.path is None:
            raise KVDepotError("client is not connected")
        return self.link.path

    def _as_hashes(self, tokens) -> list[ChunkHash]:
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], bytes):
            return tokens
        return self.hashes(tokens)

    def _check_kv(self, kv, n_tokens: int, raw: bool = False, exact: bool = False) -> np.ndarray:
        """``kv`` as an array of the layout's storage dtype (a view), after checking its dtype is the
        layout's exactly and its shape ``[K, L, T, H, D]`` with ``T == n_tokens`` (``exact``) or
        ``T >= n_tokens``. Any mismatch is a BadRequest naming both sides."""
        kv = kv_array(kv, self.layout, raw)
        lay = self.layout
        want = (lay.kv_factor, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise BadRequest(f"kv must be [K={want[0]}, L={want[1]}, tokens, H={want[2]}, D={want[3]}], got {kv.shape}")
        if exact and kv.shape[2] != n_tokens:
            raise BadRequest(f"kv holds {kv.shape[2]} tokens but {n_tokens} token ids were given: they must match")
        if kv.shape[2] < n_tokens:
            raise BadRequest(f"kv holds {kv.shape[2]} tokens, need at least {n_tokens}")
        return kv


class ClientSession:
    """One engine request's session on the server: its lookup (and the locks it takes), the L2 prefetch
    that may follow, freeing locks the engine does not need, a retrieve that takes the locks over, and
    the end. The server keeps the state (``server/sessions.py``); this is only the verbs."""

    def __init__(self, client: KVClient, session_id: str) -> None:
        self.client = client
        self.id = session_id

    def __repr__(self) -> str:
        return f"ClientSession({self.id!r})"

    def lookup(self, hashes: list[ChunkHash], cache_salt: str | None = None, lock: bool = True, prefetch: bool = True) -> int | None:
        """Leading chunks stored (locked for this session when ``lock``); None: a prefetch from L2 runs,
        ask ``status()`` again."""
        return self.client.link.lookup(hashes, cache_salt or "", self.id, lock=lock, prefetch=prefetch)

    def status(self) -> int | None:
        return self.answer().hits

    def answer(self) -> m.LookupReply:
        """QUERY_PREFETCH_STATUS's whole reply: ``hits`` (None while prefetching), ``locked``, ``in_l1``."""
        return self.client.link.request(m.QueryPrefetchStatusRequest(context_id=0, session_id=self.id))

    def free(self, start: int = 0, end: int = -1) -> int:
        """Release the locks on chunks ``[start, end)`` (the engine has them itself)."""
        return self.client.link.request(m.FreeLookupLocksRequest(context_id=0, session_id=self.id, start=start, end=end)).released

    def retrieve(self, hashes: list[ChunkHash], cache_salt: str | None = None, start: int = 0):
        """``prepare_retrieve`` of ``hashes[start:]`` under this session's locks (a context manager)."""
        return self.client.prepare_retrieve(hashes, cache_salt, session_id=self.id, start=start)

    def renew(self) -> int:
        return self.client.renew(sessions=[self.id])

    def end(self) -> None:
        self.client.link.request(m.EndSessionRequest(context_id=0, session_id=self.id))


def check_url(url: str) -> None:
    """Raise ValueError unless ``url`` is ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    scheme, sep, rest = url.partition("://") if isinstance(url, str) else ("", "", "")
    ok = bool(sep and rest)
    if ok and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        ok = bool(colon and host and port.isdigit() and 0 < int(port) < 65536)
    elif ok and scheme != "ipc":
        ok = False
    if not ok:
        raise ValueError(f"kvdepot URL {url!r} is not tcp://HOST:PORT or ipc://PATH (e.g. tcp://127.0.0.1:5555)")
