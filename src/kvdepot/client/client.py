"""KVClient: what an engine worker uses to store, find and fetch KV chunks.

One client = one ZeroMQ DEALER socket and one registered context (model, rank, layout). It is safe to
share between threads (requests are serialised). A background heartbeat keeps the server from declaring
an idle client gone; if the server restarts, the client registers again on its own.

Transports: ``shm`` (same host: the worker copies straight into / out of the server's arena, one copy)
and ``inline`` (raw payload frames). ``auto`` picks shm when the arena can be mapped.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import zmq

from kvdepot.client.shm import try_attach
from kvdepot.errors import (
    BadRequest,
    ErrorCode,
    KVDepotError,
    KVDepotTimeout,
    TransportUnavailable,
    UnknownContext,
)
from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.layout import KVLayout, as_numpy
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.server.liveness import local_client_info
from kvdepot.storage.arena import SharedArena
from kvdepot.types import ChunkHash

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray


class StoreSlots(list):
    """One entry per complete chunk: a writable ``[K, L, T, H, D]`` array, or None where nothing is to be
    written. ``statuses`` says why (SlotStatus per chunk)."""

    statuses: list[m.SlotStatus]


@dataclass(frozen=True)
class _Registration:
    context_id: int
    chunk_size: int
    chunk_bytes: int
    algorithm: HashAlgorithm
    max_frame_bytes: int
    heartbeat_interval_s: float


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
    ) -> None:
        if transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {transport!r}")
        self.url = url
        self.model = model
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._requested_transport = transport
        self._requested_chunk_size = chunk_size
        self._prefault = prefault
        self._ids = itertools.count(1)
        self._rcvtimeo = -1
        self._lock = threading.RLock()
        self._last_request = time.monotonic()
        self._zctx = zmq.Context.instance()
        self._sock = self._connect()
        self._arena: SharedArena | None = None
        self._stage: np.ndarray | None = None
        self._rstage: np.ndarray | None = None
        self._prefaulter = None
        self.transport = "inline"
        self._closed = False
        self._reg = self._register()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        if heartbeat:
            self._hb_thread = threading.Thread(target=self._heartbeat, name="kvdepot-heartbeat", daemon=True)
            self._hb_thread.start()

    # --- public properties ---------------------------------------------------------------------------

    @property
    def chunk_size(self) -> int:
        return self._reg.chunk_size

    @property
    def chunk_bytes(self) -> int:
        return self._reg.chunk_bytes

    @property
    def context_id(self) -> int:
        return self._reg.context_id

    @property
    def hash_algorithm(self) -> HashAlgorithm:
        return self._reg.algorithm

    def __repr__(self) -> str:
        return f"KVClient({self.url!r}, model={self.model!r}, transport={self.transport!r}, chunk_size={self.chunk_size})"

    # --- life cycle ----------------------------------------------------------------------------------

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=2)
        with self._lock:
            try:
                self._call(m.UnregisterContextRequest(context_id=self._reg.context_id), timeout_s=min(1.0, self.timeout_s))
            except KVDepotError:
                pass
            self._sock.close(linger=0)
            if self._prefaulter is not None:
                self._prefaulter.stop()
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    # --- simple API ----------------------------------------------------------------------------------

    def wait_prefault(self, timeout_s: float | None = None) -> bool:
        """Block until this process's mapping of the arena is populated (shm transport only)."""
        return self._prefaulter is None or self._prefaulter.wait(timeout_s)

    def ping(self) -> bool:
        return self._call(m.PingRequest()).ok

    def hashes(self, tokens: Tokens) -> list[ChunkHash]:
        """Chunk hashes of every complete chunk of ``tokens`` (the keys the server stores them under)."""
        return chunk_hashes(tokens, self.chunk_size, self._reg.algorithm)

    def lookup(self, tokens: Tokens, cache_salt: str | None = None) -> int:
        """How many leading tokens are stored (a multiple of chunk_size). Takes no lock."""
        hits = self.lookup_chunks(self.hashes(tokens), cache_salt)
        return (hits or 0) * self.chunk_size

    def store(self, tokens: Tokens, kv, cache_salt: str | None = None) -> int:
        """Store the complete chunks of ``kv`` ``[K, L, len(tokens), H, D]``; returns the leading tokens
        now stored."""
        hashes = self.hashes(tokens)
        kv = self._check_kv(as_numpy(kv), len(hashes) * self.chunk_size)
        cs = self.chunk_size
        if self.transport == "inline" and kv.flags.c_contiguous:
            return self._store_inline_rows(hashes, kv, cache_salt or "") * cs
        with self.prepare_store(hashes, cache_salt) as slots:
            for i, slot in enumerate(slots):
                if slot is not None:
                    np.copyto(slot, kv[:, :, i * cs : (i + 1) * cs])
        return _leading_stored(slots.statuses) * cs

    def retrieve(self, tokens: Tokens, cache_salt: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The KV of the leading stored chunks of ``tokens``: ``[K, L, n, H, D]``.

        ``out`` (optional, ``[K, L, >= n, H, D]``) is filled instead of allocating a new array.
        """
        cs = self.chunk_size
        hashes = self.hashes(tokens)
        if self.transport == "inline":
            return self._retrieve_inline_into(hashes, cache_salt or "", out)
        with self.prepare_retrieve(hashes, cache_salt) as views:
            n = len(views) * cs
            if out is None:
                out = self.layout.empty(n)
            else:
                out = self._check_kv(as_numpy(out), n)
            for i, view in enumerate(views):
                np.copyto(out[:, :, i * cs : (i + 1) * cs], view)
        return out[:, :, :n]

    def clear(self) -> int:
        return self._call(m.ClearRequest()).removed

    # --- zero-copy API -------------------------------------------------------------------------------

    @contextmanager
    def prepare_store(self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None) -> Iterator[StoreSlots]:
        """Writable slots, one per complete chunk; committed on a clean exit, dropped on an exception.

        ``tokens`` may also be the chunk hashes from ``hashes()``. On the shm path the slots are the
        server's arena itself; never use them after the block.
        """
        hashes = self._as_hashes(tokens)
        salt = cache_salt or ""
        if self.transport == "shm":
            yield from self._prepare_store_shm(hashes, salt)
        else:
            yield from self._prepare_store_inline(hashes, salt)

    @contextmanager
    def prepare_retrieve(
        self, tokens: Tokens | list[ChunkHash], cache_salt: str | None = None, session_id: str = "", start: int = 0
    ) -> Iterator[list[np.ndarray]]:
        """Read-only views of the leading stored chunks (from chunk ``start``); released on exit."""
        hashes = self._as_hashes(tokens)
        salt = cache_salt or ""
        if self.transport == "shm":
            yield from self._prepare_retrieve_shm(hashes, salt, session_id, start)
        else:
            yield self._retrieve_inline(hashes, salt, session_id, start)

    # --- session API (engine connectors) -------------------------------------------------------------

    def lookup_chunks(self, hashes: list[ChunkHash], cache_salt: str | None = None, session_id: str = "") -> int | None:
        """Leading chunks stored. With ``session_id`` they stay locked for that session until it
        retrieves, frees them, or ends. None means a prefetch is still running: ask again."""
        if not hashes:
            return 0
        req = m.LookupRequest(context_id=0, keys=list(hashes), cache_salt=cache_salt or "", session_id=session_id)
        return self._call_ctx(req).hits

    def query_prefetch_status(self, session_id: str) -> int | None:
        return self._call_ctx(m.QueryPrefetchStatusRequest(context_id=0, session_id=session_id)).hits

    def free_lookup_locks(self, session_id: str, start: int = 0, end: int = -1) -> int:
        return self._call_ctx(m.FreeLookupLocksRequest(context_id=0, session_id=session_id, start=start, end=end)).released

    def end_session(self, session_id: str) -> None:
        self._call_ctx(m.EndSessionRequest(context_id=0, session_id=session_id))

    def report_block_allocation(self, allocated: int = 0, freed: int = 0) -> None:
        self._call_ctx(m.ReportBlockAllocationRequest(context_id=0, allocated_blocks=allocated, freed_blocks=freed))

    # --- shm path ------------------------------------------------------------------------------------

    def _slot(self, offset: int, writable: bool) -> np.ndarray:
        assert self._arena is not None
        view = self._arena.buffer[offset : offset + self.chunk_bytes]
        return self.layout.view_chunk(view, self.chunk_size, writable=writable)

    def _prepare_store_shm(self, hashes: list[ChunkHash], salt: str) -> Iterator[StoreSlots]:
        reply = self._call_ctx(m.PrepareStoreRequest(context_id=0, keys=list(hashes), cache_salt=salt))
        context_id = self._reg.context_id
        slots = StoreSlots(
            self._slot(off, True) if st == m.SlotStatus.ALLOCATED else None
            for off, st in zip(reply.offsets, reply.statuses)
        )
        slots.statuses = [m.SlotStatus(s) for s in reply.statuses]
        try:
            yield slots
        except BaseException:
            self._finish_store(context_id, reply.lease_id, abort=True)
            raise
        self._finish_store(context_id, reply.lease_id, abort=False)

    def _finish_store(self, context_id: int, lease_id: int, abort: bool) -> None:
        if lease_id == 0:
            return
        try:
            self._call(m.CommitStoreRequest(context_id=context_id, lease_id=lease_id, abort=abort))
        except KVDepotError:
            if not abort:
                raise
            # An abort that fails (server gone, lease expired) leaves nothing behind: the lease ends.

    def _prepare_retrieve_shm(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> Iterator[list[np.ndarray]]:
        req = m.PrepareRetrieveRequest(context_id=0, keys=list(hashes), cache_salt=salt, session_id=session_id, start=start)
        reply = self._call_ctx(req)
        context_id = self._reg.context_id
        views = [self._slot(off, False) for off in reply.offsets]
        try:
            yield views
        finally:
            if reply.lease_id:
                # LeaseExpired here means the bytes may have been reused while read: it propagates.
                self._call(m.CommitRetrieveRequest(context_id=context_id, lease_id=reply.lease_id))

    # --- inline path ---------------------------------------------------------------------------------

    @property
    def _rows(self) -> int:
        return self.layout.kv_factor * self.layout.num_layers

    def _staging(self, n_chunks: int) -> np.ndarray:
        """A reusable ``[n, chunk_bytes]`` buffer: fresh memory would fault in at ~1 GB/s every call.

        Safe to reuse because every inline store waits for the server's reply, which comes only after
        all frames arrived; a failed call drops the buffer instead (ZeroMQ may still be sending it).
        """
        need = n_chunks * self.chunk_bytes
        if self._stage is None or self._stage.size < need:
            self._stage = np.empty(max(need, 1), dtype=np.uint8)
        return self._stage[:need].reshape(n_chunks, self.chunk_bytes)

    def _send_store_inline(self, hashes: list[ChunkHash], salt: str, first: int, payload: list, rpf: int) -> list[m.SlotStatus]:
        req = m.StoreInlineRequest(context_id=0, keys=list(hashes), cache_salt=salt, first=first, rows_per_frame=rpf)
        try:
            reply = self._call_ctx(req, payload)
        except BaseException:
            self._stage = None
            raise
        return [m.SlotStatus(s) for s in reply.statuses]

    def _prepare_store_inline(self, hashes: list[ChunkHash], salt: str) -> Iterator[StoreSlots]:
        first = self.lookup_chunks(hashes, salt) or 0  # skip sending what is already there
        staging = self._staging(len(hashes) - first)
        slots = StoreSlots([None] * first)
        slots.extend(self.layout.view_chunk(staging[i], self.chunk_size) for i in range(len(hashes) - first))
        slots.statuses = [m.SlotStatus.EXISTS] * first + [m.SlotStatus.ALLOCATED] * (len(hashes) - first)
        yield slots  # an exception inside the block just drops the staging contents
        if first == len(hashes):
            return
        max_frame = self._reg.max_frame_bytes
        rpf = codec.rows_per_frame_for(self.chunk_bytes, self._rows, max_frame)
        payload = [f for row in staging for f in codec.split_object(row, self._rows, rpf, max_frame)]
        slots.statuses[first:] = self._send_store_inline(hashes, salt, first, payload, rpf)

    def _store_inline_rows(self, hashes: list[ChunkHash], kv: np.ndarray, salt: str) -> int:
        """Send a C-contiguous ``kv`` without staging: each (k, layer) row of a chunk is contiguous in
        it, so it goes out as its own frame, straight from the caller's memory."""
        first = self.lookup_chunks(hashes, salt) or 0
        if first == len(hashes):
            return len(hashes)
        cs = self.chunk_size
        row_bytes = self.chunk_bytes // self._rows
        if row_bytes > self._reg.max_frame_bytes or row_bytes < (64 << 10):
            # Rows too big for a frame, or so small that ZeroMQ would copy them anyway: stage instead.
            with self.prepare_store(hashes, salt) as slots:
                for i, slot in enumerate(slots):
                    if slot is not None:
                        np.copyto(slot, kv[:, :, i * cs : (i + 1) * cs])
            return _leading_stored(slots.statuses)
        payload = []
        for i in range(first, len(hashes)):
            rows = np.reshape(kv[:, :, i * cs : (i + 1) * cs], (self._rows, -1), copy=False)
            payload.extend(memoryview(r).cast("B") for r in rows)
        statuses = [m.SlotStatus.EXISTS] * first + self._send_store_inline(hashes, salt, first, payload, 1)
        return _leading_stored(statuses)

    def _fetch_inline(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> tuple[int, list, int]:
        """(found, frames, frames per chunk) of a RETRIEVE_INLINE, with the payload checked."""
        req = m.RetrieveInlineRequest(context_id=0, keys=list(hashes), cache_salt=salt, session_id=session_id, start=start)
        reply, frames = self._call_ctx(req, want_payload=True)
        per = codec.check_payload(frames, reply.found, self.chunk_bytes, self._rows, reply.rows_per_frame, self._reg.max_frame_bytes, 0)
        return reply.found, frames, per

    def _retrieve_inline(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> list[np.ndarray]:
        found, frames, per = self._fetch_inline(hashes, salt, session_id, start)
        if per == 1:  # each chunk is one frame: view it where ZeroMQ received it
            return [self.layout.view_chunk(f.buffer, self.chunk_size, writable=False) for f in frames]
        # Multi-frame chunks are joined in a reusable buffer (views die with the ``with`` block).
        need = found * self.chunk_bytes
        if self._rstage is None or self._rstage.size < need:
            self._rstage = np.empty(max(need, 1), dtype=np.uint8)
        views, pos = [], 0
        for i in range(found):
            start_pos = pos
            for f in frames[i * per : (i + 1) * per]:
                src = np.frombuffer(f.buffer, np.uint8)
                self._rstage[pos : pos + src.size] = src
                pos += src.size
            views.append(self.layout.view_chunk(self._rstage[start_pos:pos], self.chunk_size, writable=False))
        return views

    def _retrieve_inline_into(self, hashes: list[ChunkHash], salt: str, out: np.ndarray | None) -> np.ndarray:
        """Copy each received frame straight into its rows of ``out`` (one copy, no staging)."""
        if out is not None and not as_numpy(out).flags.c_contiguous:
            result = self._retrieve_inline_into(hashes, salt, None)
            target = self._check_kv(as_numpy(out), result.shape[2])
            np.copyto(target[:, :, : result.shape[2]], result)
            return target[:, :, : result.shape[2]]
        found, frames, per = self._fetch_inline(hashes, salt, "", 0)
        cs = self.chunk_size
        n = found * cs
        out = self.layout.empty(n) if out is None else self._check_kv(as_numpy(out), n)
        dtype = self.layout.storage_dtype
        for i in range(found):
            rows = np.reshape(out[:, :, i * cs : (i + 1) * cs], (self._rows, -1), copy=False)
            r = 0
            for frame in frames[i * per : (i + 1) * per]:
                src = np.frombuffer(frame.buffer, dtype=dtype)
                if src.size % rows.shape[1]:  # byte-split frames (rows larger than a frame)
                    flat = np.concatenate([np.frombuffer(f.buffer, dtype=dtype) for f in frames[i * per : (i + 1) * per]])
                    rows[...] = flat.reshape(rows.shape)
                    break
                k = src.size // rows.shape[1]
                rows[r : r + k] = src.reshape(k, -1)
                r += k
        return out[:, :, :n]

    # --- plumbing ------------------------------------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.url)
        return sock

    def _register(self) -> _Registration:
        lay = self.layout
        req = m.RegisterContextRequest(
            protocol_version=m.PROTOCOL_VERSION,
            model=self.model,
            layout=m.LayoutSpec(
                num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, dtype=lay.dtype, use_mla=lay.use_mla
            ),
            world_size=self.world_size,
            rank=self.rank,
            chunk_size=self._requested_chunk_size,
            client=local_client_info(),
        )
        reply: m.RegisterContextReply = self._call(req)
        if self._requested_transport != "inline":
            if self._arena is not None and (reply.shm is None or self._arena.nonce != reply.shm.nonce):
                if self._prefaulter is not None:
                    self._prefaulter.stop()
                self._arena.close()  # the server restarted with a new arena
                self._arena = None
            if self._arena is None:
                self._arena, self._prefaulter, why = try_attach(reply.shm, self._prefault)
                if self._arena is None and self._requested_transport == "shm":
                    raise TransportUnavailable(f"shm transport requested but {why}")
                if self._arena is None:
                    log.info("kvdepot: using the inline transport (%s)", why)
        self.transport = "shm" if self._arena is not None else "inline"
        log.info("kvdepot: context %d on %s, transport %s", reply.context_id, self.url, self.transport)
        return _Registration(
            reply.context_id,
            reply.chunk_size,
            reply.chunk_bytes,
            HashAlgorithm(reply.hash_algorithm),
            reply.max_frame_bytes,
            reply.heartbeat_interval_s,
        )

    def _call_ctx(self, body, payload: Sequence = (), want_payload: bool = False):
        """A request on our context; re-registers once if the server forgot it (restart, timeout)."""
        with self._lock:
            body.context_id = self._reg.context_id
            try:
                return self._call(body, payload, want_payload=want_payload)
            except UnknownContext:
                log.warning("kvdepot: the server forgot context %d; registering again", self._reg.context_id)
                self._reg = self._register()
                body.context_id = self._reg.context_id
                return self._call(body, payload, want_payload=want_payload)

    def _call(self, body, payload: Sequence = (), timeout_s: float | None = None, want_payload: bool = False):
        rtype = codec.request_type_of(body)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._closed and rtype is not m.RequestType.UNREGISTER_CONTEXT:
                raise KVDepotError("client is closed", ErrorCode.CONNECTION)
            sock = self._sock
            rid = next(self._ids)
            header, encoded = codec.encode_request(rid, body, int(timeout * 1000))
            # Small frames are copied (cheaper than zero-copy bookkeeping); KV payload is not.
            if payload:
                sock.send(header, zmq.SNDMORE)
                sock.send(encoded, zmq.SNDMORE)
                sock.send_multipart(payload, copy=False)
            else:
                sock.send_multipart((header, encoded))
            self._last_request = now = time.monotonic()
            deadline = now + timeout
            while True:
                # A blocking recv with RCVTIMEO saves the poll() syscall per request.
                remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
                if remaining_ms != self._rcvtimeo:
                    sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
                    self._rcvtimeo = remaining_ms
                try:
                    reply_header = sock.recv()
                    reply_body = sock.recv() if sock.getsockopt(zmq.RCVMORE) else b""
                    frames = []
                    while sock.getsockopt(zmq.RCVMORE):
                        frames.append(sock.recv(copy=False))
                except zmq.Again:
                    raise KVDepotTimeout(f"{rtype.name} got no reply from {self.url} within {timeout:.1f}s") from None
                header_msg = codec.decode_reply_header(reply_header)
                if header_msg.request_id != rid:
                    if time.monotonic() >= deadline:
                        raise KVDepotTimeout(f"{rtype.name} got no reply from {self.url} within {timeout:.1f}s")
                    continue  # a late reply to a request we already gave up on
                result = codec.decode_reply_body(rtype, header_msg, reply_body)
                return (result, frames) if want_payload else result

    def _heartbeat(self) -> None:
        interval = self._reg.heartbeat_interval_s
        while not self._hb_stop.wait(interval):
            if time.monotonic() - self._last_request < interval:
                continue
            if not self._lock.acquire(timeout=interval):
                continue  # a request is in flight: that is proof of life already
            try:
                self._call(m.PingRequest(), timeout_s=max(interval, 1.0))
            except KVDepotError as exc:
                log.debug("heartbeat failed: %s", exc)
            finally:
                self._lock.release()

    def _as_hashes(self, tokens) -> list[ChunkHash]:
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], bytes):
            return tokens
        return self.hashes(tokens)

    def _check_kv(self, kv: np.ndarray, min_tokens: int) -> np.ndarray:
        lay = self.layout
        want = (lay.kv_factor, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise BadRequest(f"kv must be [K={want[0]}, L={want[1]}, tokens, H={want[2]}, D={want[3]}], got {kv.shape}")
        if kv.shape[2] < min_tokens:
            raise BadRequest(f"kv holds {kv.shape[2]} tokens, need at least {min_tokens}")
        if kv.dtype.itemsize != lay.itemsize:
            raise BadRequest(f"kv dtype {kv.dtype} does not match layout dtype {lay.dtype}")
        if kv.dtype != lay.storage_dtype:
            kv = kv.view(lay.storage_dtype)
        return kv


def _leading_stored(statuses: list[m.SlotStatus]) -> int:
    n = 0
    for s in statuses:
        if s not in (m.SlotStatus.ALLOCATED, m.SlotStatus.EXISTS):
            break
        n += 1
    return n
