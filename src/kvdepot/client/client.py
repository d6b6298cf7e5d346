"""KVClient: what an engine worker uses to store, find and fetch KV chunks.

One client = one ZeroMQ DEALER socket and one registered context (model, rank, layout). It is safe to
share between threads: requests are serialised on the socket, and every zero-copy block gets memory of
its own (arena slots on shm, a staging buffer checked out for that block alone on inline), so a view
stays valid until its own block exits, whatever other threads or nested blocks do. A background
heartbeat keeps the server from declaring an idle client gone; if the server restarts, the client
registers again on its own.

Transports: ``shm`` (same host: the worker copies straight into / out of the server's arena, one copy)
and ``inline`` (raw payload frames). ``auto`` picks shm when the arena can be mapped.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import zmq

from kvdepot.client.shm import try_attach
from kvdepot.client.staging import StagingPool
from kvdepot.errors import (
    BadRequest,
    ErrorCode,
    KVDepotError,
    KVDepotTimeout,
    ServerUnreachable,
    TransportUnavailable,
    UnknownContext,
)
from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.layout import KVLayout, kv_array
from kvdepot.malloc import keep_large_buffers_in_heap
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.identity import local_client_info
from kvdepot.shm import SharedArena
from kvdepot.types import ChunkHash

log = logging.getLogger(__name__)

Tokens = Sequence[int] | np.ndarray

INLINE_BATCH_BYTES = 32 << 20  # inline transfers go as pipelined messages of about this size


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
    ) -> None:
        if transport not in ("auto", "shm", "inline"):
            raise ValueError(f"transport must be auto, shm or inline, got {transport!r}")
        check_url(url)
        self.url = url
        self.model = model
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._requested_transport = transport
        self._requested_chunk_size = chunk_size
        self._prefault = prefault
        self._tune_malloc = tune_malloc and not os.environ.get("KVDEPOT_NO_MALLOC_TUNING")
        self._ids = itertools.count(1)
        self._rcvtimeo = -1
        self._lock = threading.RLock()
        self._last_request = time.monotonic()
        self._zctx = zmq.Context.instance()
        self._sock = self._connect()
        self._arena: SharedArena | None = None
        self._staging = StagingPool()
        self._prefaulter = None
        self.transport = "inline"
        self.transport_reason = ""  # why ``transport`` is what it is (what ``auto`` found)
        self._closed = False
        # Leases of zero-copy blocks open right now: renewed until the block exits (it cannot leak them).
        self._held_leases: set[int] = set()
        self._held_lock = threading.Lock()
        self.renew_sessions: Callable[[], Iterable[str]] | None = None
        """The owner's sessions still in use (e.g. an engine's requests waiting or computing): their
        locks are renewed with the heartbeat. Called from the heartbeat thread: it must be thread-safe.
        A session the owner stops naming is no longer renewed, so the TTL ends it if it leaked."""
        try:
            self._reg = self._register(timeout_s=connect_timeout_s)
        except KVDepotTimeout:
            self._close_transport()
            raise ServerUnreachable(
                f"no kvdepot server answered at {url} within connect_timeout_s={connect_timeout_s:g} s "
                f"(is it running, and is this its address?)"
            ) from None
        except BaseException:
            self._close_transport()
            raise
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
            self._close_transport()

    def _close_transport(self) -> None:
        self._sock.close(linger=0)
        if self._prefaulter is not None:
            self._prefaulter.stop()
        if self._arena is not None:
            self._arena.close()  # also drops our liveness lock
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
        return self._stored_chunks(self.hashes(tokens), cache_salt or "") * self.chunk_size

    def store(self, tokens: Tokens, kv, cache_salt: str | None = None, raw: bool = False) -> int:
        """Store the complete chunks of ``kv`` ``[K, L, len(tokens), H, D]``; returns the leading tokens
        now stored. ``kv``'s dtype must be the layout's exactly (a torch tensor, or a numpy array; for
        bfloat16 and fp8 an ml_dtypes array); ``raw=True`` also accepts the same-width unsigned integers
        holding those bits (which is what kvdepot hands back for them)."""
        n_tokens = len(tokens)
        hashes = self.hashes(tokens)
        kv = self._check_kv(kv, n_tokens, raw, exact=True)
        cs = self.chunk_size
        if self.transport == "inline" and kv.flags.c_contiguous:
            return self._store_inline_rows(hashes, kv, cache_salt or "") * cs
        with self.prepare_store(hashes, cache_salt) as slots:
            for i, slot in enumerate(slots):
                if slot is not None:
                    np.copyto(slot, kv[:, :, i * cs : (i + 1) * cs], casting="no")
        return _leading_stored(slots.statuses) * cs

    def retrieve(
        self, tokens: Tokens, cache_salt: str | None = None, out: np.ndarray | None = None, raw: bool = False
    ) -> np.ndarray:
        """The KV of the leading stored chunks of ``tokens``: ``[K, L, n, H, D]``, as an array of the
        layout's storage dtype (bfloat16 and fp8 come as same-width unsigned integers holding the bits).

        ``out`` (optional, ``[K, L, >= n, H, D]``, of the layout's dtype, or its raw bits with ``raw=True``)
        is filled instead of allocating a new array.
        """
        cs = self.chunk_size
        hashes = self.hashes(tokens)
        if out is not None:
            out = self._check_kv(out, 0, raw)
        if self.transport == "inline":
            return self._retrieve_inline_into(hashes, cache_salt or "", out)
        # (prepare_retrieve below waits for an L2 prefetch when the server has tiers)
        with self.prepare_retrieve(hashes, cache_salt) as views:
            n = len(views) * cs
            if out is None:
                out = self.layout.empty(n)
            else:
                out = self._check_tokens(out, n)
            for i, view in enumerate(views):
                np.copyto(out[:, :, i * cs : (i + 1) * cs], view, casting="no")
        return out[:, :, :n]

    def clear(self, scope: str = "l1") -> int:
        """Drop every unlocked object of L1 (``"l1"``), of every L2 tier (``"tiers"``), or both
        (``"all"``); returns how many went (a tier that failed to clear counts none)."""
        reply = self._call(m.ClearRequest(scope=scope))
        return reply.removed + sum(n for n in reply.tiers_removed.values() if n > 0)

    def _stored_chunks(self, hashes: list[ChunkHash], salt: str) -> int:
        """Leading chunks stored, waiting for the server to bring missing ones in from L2 first."""
        if not hashes:
            return 0
        if not self._reg.l2_tiers:
            return self.lookup_chunks(hashes, salt) or 0
        sid = f"_kvdepot-{os.urandom(8).hex()}"
        req = m.LookupRequest(context_id=0, keys=list(hashes), cache_salt=salt, session_id=sid, lock=False)
        hits = self._call_ctx(req).hits
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0002
        while hits is None:
            if time.monotonic() > deadline:
                self.end_session(sid)
                raise KVDepotTimeout(f"the prefetch from L2 did not finish within {self.timeout_s:.1f}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.005)
            hits = self.query_prefetch_status(sid)
        return hits

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
        if self._reg.l2_tiers and not session_id:
            self._stored_chunks(hashes, salt)  # let the server bring L2 hits into L1 first
        if self.transport == "shm":
            yield from self._prepare_retrieve_shm(hashes, salt, session_id, start)
            return
        views, buffer = self._retrieve_inline(hashes, salt, session_id, start)
        try:
            yield views
        finally:
            if buffer is not None:
                self._staging.release(buffer)  # the block is over: its views must not be used any more

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
        with self._holding(reply.lease_id):
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
        with self._holding(reply.lease_id):
            try:
                yield views
            finally:
                if reply.lease_id:
                    # LeaseExpired here means the bytes may have been reused while read: it propagates.
                    self._call(m.CommitRetrieveRequest(context_id=context_id, lease_id=reply.lease_id))

    @contextmanager
    def _holding(self, lease_id: int) -> Iterator[None]:
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

    # --- inline path ---------------------------------------------------------------------------------

    @property
    def _rows(self) -> int:
        return self.layout.kv_factor * self.layout.num_layers

    def _send_store_inline(self, hashes: list[ChunkHash], salt: str, first: int, chunk_frames: list[list], rpf: int) -> list[m.SlotStatus]:
        """Store chunks ``hashes[first:]`` whose frames are ``chunk_frames`` as pipelined messages of
        about INLINE_BATCH_BYTES each: bounded memory on both ends, and the server copies one batch
        into L1 while the next is still on the wire."""
        per_batch = max(1, INLINE_BATCH_BYTES // self.chunk_bytes)
        requests = []
        for i in range(first, len(hashes), per_batch):
            j = min(i + per_batch, len(hashes))
            body = m.StoreInlineRequest(
                context_id=self._reg.context_id, keys=list(hashes[:j]), cache_salt=salt, rows_per_frame=rpf, first=i, count=j - i
            )
            requests.append((body, [f for frames in chunk_frames[i - first : j - first] for f in frames]))
        replies = self._pipeline_ctx(requests)
        return [m.SlotStatus(s) for r in replies for s in r.statuses]

    def _prepare_store_inline(self, hashes: list[ChunkHash], salt: str) -> Iterator[StoreSlots]:
        first = self.lookup_chunks(hashes, salt) or 0  # skip sending what is already there
        n_new = len(hashes) - first
        buffer = self._staging.acquire(n_new * self.chunk_bytes)  # this block's alone
        staging = buffer[: n_new * self.chunk_bytes].reshape(n_new, self.chunk_bytes)
        slots = StoreSlots([None] * first)
        slots.extend(self.layout.view_chunk(staging[i], self.chunk_size) for i in range(n_new))
        slots.statuses = [m.SlotStatus.EXISTS] * first + [m.SlotStatus.ALLOCATED] * n_new
        try:
            yield slots  # an exception inside the block just drops the staging contents
        except BaseException:
            self._staging.release(buffer)
            raise
        if not n_new:
            self._staging.release(buffer)
            return
        max_frame = self._reg.max_frame_bytes
        rpf = codec.rows_per_frame_for(self.chunk_bytes, self._rows, max_frame)
        frames = [codec.split_object(row, self._rows, rpf, max_frame) for row in staging]
        # On failure the buffer is dropped, not pooled: ZeroMQ may still be sending from it.
        slots.statuses[first:] = self._send_store_inline(hashes, salt, first, frames, rpf)
        self._staging.release(buffer)

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
                        np.copyto(slot, kv[:, :, i * cs : (i + 1) * cs], casting="no")
            return _leading_stored(slots.statuses)
        frames = []
        for i in range(first, len(hashes)):
            rows = np.reshape(kv[:, :, i * cs : (i + 1) * cs], (self._rows, -1), copy=False)
            frames.append([memoryview(r).cast("B") for r in rows])
        statuses = [m.SlotStatus.EXISTS] * first + self._send_store_inline(hashes, salt, first, frames, 1)
        return _leading_stored(statuses)

    def _fetch_inline(
        self, hashes: list[ChunkHash], salt: str, session_id: str, start: int, consume, n_found: int | None = None
    ) -> int:
        """Fetch the stored chunks from ``start`` on as pipelined bounded replies.

        ``consume(chunk_index, frames, rows_per_frame)`` gets each chunk's checked frames as its reply
        arrives. Returns how many chunks (from ``start``) form the prefix that was delivered.
        """
        if session_id:
            # The session's locks decide what is found (a plain lookup cannot see chunks that are
            # locked but cleared meanwhile): one request, whose reply says how many.
            n_found, per_batch = len(hashes) - start, len(hashes)
        else:
            if n_found is None:
                # Objects are keyed per chunk, so this counts the stored run from ``start`` on.
                n_found = self.lookup_chunks(hashes[start:], salt) or 0
            per_batch = max(1, INLINE_BATCH_BYTES // self.chunk_bytes)
        starts = list(range(start, start + n_found, per_batch))
        requests = [
            (
                m.RetrieveInlineRequest(
                    context_id=self._reg.context_id,
                    keys=list(hashes),
                    cache_salt=salt,
                    session_id=session_id,
                    start=s0,
                    limit=min(per_batch, start + n_found - s0),
                ),
                (),
            )
            for s0 in starts
        ]
        got = [0] * len(starts)
        max_frame = self._reg.max_frame_bytes

        def on_reply(index: int, reply: m.RetrieveInlineReply, frames: list) -> None:
            per = codec.check_payload(frames, reply.found, self.chunk_bytes, self._rows, reply.rows_per_frame, max_frame, 0)
            got[index] = reply.found
            for k in range(reply.found):
                consume(starts[index] + k - start, frames[k * per : (k + 1) * per], reply.rows_per_frame)

        if requests:
            self._pipeline_ctx(requests, on_reply)
        # A prefix: stop at the first batch that came back short (evicted since the lookup).
        n = 0
        for index, s0 in enumerate(starts):
            n = s0 - start + got[index]
            if got[index] < min(per_batch, start + n_found - s0):
                break
        return n

    def _retrieve_inline(
        self, hashes: list[ChunkHash], salt: str, session_id: str, start: int
    ) -> tuple[list[np.ndarray], np.ndarray | None]:
        """Views for prepare_retrieve on the inline path, and the staging buffer they live in (the
        caller releases it when its block exits). A single-frame chunk is viewed where ZeroMQ received
        it; multi-frame chunks are joined into this call's own buffer as each reply arrives, so received
        frames are freed as we go rather than all held at once."""
        n_found = len(hashes) - start if session_id else self._stored_chunks(hashes[start:], salt)
        buffer = None
        if self.chunk_bytes > codec.TARGET_FRAME_BYTES and n_found:
            buffer = self._staging.acquire(n_found * self.chunk_bytes)
        views: dict[int, np.ndarray] = {}

        def consume(i: int, parts: list, rows_per_frame: int) -> None:
            if len(parts) == 1:
                views[i] = self.layout.view_chunk(parts[0].buffer, self.chunk_size, writable=False)
                return
            assert buffer is not None
            base = pos = i * self.chunk_bytes
            for f in parts:
                src = np.frombuffer(f.buffer, np.uint8)
                buffer[pos : pos + src.size] = src
                pos += src.size
            views[i] = self.layout.view_chunk(buffer[base:pos], self.chunk_size, writable=False)

        try:
            n = self._fetch_inline(hashes, salt, session_id, start, consume, None if session_id else n_found)
        except BaseException:
            if buffer is not None:
                self._staging.release(buffer)  # receives only write into it: nothing else holds it
            raise
        return [views[i] for i in range(n)], buffer

    def _retrieve_inline_into(self, hashes: list[ChunkHash], salt: str, out: np.ndarray | None) -> np.ndarray:
        """Copy each received frame straight into its rows of ``out`` (already checked: the layout's
        storage dtype) as its reply arrives (one copy)."""
        if out is not None and not out.flags.c_contiguous:
            result = self._retrieve_inline_into(hashes, salt, None)
            target = self._check_tokens(out, result.shape[2])
            np.copyto(target[:, :, : result.shape[2]], result, casting="no")
            return target[:, :, : result.shape[2]]
        cs = self.chunk_size
        n_found = self._stored_chunks(hashes, salt)
        out = self.layout.empty(n_found * cs) if out is None else self._check_tokens(out, n_found * cs)
        dtype = self.layout.storage_dtype

        def consume(c: int, parts: list, rows_per_frame: int) -> None:
            rows = np.reshape(out[:, :, c * cs : (c + 1) * cs], (self._rows, -1), copy=False)
            if rows_per_frame == 0:  # byte-split frames: rows larger than a frame
                rows[...] = np.concatenate([np.frombuffer(f.buffer, dtype=dtype) for f in parts]).reshape(rows.shape)
                return
            r = 0
            for frame in parts:
                src = np.frombuffer(frame.buffer, dtype=dtype).reshape(-1, rows.shape[1])
                rows[r : r + src.shape[0]] = src
                r += src.shape[0]

        n = self._fetch_inline(hashes, salt, "", 0, consume, n_found)
        return out[:, :, : n * cs]

    # --- plumbing ------------------------------------------------------------------------------------

    def _connect(self) -> zmq.Socket:
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.url)
        return sock

    def _register(self, timeout_s: float | None = None) -> _Registration:
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
        reply: m.RegisterContextReply = self._call(req, timeout_s=timeout_s)
        if self._requested_transport != "inline":
            if self._arena is not None and (reply.shm is None or self._arena.nonce != reply.shm.nonce):
                if self._prefaulter is not None:
                    self._prefaulter.stop()
                self._arena.close()  # the server restarted with a new arena
                self._arena = None
            if self._arena is None:
                self._arena, self._prefaulter, why = try_attach(reply.shm, self._prefault)
                self.transport_reason = why
                if self._arena is None and self._requested_transport == "shm":
                    raise TransportUnavailable(f"shm transport requested but {why}")
                if self._arena is None:
                    # The arena's file is visible here but unusable: most likely a misconfiguration
                    # (permissions, a second server, a stale path) rather than a remote client.
                    visible = reply.shm is not None and os.path.exists(reply.shm.path)
                    log.log(logging.WARNING if visible else logging.INFO, "kvdepot: using the inline transport (%s)", why)
        else:
            self.transport_reason = "inline was asked for"
        self.transport = "shm" if self._arena is not None else "inline"
        if self.transport == "inline" and self._tune_malloc:
            keep_large_buffers_in_heap()  # received frames reuse warm heap instead of fresh pages
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

    def _pipeline_ctx(self, requests: list[tuple[object, Sequence]], on_reply=None) -> list:
        """``_pipeline`` on our context, registering again once if the server forgot it."""
        with self._lock:
            try:
                return self._pipeline(requests, on_reply)
            except UnknownContext:
                self._reg = self._register()
                for body, _ in requests:
                    body.context_id = self._reg.context_id
                return self._pipeline(requests, on_reply)

    def _call(self, body, payload: Sequence = (), timeout_s: float | None = None, want_payload: bool = False):
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            rid = self._send(body, payload, timeout)
            deadline = time.monotonic() + timeout
            while True:
                header, reply_body, frames = self._recv(body, deadline)
                if header.request_id != rid:
                    continue  # a late reply to a request we already gave up on
                result = codec.decode_reply_body(codec.request_type_of(body), header, reply_body)
                return (result, frames) if want_payload else result

    def _pipeline(self, requests: list[tuple[object, Sequence]], on_reply=None, window: int = 4) -> list:
        """Send ``requests`` with up to ``window`` in flight and collect every reply (in request order).

        ``on_reply(index, result, frames)`` runs as each reply arrives, so a caller can consume one
        reply's payload while ZeroMQ is still receiving the next. The first error is raised (the other
        replies are then discarded as stale when they arrive).
        """
        with self._lock:
            results: list = [None] * len(requests)
            pending: dict[int, int] = {}
            deadline = time.monotonic() + self.timeout_s
            sent = 0
            while sent < len(requests) or pending:
                while sent < len(requests) and len(pending) < window:
                    body, payload = requests[sent]
                    pending[self._send(body, payload, self.timeout_s)] = sent
                    sent += 1
                header, reply_body, frames = self._recv(requests[0][0], deadline)
                index = pending.pop(header.request_id, None)
                if index is None:
                    continue
                result = codec.decode_reply_body(codec.request_type_of(requests[index][0]), header, reply_body)
                results[index] = result
                if on_reply is not None:
                    on_reply(index, result, frames)
            return results

    def _send(self, body, payload: Sequence, timeout: float) -> int:
        """Send one request; returns its id. Called with the lock held."""
        if self._closed and not isinstance(body, m.UnregisterContextRequest):
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
        self._last_request = time.monotonic()
        return rid

    def _recv(self, body, deadline: float):
        """Receive the next reply (any request id) before ``deadline``. Called with the lock held."""
        sock = self._sock
        # A blocking recv with RCVTIMEO saves a poll() syscall per request.
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            raise KVDepotTimeout(f"{type(body).__name__} got no reply from {self.url} in time")
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
            raise KVDepotTimeout(f"{type(body).__name__} got no reply from {self.url} in time") from None
        return codec.decode_reply_header(reply_header), reply_body, frames

    def renew(self, sessions: Iterable[str] = (), lease_ids: Iterable[int] = ()) -> int:
        """Push the TTL of these sessions' locks and of these leases (this client's own) to now + TTL;
        returns how many leases were renewed (ended ones are skipped, not an error)."""
        req = m.RenewLeasesRequest(context_id=0, lease_ids=list(lease_ids), sessions=list(sessions))
        if not req.lease_ids and not req.sessions:
            return 0
        return self._call_ctx(req).renewed

    def _heartbeat(self) -> None:
        """Ping when idle (the server counts silence as death), and renew what is held well within the
        lease TTL: the leases of open zero-copy blocks and the owner's sessions (``renew_sessions``)."""
        interval = self._reg.heartbeat_interval_s
        tick = max(0.05, min(interval, self._reg.lease_ttl_s / 4))
        last_renewal = time.monotonic()
        while not self._hb_stop.wait(tick):
            now = time.monotonic()
            if now - last_renewal >= self._reg.lease_ttl_s / 4:
                last_renewal = now
                if self._renew_held():
                    continue  # a renewal is a request: proof of life as well
            if now - self._last_request < interval:
                continue
            if not self._lock.acquire(timeout=interval):
                continue  # a request is in flight: that is proof of life already
            try:
                self._call(m.PingRequest(), timeout_s=max(interval, 1.0))
            except KVDepotError as exc:
                log.debug("heartbeat failed: %s", exc)
            finally:
                self._lock.release()

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
        if not self._lock.acquire(timeout=self._reg.lease_ttl_s / 4):
            return False
        try:
            self.renew(sessions, leases)
        except KVDepotError as exc:
            log.debug("lease renewal failed: %s", exc)
        finally:
            self._lock.release()
        return True

    def _as_hashes(self, tokens) -> list[ChunkHash]:
        if isinstance(tokens, list) and tokens and isinstance(tokens[0], bytes):
            return tokens
        return self.hashes(tokens)

    def _check_kv(self, kv, n_tokens: int, raw: bool = False, exact: bool = False) -> np.ndarray:
        """``kv`` as an array of the layout's storage dtype (a view), after checking its dtype is the
        layout's exactly and its shape ``[K, L, T, H, D]`` with ``T == n_tokens`` (``exact``) or
        ``T >= n_tokens``. Any mismatch is a BadRequest naming both sides."""
        return self._check_tokens(kv_array(kv, self.layout, raw), n_tokens, exact)

    def _check_tokens(self, kv: np.ndarray, n_tokens: int, exact: bool = False) -> np.ndarray:
        lay = self.layout
        want = (lay.kv_factor, lay.num_layers, lay.num_kv_heads, lay.head_dim)
        if kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise BadRequest(f"kv must be [K={want[0]}, L={want[1]}, tokens, H={want[2]}, D={want[3]}], got {kv.shape}")
        if exact and kv.shape[2] != n_tokens:
            raise BadRequest(f"kv holds {kv.shape[2]} tokens but {n_tokens} token ids were given: they must match")
        if kv.shape[2] < n_tokens:
            raise BadRequest(f"kv holds {kv.shape[2]} tokens, need at least {n_tokens}")
        return kv


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


def _leading_stored(statuses: list[m.SlotStatus]) -> int:
    n = 0
    for s in statuses:
        if s not in (m.SlotStatus.ALLOCATED, m.SlotStatus.EXISTS):
            break
        n += 1
    return n
