"""How a client moves KV bytes: one class per path, behind ``TransferPath``, chosen once at connect.

- ``ShmPath`` (same host): PREPARE/COMMIT against the server's arena, which this process maps; the
  engine's gather or scatter is the one copy. Offsets come only with a lease, renewed while the block
  runs (``host.holding``), and the arena is watched by this process's liveness lock.
- ``InlinePath`` (any host): raw payload frames over the socket, as pipelined bounded messages. A
  zero-copy block gets a staging buffer of its own from the pool, held until the block exits.
- A later ``cuda_ipc`` path plugs in here.

A path asks its host (``context.ContextLink``) for the registration's numbers and for requests on
the context (``PathHost``); it never registers, reconnects or owns the socket itself.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvdepot.client.options import Transport
from kvdepot.client.staging import StagingPool
from kvdepot.errors import BadRequest, TransportUnavailable
from kvdepot.layout import KVLayout
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.shm import Prefaulter, SharedArena
from kvdepot.types import ChunkHash, SlotStatus, leading_run, slot_statuses

if TYPE_CHECKING:
    from kvdepot.client.registration import Registration

log = logging.getLogger(__name__)

INLINE_BATCH_BYTES = 32 << 20  # inline transfers go as pipelined messages of about this size


class StoreSlots(list):
    """One entry per complete chunk: a writable ``[K, L, T, H, D]`` array, or None where nothing is to be
    written. ``statuses`` says why (SlotStatus per chunk)."""

    statuses: list[SlotStatus]

    def __setitem__(self, index, value) -> None:
        # Replacing an entry writes nothing into the slot, whose memory keeps an earlier object's bytes:
        # the commit would store those under this block's tokens. Refused, so the block aborts.
        raise TypeError("a slot is filled in place (slots[i][...] = chunk), not replaced (slots[i] = chunk)")


class PathHost(Protocol):
    """What a path needs of its client: the layout, the registration (context id and chunk geometry, as
    registered now), requests on the context, and lease renewal while a block is open."""

    @property
    def layout(self) -> KVLayout: ...
    @property
    def registration(self) -> Registration: ...
    def request(self, body, payload: Sequence = (), *, path: TransferPath | None = None, want_payload: bool = False): ...
    def finish(self, body): ...
    def release_behind(self, body) -> None: ...
    def pipeline(self, requests: list[tuple[object, Sequence]], on_reply=None, borrowed: bool = False) -> list: ...
    def stored_chunks(self, hashes: list[ChunkHash], salt: str, probe: bool = False) -> int: ...
    def holding(self, lease_id: int) -> AbstractContextManager[None]: ...


class TransferPath(Protocol):
    name: Transport

    def prepare_store(self, hashes: list[ChunkHash], salt: str, agent_session: str = "", token_ids: Sequence[int] = ()
                      ) -> AbstractContextManager[StoreSlots]: ...  # fmt: skip
    def prepare_retrieve(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> AbstractContextManager[list[np.ndarray]]: ...
    def store(self, hashes: list[ChunkHash], kv: np.ndarray, salt: str, agent_session: str = "", token_ids: Sequence[int] = ()) -> int: ...
    def retrieve_into(self, hashes: list[ChunkHash], salt: str, out: np.ndarray | None) -> np.ndarray: ...
    def close(self) -> None: ...


class PathChanged(Exception):
    """The server forgot our context and registering again brought a different path (a restarted
    server: a new arena). The request was not redone; the client redoes it on its new path."""


def leading_stored(statuses: list[SlotStatus]) -> int:
    return leading_run(s.holds for s in statuses)


def _lookup(host: PathHost, hashes: list[ChunkHash], salt: str, agent_session: str = "") -> int:
    """Leading chunks in L1 now (no lock, no prefetch); a turn of ``agent_session`` when named."""
    if not hashes:
        return 0
    body = m.LookupRequest(context_id=0, keys=list(hashes), cache_salt=salt, probe=True, agent_session=agent_session)
    return host.request(body).hits or 0


def _probe_before_store(host: PathHost, hashes: list[ChunkHash], salt: str, agent_session: str) -> int:
    """An inline store's look at what is there already, so it sends only the rest. The store request
    carries the agent session itself, and the server counts it as a turn only if the store was let in
    (one refused outright stored nothing): so the probe names no session, unless nothing is left to
    send, when it is the turn (as a store whose every chunk exists is one on the shm path)."""
    first = _lookup(host, hashes, salt)
    if first == len(hashes) and agent_session:
        first = _lookup(host, hashes, salt, agent_session)
    return first


def _copy_chunks(slots: StoreSlots, kv: np.ndarray, cs: int) -> None:
    for i, slot in enumerate(slots):
        if slot is not None:
            np.copyto(slot, kv[:, :, i * cs : (i + 1) * cs], casting="no")


# --- shm -------------------------------------------------------------------------------------------


class ShmPath:
    name = Transport.SHM

    def __init__(self, host: PathHost, arena: SharedArena, prefaulter: Prefaulter | None) -> None:
        self._host = host
        self.arena = arena
        self.prefaulter = prefaulter
        self._before_close: list[Callable[[], None]] | None = []  # None once closed
        self._hooks_lock = threading.Lock()
        self._geometry: tuple[int, int, np.dtype, tuple[int, ...]] | None = None  # (chunk_size, bytes, dtype, shape)

    def __repr__(self) -> str:
        return f"ShmPath({self.arena.path})"

    def before_close(self, fn: Callable[[], None]) -> bool:
        """Have ``fn`` run when this path closes, before the arena is unmapped (a GPU worker lets go of its
        ``cudaHostRegister`` of the mapping there: CUDA would keep the old pages registered under an
        address a new arena may be mapped at). False, and nothing kept, once the path has closed."""
        with self._hooks_lock:
            if self._before_close is None:
                return False
            self._before_close.append(fn)
        return True

    def close(self) -> None:
        with self._hooks_lock:
            hooks, self._before_close = self._before_close or [], None
        for fn in hooks:
            try:
                fn()
            except Exception:
                log.exception("kvdepot: a hook before closing %r failed", self)
        if self.prefaulter is not None:
            self.prefaulter.stop()
        self.arena.close()  # also drops our liveness lock

    def _usable(self) -> None:
        """Before asking for arena offsets: a fork() child of the process that mapped the arena is not
        watched by the server and may not use it (``SharedArena.forked``); it learns so before any lease
        is taken for it."""
        if self.arena.forked:
            raise TransportUnavailable(
                f"this process ({os.getpid()}) is a fork() of the one whose client mapped {self.arena.path}: "
                f"the server does not watch it, so it may not use arena slots; create a KVClient in this process"
            )

    def _slot(self, reg: Registration, offset: int, writable: bool) -> np.ndarray:
        """The chunk at ``offset`` as a ``[K, L, T, H, D]`` view of the arena: a slice of the arena's
        array, viewed and reshaped (a third of ``KVLayout.view_chunk``'s cost, per chunk per call)."""
        geometry = self._geometry
        if geometry is None or geometry[0] != reg.chunk_size:
            geometry = self._geometry = self._geometry_of(reg)
        _, nbytes, dtype, shape = geometry
        arr = self.arena.buffer[offset : offset + nbytes].view(dtype).reshape(shape)
        if not writable:
            arr.flags.writeable = False
        return arr

    def _geometry_of(self, reg: Registration) -> tuple[int, int, np.dtype, tuple[int, ...]]:
        layout = self._host.layout
        nbytes = layout.chunk_bytes(reg.chunk_size)
        if nbytes != reg.chunk_bytes:
            raise BadRequest(f"the server's chunks are {reg.chunk_bytes} bytes; this layout's are {nbytes} ({layout})")
        return reg.chunk_size, nbytes, layout.storage_dtype, layout.chunk_shape(reg.chunk_size)

    @contextmanager
    def prepare_store(self, hashes: list[ChunkHash], salt: str, agent_session: str = "", token_ids: Sequence[int] = ()) -> Iterator[StoreSlots]:
        h = self._host
        self._usable()
        body = m.PrepareStoreRequest(
            context_id=0, keys=list(hashes), cache_salt=salt, agent_session=agent_session,
            token_ids=_tokens_of(token_ids, 0, len(hashes), h.registration.chunk_size),
        )  # fmt: skip
        reply = h.request(body, path=self)
        reg = h.registration
        context_id = reg.context_id
        slots = StoreSlots(
            self._slot(reg, off, True) if st == SlotStatus.ALLOCATED else None for off, st in zip(reply.offsets, reply.statuses)
        )
        slots.statuses = slot_statuses(reply.statuses)
        with h.holding(reply.lease_id):
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
            self._host.finish(m.CommitStoreRequest(context_id=context_id, lease_id=lease_id, abort=abort))
        except Exception:
            if not abort:
                raise
            # An abort that fails (server gone, lease expired) leaves nothing behind: the lease ends.

    @contextmanager
    def prepare_retrieve(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> Iterator[list[np.ndarray]]:
        """Read-only views of the leading chunks L1 holds, locked. L1 first: with L2 tiers and no
        session (whose lookup brought them in already), only a run shorter than asked for costs a
        probe (the server brings what L2 has into L1, waited for) and a second lock; a whole L1 hit
        is one round trip. The first lock is held until the second is taken, then released behind:
        let go before the probe, its run could be evicted meanwhile (the watermark controller trims
        an L1 that a prefetch filled past its high watermark, a prompt's tail first), and the
        retrieve got less than L1 had held and than the lookup just before it said."""
        h = self._host
        self._usable()
        reply = self._lock(hashes, salt, session_id, start)
        if h.registration.l2_tiers and not session_id and len(reply.offsets) < len(hashes) - start:
            first, first_context = reply, h.registration.context_id
            try:
                with h.holding(first.lease_id):  # the probe may wait for L2: the heartbeat renews it
                    h.stored_chunks(hashes, salt, probe=True)
                    reply = self._lock(hashes, salt, session_id, start)
            finally:
                if first.lease_id:
                    h.release_behind(m.CommitRetrieveRequest(context_id=first_context, lease_id=first.lease_id))
        reg = h.registration
        context_id = reg.context_id
        views = [self._slot(reg, off, False) for off in reply.offsets]
        with h.holding(reply.lease_id):
            try:
                yield views
            finally:
                if reply.lease_id:
                    # Released behind, not waited for: while this process runs (and it does, it is
                    # here), the server keeps its read pins even past the lease's TTL (storage/l1.py,
                    # quarantine), so what was read is sound whatever the reply says. One round trip.
                    h.release_behind(m.CommitRetrieveRequest(context_id=context_id, lease_id=reply.lease_id))

    def _lock(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> m.PrepareRetrieveReply:
        req = m.PrepareRetrieveRequest(context_id=0, keys=list(hashes), cache_salt=salt, session_id=session_id, start=start)
        return self._host.request(req, path=self)

    def store(self, hashes: list[ChunkHash], kv: np.ndarray, salt: str, agent_session: str = "", token_ids: Sequence[int] = ()) -> int:
        with self.prepare_store(hashes, salt, agent_session, token_ids) as slots:
            _copy_chunks(slots, kv, self._host.registration.chunk_size)
        return leading_stored(slots.statuses)

    def retrieve_into(self, hashes: list[ChunkHash], salt: str, out: np.ndarray | None) -> np.ndarray:
        h = self._host
        cs = h.registration.chunk_size
        with self.prepare_retrieve(hashes, salt, "", 0) as views:
            n = len(views) * cs
            out = h.layout.empty(n) if out is None else _check_room(out, n)
            for i, view in enumerate(views):
                np.copyto(out[:, :, i * cs : (i + 1) * cs], view, casting="no")
        return out[:, :, :n]


# --- inline ----------------------------------------------------------------------------------------


class InlinePath:
    name = Transport.INLINE

    def __init__(self, host: PathHost) -> None:
        self._host = host
        self._staging = StagingPool()

    def __repr__(self) -> str:
        return f"InlinePath({self._staging!r})"

    def close(self) -> None:
        pass

    @property
    def _rows(self) -> int:
        lay = self._host.layout
        return lay.kv_factor * lay.num_layers

    def _send_store(self, hashes: list[ChunkHash], salt: str, first: int, chunk_frames: list[list], rpf: int,
                    agent_session: str = "", token_ids: Sequence[int] = (), borrowed: bool = False) -> list[SlotStatus]:  # fmt: skip
        """Store chunks ``hashes[first:]`` whose frames are ``chunk_frames`` as pipelined messages of
        about INLINE_BATCH_BYTES each: bounded memory on both ends, and the server copies one batch
        into L1 while the next is still on the wire. ``borrowed``: the frames are the caller's memory,
        which ZeroMQ must hold no more once this returns or raises."""
        h = self._host
        reg = h.registration
        per_batch = max(1, INLINE_BATCH_BYTES // reg.chunk_bytes)
        requests = []
        for i in range(first, len(hashes), per_batch):
            j = min(i + per_batch, len(hashes))
            body = m.StoreInlineRequest(
                context_id=reg.context_id, keys=list(hashes[:j]), cache_salt=salt, rows_per_frame=rpf, first=i, count=j - i,
                agent_session=agent_session, token_ids=_tokens_of(token_ids, i, j, reg.chunk_size),
            )
            requests.append((body, [f for frames in chunk_frames[i - first : j - first] for f in frames]))
        replies = h.pipeline(requests, borrowed=borrowed)
        return slot_statuses(s for r in replies for s in r.statuses)

    @contextmanager
    def prepare_store(self, hashes: list[ChunkHash], salt: str, agent_session: str = "", token_ids: Sequence[int] = ()) -> Iterator[StoreSlots]:
        h = self._host
        reg = h.registration
        first = _probe_before_store(h, hashes, salt, agent_session)  # skip sending what is already there
        n_new = len(hashes) - first
        buffer = self._staging.acquire(n_new * reg.chunk_bytes)  # this block's alone
        staging = buffer[: n_new * reg.chunk_bytes].reshape(n_new, reg.chunk_bytes)
        slots = StoreSlots([None] * first)
        slots.extend(h.layout.view_chunk(staging[i], reg.chunk_size) for i in range(n_new))
        slots.statuses = [SlotStatus.EXISTS] * first + [SlotStatus.ALLOCATED] * n_new
        try:
            yield slots  # an exception inside the block just drops the staging contents
        except BaseException:
            self._staging.release(buffer)
            raise
        if not n_new:
            self._staging.release(buffer)
            return
        max_frame = reg.max_frame_bytes
        rpf = codec.rows_per_frame_for(reg.chunk_bytes, self._rows, max_frame)
        frames = [codec.split_object(row, self._rows, rpf, max_frame) for row in staging]
        # On failure the buffer is dropped, not pooled: ZeroMQ may still be sending from it.
        slots.statuses[first:] = self._send_store(hashes, salt, first, frames, rpf, agent_session, token_ids)
        self._staging.release(buffer)

    def store(self, hashes: list[ChunkHash], kv: np.ndarray, salt: str, agent_session: str = "", token_ids: Sequence[int] = ()) -> int:
        """A C-contiguous ``kv`` goes without staging: each (k, layer) row of a chunk is contiguous in
        it, so it is sent as its own frame, straight from the caller's memory."""
        h = self._host
        reg = h.registration
        cs = reg.chunk_size
        row_bytes = reg.chunk_bytes // self._rows
        if not kv.flags.c_contiguous or row_bytes > reg.max_frame_bytes or row_bytes < (64 << 10):
            # Strided, rows too big for a frame, or so small that ZeroMQ would copy them anyway: stage.
            with self.prepare_store(hashes, salt, agent_session, token_ids) as slots:
                _copy_chunks(slots, kv, cs)
            return leading_stored(slots.statuses)
        first = _probe_before_store(h, hashes, salt, agent_session)
        if first == len(hashes):
            return len(hashes)
        frames = []
        for i in range(first, len(hashes)):
            rows = np.reshape(kv[:, :, i * cs : (i + 1) * cs], (self._rows, -1), copy=False)
            frames.append([memoryview(r).cast("B") for r in rows])
        # The caller's memory: after an error or a timeout it may reuse it at once, so none of it may stay
        # queued in ZeroMQ (it would be sent later, new bytes under these keys).
        statuses = [SlotStatus.EXISTS] * first + self._send_store(hashes, salt, first, frames, 1, agent_session, token_ids, borrowed=True)
        return leading_stored(statuses)

    def _fetch(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int, consume, n_found: int | None = None) -> int:
        """Fetch the stored chunks from ``start`` on as pipelined bounded replies.

        ``consume(chunk_index, frames, rows_per_frame)`` gets each chunk's checked frames as its reply
        arrives. Returns how many chunks (from ``start``) form the prefix that was delivered.
        """
        h = self._host
        reg = h.registration
        if session_id:
            # The session's locks decide what is found (a plain lookup cannot see chunks that are
            # locked but cleared meanwhile): one request, whose reply says how many.
            n_found, per_batch = len(hashes) - start, len(hashes)
        else:
            if n_found is None:
                # Objects are keyed per chunk, so this counts the stored run from ``start`` on.
                n_found = _lookup(h, hashes[start:], salt)
            per_batch = max(1, INLINE_BATCH_BYTES // reg.chunk_bytes)
        starts = list(range(start, start + n_found, per_batch))
        requests = [
            (
                m.RetrieveInlineRequest(
                    context_id=reg.context_id,
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
        max_frame = reg.max_frame_bytes

        def on_reply(index: int, reply: m.RetrieveInlineReply, frames: list) -> None:
            per = codec.check_payload(frames, reply.found, reg.chunk_bytes, self._rows, reply.rows_per_frame, max_frame, 0)
            got[index] = reply.found
            for k in range(reply.found):
                consume(starts[index] + k - start, frames[k * per : (k + 1) * per], reply.rows_per_frame)

        if requests:
            h.pipeline(requests, on_reply)
        # A prefix: stop at the first batch that came back short (evicted since the lookup).
        n = 0
        for index, s0 in enumerate(starts):
            n = s0 - start + got[index]
            if got[index] < min(per_batch, start + n_found - s0):
                break
        return n

    @contextmanager
    def prepare_retrieve(self, hashes: list[ChunkHash], salt: str, session_id: str, start: int) -> Iterator[list[np.ndarray]]:
        """Views of the leading stored chunks: a single-frame chunk is viewed where ZeroMQ received it;
        multi-frame chunks are joined into this block's own staging buffer as each reply arrives (so
        received frames are freed as we go), given back when the block exits."""
        h = self._host
        reg = h.registration
        n_found = len(hashes) - start if session_id else h.stored_chunks(hashes[start:], salt, probe=True)
        buffer = None
        # A chunk comes in one frame only when it fits both the senders' target and the frame limit
        # (codec.rows_per_frame_for): above either, its frames are joined here.
        if reg.chunk_bytes > min(codec.TARGET_FRAME_BYTES, reg.max_frame_bytes) and n_found:
            buffer = self._staging.acquire(n_found * reg.chunk_bytes)
        views: dict[int, np.ndarray] = {}

        def consume(i: int, parts: list, rows_per_frame: int) -> None:
            if len(parts) == 1:
                views[i] = h.layout.view_chunk(parts[0].buffer, reg.chunk_size, writable=False)
                return
            assert buffer is not None
            base = pos = i * reg.chunk_bytes
            for f in parts:
                src = np.frombuffer(f.buffer, np.uint8)
                buffer[pos : pos + src.size] = src
                pos += src.size
            views[i] = h.layout.view_chunk(buffer[base:pos], reg.chunk_size, writable=False)

        try:
            n = self._fetch(hashes, salt, session_id, start, consume, None if session_id else n_found)
            yield [views[i] for i in range(n)]
        finally:
            if buffer is not None:
                self._staging.release(buffer)  # the block is over: its views must not be used any more

    def retrieve_into(self, hashes: list[ChunkHash], salt: str, out: np.ndarray | None) -> np.ndarray:
        """Copy each received frame straight into its rows of ``out`` (already checked: the layout's
        storage dtype) as its reply arrives (one copy)."""
        h = self._host
        reg = h.registration
        if out is not None and not out.flags.c_contiguous:
            result = self.retrieve_into(hashes, salt, None)
            target = _check_room(out, result.shape[2])
            np.copyto(target[:, :, : result.shape[2]], result, casting="no")
            return target[:, :, : result.shape[2]]
        cs = reg.chunk_size
        n_found = h.stored_chunks(hashes, salt, probe=True)
        out = h.layout.empty(n_found * cs) if out is None else _check_room(out, n_found * cs)
        dtype = h.layout.storage_dtype
        rows_n = self._rows

        def consume(c: int, parts: list, rows_per_frame: int) -> None:
            rows = np.reshape(out[:, :, c * cs : (c + 1) * cs], (rows_n, -1), copy=False)
            if rows_per_frame == 0:  # byte-split frames: rows larger than a frame
                rows[...] = np.concatenate([np.frombuffer(f.buffer, dtype=dtype) for f in parts]).reshape(rows.shape)
                return
            r = 0
            for frame in parts:
                src = np.frombuffer(frame.buffer, dtype=dtype).reshape(-1, rows.shape[1])
                rows[r : r + src.shape[0]] = src
                r += src.shape[0]

        n = self._fetch(hashes, salt, "", 0, consume, n_found)
        return out[:, :, : n * cs]


def _check_room(out: np.ndarray, n_tokens: int) -> np.ndarray:
    if out.shape[2] < n_tokens:
        raise BadRequest(f"out holds {out.shape[2]} tokens, need at least {n_tokens}")
    return out


def _tokens_of(token_ids: Sequence[int], first: int, end: int, chunk_size: int) -> list[int]:
    """The tokens of chunks ``[first, end)`` as the wire carries them (``TOKEN_IDS_NOTE``), or none."""
    if not len(token_ids):
        return []
    return [int(t) for t in token_ids[first * chunk_size : end * chunk_size]]
