"""KVClient: what an engine worker uses to store, find and fetch KV chunks.

A thin facade over three parts, each in its own module:

- ``RpcChannel`` (``channel.py``): one DEALER socket, request ids, deadlines, pipelining, thread-safe.
- a ``TransferPath`` (``transfer.py``): ``ShmPath`` (same host: the worker copies straight into or out
  of the server's arena, one copy) or ``InlinePath`` (raw payload frames); ``auto`` picks shm when the
  arena can be mapped, once per registration, and says why (``transport_reason``).
- the registered context (model, rank, layout, chunk size) and its renewals: a heartbeat keeps the
  server from declaring an idle client gone and renews the leases of blocks still open and of the
  sessions the owner names (``renew_sessions``); if the server restarts, the client registers again.

It is safe to share between threads: every zero-copy block gets memory of its own (arena slots on shm,
a staging buffer checked out for that block alone on inline), so a view stays valid until its own block
exits, whatever other threads or nested blocks do.

Constructing a KVClient connects it (the public contract in ARCHITECTURE §7); ``connect=False`` builds
it without I/O or threads, for ``connect()`` later.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from kvdepot.client.channel import Heartbeat, RpcChannel
from kvdepot.client.shm import try_attach
from kvdepot.client.transfer import InlinePath, PathChanged, ShmPath, StoreSlots, TransferPath
from kvdepot.errors import BadRequest, KVDepotError, KVDepotTimeout, ServerUnreachable, TransportUnavailable, UnknownContext
from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.layout import KVLayout, kv_array
from kvdepot.malloc import keep_large_buffers_in_heap
from kvdepot.protocol import messages as m
from kvdepot.protocol.identity import local_client_info
from kvdepot.types import ChunkHash

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray
__all__ = ["ClientOptions", "ClientSession", "KVClient", "StoreSlots", "check_url"]


@dataclass(frozen=True)
class ClientOptions:
    """How a client behaves (the context it registers is model, layout, rank and world size)."""

    transport: str = "auto"  # "auto" | "shm" | "inline"
    timeout_s: float = 10.0  # deadline of one request
    connect_timeout_s: float = 5.0  # how long to wait for a server to answer at all
    chunk_size: int = 0  # 0: the server's default
    heartbeat: bool = True  # ping when idle and renew held leases (off: the TTL ends them)
    prefault: bool = True  # populate this process's mapping of the arena in the background
    tune_malloc: bool = True  # keep freed multi-MiB buffers in the heap (inline receives)

    def __post_init__(self) -> None:
        if self.transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {self.transport!r}")
        if not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive")


@dataclass(frozen=True)
class _Registration:
    context_id: int
    chunk_size: int
    chunk_bytes: int
    algorithm: HashAlgorithm
    max_frame_bytes: int
    heartbeat_interval_s: float
    l2_tiers: int = 0
    lease_ttl_s: float = 60.0


class KVClient:
    def __init__(
        self,
        url: str,
        model: str,
        layout: KVLayout,
        rank: int = 0,
        world_size: int = 1,
        transport: str = "auto",
        timeout_s: float = 10.0,
        chunk_size: int = 0,
        heartbeat: bool = True,
        prefault: bool = True,
        tune_malloc: bool = True,
        connect_timeout_s: float = 5.0,
        *,
        options: ClientOptions | None = None,
        connect: bool = True,
    ) -> None:
        check_url(url)
        self.url = url
        self.model = model
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.options = options or ClientOptions(
            transport=transport,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            chunk_size=chunk_size,
            heartbeat=heartbeat,
            prefault=prefault,
            tune_malloc=tune_malloc and not os.environ.get("KVDEPOT_NO_MALLOC_TUNING"),
        )
        self.timeout_s = self.options.timeout_s
        self.channel = RpcChannel(url)
        self.path: TransferPath | None = None
        self.transport = "inline"
        self.transport_reason = ""  # why ``transport`` is what it is (what ``auto`` found)
        self._reg: _Registration | None = None
        self._ctx_lock = threading.RLock()  # (re-)registration
        self._held_leases: set[int] = set()  # leases of zero-copy blocks open right now
        self._held_lock = threading.Lock()
        self._heartbeat: Heartbeat | None = None
        self._closed = False
        self.renew_sessions: Callable[[], Iterable[str]] | None = None
        """The owner's sessions still in use (e.g. an engine's requests waiting or computing): their
        locks are renewed with the heartbeat. Called from the heartbeat thread: it must be thread-safe.
        A session the owner stops naming is no longer renewed, so the TTL ends it if it leaked."""
        if connect:
            self.connect()

    def connect(self) -> KVClient:
        """Open the channel, register the context (choosing the transport) and start the heartbeat."""
        self.channel.open()
        try:
            self._reg = self._register(timeout_s=self.options.connect_timeout_s)
        except KVDepotTimeout:
            self._close_transport()
            raise ServerUnreachable(
                f"no kvdepot server answered at {self.url} within connect_timeout_s={self.options.connect_timeout_s:g} s "
                f"(is it running, and is this its address?)"
            ) from None
        except BaseException:
            self._close_transport()
            raise
        if self.options.heartbeat:
            tick = max(0.05, min(self._reg.heartbeat_interval_s, self._reg.lease_ttl_s / 4))
            self._heartbeat = Heartbeat(tick, self._beat)
            self._last_renewal = time.monotonic()
            self._heartbeat.start()
        return self

    # --- public properties ---------------------------------------------------------------------------

    @property
    def registration(self) -> _Registration:
        if self._reg is None:
            raise KVDepotError("client is not connected")
        return self._reg

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
    def max_frame_bytes(self) -> int:
        return self.registration.max_frame_bytes

    @property
    def hash_algorithm(self) -> HashAlgorithm:
        return self.registration.algorithm

    def __repr__(self) -> str:
        size = self._reg.chunk_size if self._reg else 0
        return f"KVClient({self.url!r}, model={self.model!r}, transport={self.transport!r}, chunk_size={size})"

    # --- life cycle ----------------------------------------------------------------------------------

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._reg is not None:
            try:
                self.channel.call(
                    m.UnregisterContextRequest(context_id=self._reg.context_id), timeout_s=min(1.0, self.timeout_s), closing=True
                )
            except KVDepotError:
                pass
        self._close_transport()

    def _close_transport(self) -> None:
        self.channel.close()
        if self.path is not None:
            self.path.close()

    # --- simple API ----------------------------------------------------------------------------------

    def wait_prefault(self, timeout_s: float | None = None) -> bool:
        """Block until this process's mapping of the arena is populated (shm transport only)."""
        prefaulter = getattr(self.path, "prefaulter", None)
        return prefaulter is None or prefaulter.wait(timeout_s)

    def ping(self) -> bool:
        return self.channel.ping(self.timeout_s)

    def hashes(self, tokens: Tokens) -> list[ChunkHash]:
        """Chunk hashes of every complete chunk of ``tokens`` (the keys the server stores them under)."""
        return chunk_hashes(tokens, self.chunk_size, self.registration.algorithm)

    def lookup(self, tokens: Tokens, cache_salt: str | None = None) -> int:
        """How many leading tokens are stored (a multiple of chunk_size). Takes no lock."""
        return self.stored_chunks(self.hashes(tokens), cache_salt or "") * self.chunk_size

    def store(self, tokens: Tokens, kv, cache_salt: str | None = None, raw: bool = False) -> int:
        """Store the complete chunks of ``kv`` ``[K, L, len(tokens), H, D]``; returns the leading tokens
        now stored. ``kv``'s dtype must be the layout's exactly (a torch tensor, or a numpy array; for
        bfloat16 and fp8 an ml_dtypes array); ``raw=True`` also accepts the same-width unsigned integers
        holding those bits (which is what kvdepot hands back for them)."""
        n_tokens = len(tokens)
        hashes = self.hashes(tokens)
        kv = self._check_kv(kv, n_tokens, raw, exact=True)
        return self._path().store(hashes, kv, cache_salt or "") * self.chunk_size

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
        if self.registration.l2_tiers and self.transport == "shm":
            self.stored_chunks(hashes, salt)  # let the server bring L2 hits into L1 first
        return self._path().retrieve_into(hashes, salt, out)

    def clear(self, scope: str = "l1") -> int:
        """Drop every unlocked object of L1 (``"l1"``), of every L2 tier (``"tiers"``), or both
        (``"all"``); returns how many went (a tier that failed to clear counts none)."""
        reply = self.channel.call(m.ClearRequest(scope=scope), timeout_s=max(self.timeout_s, 60.0))
        return reply.removed + sum(n for n in reply.tiers_removed.values() if n > 0)

    def stored_chunks(self, hashes: list[ChunkHash], salt: str) -> int:
        """Leading chunks stored, waiting for the server to bring missing ones in from L2 first."""
        if not hashes:
            return 0
        if not self.registration.l2_tiers:
            return self.lookup_chunks(hashes, salt) or 0
        session = self.session(f"_kvdepot-{os.urandom(8).hex()}")
        hits = session.lookup(hashes, salt, lock=False)
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0002
        while hits is None:
            if time.monotonic() > deadline:
                session.end()
                raise KVDepotTimeout(f"the prefetch from L2 did not finish within {self.timeout_s:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            hits = session.status()
        return hits

    # --- zero-copy API -------------------------------------------------------------------------------

    @contextmanager
    def prepare_store(self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None) -> Iterator[StoreSlots]:
        """Writable slots, one per complete chunk; committed on a clean exit, dropped on an exception.

        ``tokens`` may also be the chunk hashes from ``hashes()``. On the shm path the slots are the
        server's arena itself; never use them after the block.
        """
        with self._path().prepare_store(self._as_hashes(tokens), cache_salt or "") as slots:
            yield slots

    @contextmanager
    def prepare_retrieve(
        self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None, session_id: str = "", start: int = 0
    ) -> Iterator[list[np.ndarray]]:
        """Read-only views of the leading stored chunks (from chunk ``start``); released on exit."""
        hashes = self._as_hashes(tokens)
        salt = cache_salt or ""
        if self.registration.l2_tiers and not session_id:
            self.stored_chunks(hashes, salt)  # let the server bring L2 hits into L1 first
        with self._path().prepare_retrieve(hashes, salt, session_id, start) as views:
            yield views

    # --- sessions (engine connectors) ----------------------------------------------------------------

    def session(self, session_id: str) -> ClientSession:
        """The verbs of one engine request's session (see ``ClientSession``)."""
        return ClientSession(self, session_id)

    def lookup_chunks(self, hashes: list[ChunkHash], cache_salt: str | None = None, session_id: str = "") -> int | None:
        """Leading chunks stored. With ``session_id`` they stay locked for that session until it
        retrieves, frees them, or ends. None means a prefetch is still running: ask again."""
        if not hashes:
            return 0
        req = m.LookupRequest(context_id=0, keys=list(hashes), cache_salt=cache_salt or "", session_id=session_id)
        return self.call_ctx(req).hits

    def query_prefetch_status(self, session_id: str) -> int | None:
        return self.session(session_id).status()

    def free_lookup_locks(self, session_id: str, start: int = 0, end: int = -1) -> int:
        return self.session(session_id).free(start, end)

    def end_session(self, session_id: str) -> None:
        self.session(session_id).end()

    def report_block_allocation(self, allocated: int = 0, freed: int = 0) -> None:
        self.call_ctx(m.ReportBlockAllocationRequest(context_id=0, allocated_blocks=allocated, freed_blocks=freed))

    def renew(self, sessions: Iterable[str] = (), lease_ids: Iterable[int] = ()) -> int:
        """Push the TTL of these sessions' locks and of these leases (this client's own) to now + TTL;
        returns how many leases were renewed (ended ones are skipped, not an error)."""
        req = m.RenewLeasesRequest(context_id=0, lease_ids=list(lease_ids), sessions=list(sessions))
        if not req.lease_ids and not req.sessions:
            return 0
        return self.call_ctx(req).renewed

    # --- what the transfer paths use (transfer.PathHost) ---------------------------------------------

    def call(self, body, payload: Sequence = ()):
        """A request as is (no re-registration: e.g. a commit, whose lease a new context would not know)."""
        return self.channel.call(body, payload, timeout_s=self.timeout_s)

    def call_ctx(self, body, payload: Sequence = (), want_payload: bool = False, path: object = None):
        """A request on our context; registers again once if the server forgot it (restart, revocation).
        ``path``: the transfer path asking; if registering again replaced it (a restarted server, a new
        arena), PathChanged is raised instead of redoing the request (its answer would be the new
        path's to read)."""
        reg = self.registration
        body.context_id = reg.context_id
        try:
            return self.channel.call(body, payload, timeout_s=self.timeout_s, want_payload=want_payload)
        except UnknownContext:
            body.context_id = self._reregister(reg).context_id
            if path is not None and self.path is not path:
                raise PathChanged() from None
            return self.channel.call(body, payload, timeout_s=self.timeout_s, want_payload=want_payload)

    def pipeline_ctx(self, requests: list[tuple[object, Sequence]], on_reply=None) -> list:
        """Pipelined requests on our context, registering again once if the server forgot it."""
        reg = self.registration
        try:
            return self.channel.pipeline(requests, on_reply, timeout_s=self.timeout_s)
        except UnknownContext:
            new = self._reregister(reg)
            for body, _ in requests:
                body.context_id = new.context_id
            return self.channel.pipeline(requests, on_reply, timeout_s=self.timeout_s)

    @contextmanager
    def holding(self, lease_id: int) -> Iterator[None]:
        """While the block runs, the heartbeat renews its lease: a slow block is not a leaked one."""
        if not lease_id:
            yield
            return
        with self._held_lock:
            self._held_leases.add(lease_id)
        try:
            yield
        finally:
            with self._held_lock:
                self._held_leases.discard(lease_id)

    # --- registration --------------------------------------------------------------------------------

    def _path(self) -> TransferPath:
        if self.path is None:
            raise KVDepotError("client is not connected")
        return self.path

    def _reregister(self, failed: _Registration) -> _Registration:
        """Register again, unless another thread already did since ``failed`` stopped working."""
        with self._ctx_lock:
            if self._reg is failed:
                log.warning("kvdepot: the server forgot context %d; registering again", failed.context_id)
                self._reg = self._register()
            return self._reg

    def _register(self, timeout_s: float | None = None) -> _Registration:
        lay, opts = self.layout, self.options
        req = m.RegisterContextRequest(
            protocol_version=m.PROTOCOL_VERSION,
            model=self.model,
            layout=m.LayoutSpec(
                num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype, use_mla=lay.use_mla
            ),
            world_size=self.world_size,
            rank=self.rank,
            chunk_size=opts.chunk_size,
            client=local_client_info(),
        )
        reply: m.RegisterContextReply = self.channel.call(req, timeout_s=timeout_s or self.timeout_s)
        self._choose_path(reply)
        log.info("kvdepot: context %d on %s, transport %s", reply.context_id, self.url, self.transport)
        return _Registration(
            reply.context_id,
            reply.chunk_size,
            reply.chunk_bytes,
            HashAlgorithm(reply.hash_algorithm),
            reply.max_frame_bytes,
            reply.heartbeat_interval_s,
            reply.l2_tiers,
            reply.lease_ttl_s,
        )

    def _choose_path(self, reply: m.RegisterContextReply) -> None:
        """Keep the current path, or pick one: shm when the arena maps (and is still the same one)."""
        opts = self.options
        current = self.path
        if isinstance(current, ShmPath) and reply.shm is not None and current.arena.nonce == reply.shm.nonce:
            return  # the same arena: nothing to change
        if isinstance(current, InlinePath) and opts.transport == "inline":
            return
        if current is not None:
            current.close()  # the server restarted with a new arena
            self.path = None
        if opts.transport == "inline":
            self.path, self.transport_reason = InlinePath(self), "inline was asked for"
        else:
            arena, prefaulter, why = try_attach(reply.shm, opts.prefault)
            self.transport_reason = why
            if arena is not None:
                self.path = ShmPath(self, arena, prefaulter)
            elif opts.transport == "shm":
                raise TransportUnavailable(f"shm transport requested but {why}")
            else:
                # The arena's file visible here but unusable is most likely a misconfiguration
                # (permissions, a second server, a stale path) rather than a remote client.
                visible = reply.shm is not None and os.path.exists(reply.shm.path)
                log.log(logging.WARNING if visible else logging.INFO, "kvdepot: using the inline transport (%s)", why)
                self.path = InlinePath(self)
        self.transport = self.path.name
        if self.transport == "inline" and opts.tune_malloc:
            keep_large_buffers_in_heap()  # received frames reuse warm heap instead of fresh pages

    # --- heartbeat -----------------------------------------------------------------------------------

    def _beat(self) -> None:
        """Renew what is held well within the lease TTL (the leases of open zero-copy blocks and the
        owner's sessions), and ping when idle (the server counts silence as death)."""
        reg = self.registration
        now = time.monotonic()
        if now - self._last_renewal >= reg.lease_ttl_s / 4:
            self._last_renewal = now
            if self._renew_held():
                return  # a renewal is a request: proof of life as well
        if now - self.channel.last_request < reg.heartbeat_interval_s:
            return
        with self.channel.held(reg.heartbeat_interval_s) as got:
            if not got:
                return  # a request is in flight: that is proof of life already
            try:
                self.channel.ping(timeout_s=max(reg.heartbeat_interval_s, 1.0))
            except KVDepotError as exc:
                log.debug("heartbeat failed: %s", exc)

    def _renew_held(self) -> bool:
        with self._held_lock:
            leases = list(self._held_leases)
        sessions: list[str] = []
        if self.renew_sessions is not None:
            try:
                sessions = list(self.renew_sessions())
            except Exception:  # the owner's callback must never stop the heartbeat
                log.exception("kvdepot: renew_sessions failed")
        if not leases and not sessions:
            return False
        with self.channel.held(self.registration.lease_ttl_s / 4) as got:
            if not got:
                return False
            try:
                self.renew(sessions, leases)
            except KVDepotError as exc:
                log.debug("lease renewal failed: %s", exc)
        return True

    # --- checks --------------------------------------------------------------------------------------

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
        if not hashes:
            return 0
        req = m.LookupRequest(
            context_id=0, keys=list(hashes), cache_salt=cache_salt or "", session_id=self.id, lock=lock, prefetch=prefetch
        )
        return self.client.call_ctx(req).hits

    def status(self) -> int | None:
        return self.client.call_ctx(m.QueryPrefetchStatusRequest(context_id=0, session_id=self.id)).hits

    def free(self, start: int = 0, end: int = -1) -> int:
        """Release the locks on chunks ``[start, end)`` (the engine has them itself)."""
        return self.client.call_ctx(m.FreeLookupLocksRequest(context_id=0, session_id=self.id, start=start, end=end)).released

    def retrieve(self, hashes: list[ChunkHash], cache_salt: str | None = None, start: int = 0):
        """``prepare_retrieve`` of ``hashes[start:]`` under this session's locks (a context manager)."""
        return self.client.prepare_retrieve(hashes, cache_salt, session_id=self.id, start=start)

    def renew(self) -> int:
        return self.client.renew(sessions=[self.id])

    def end(self) -> None:
        self.client.call_ctx(m.EndSessionRequest(context_id=0, session_id=self.id))


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
