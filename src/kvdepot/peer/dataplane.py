"""The data plane: pages from an owner's pool straight into a reader's buffer, over TCP.

The transport is an interface (``Transport``), so RDMA or NIXL can come later; this one is plain TCP,
the fallback every network has. After the handshake (``auth.py``) a connection carries read requests::

    request   "RDRQ" count(u32), then per page: key length(u16) generation(u64) offset(u64) length(u64) key
    reply     per page: status(u8) pad(7) length(u64), then ``length`` bytes when status is OK

The owner serves only a published (key, generation) at the offset and length its record names, pinned
while it is sent (``pool.py``), straight from pool memory (no copy); anything else is MISSING. The reader
receives straight into the destination (``recv_into``) and checks the page against the checksum its
directory record carries: garbage, a stall past the deadline or a connection closed mid-page make that
page and the rest of the request misses, and the connection is closed, never reused.

Connections are per peer, made lazily, reused through a free list and capped at
``max_channels_per_peer``, so several reader threads read one peer at once; a thread beyond the cap
waits (within its deadline) for one to come back.
"""

from __future__ import annotations

import enum
import logging
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvdepot.config import host_port
from kvdepot.peer.addresses import listen_family
from kvdepot.peer.auth import HandshakeFailed, client_handshake, recv_exact, serve_handshake
from kvdepot.peer.pool import PoolEntry

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<4sI")
_ITEM = struct.Struct("<HQQQ")
_REPLY = struct.Struct("<B7xQ")
REQUEST_MAGIC = b"RDRQ"
MAX_PAGES_PER_REQUEST = 4096
MAX_KEY_BYTES = 1024
MAX_CONNECTIONS = 1024  # readers' connections served at once; more are closed at once
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that does not prove the secret by then is closed
ACCEPT_RETRY_S = 0.05  # after a failed accept (out of file descriptors): wait, then go on
# TCP keep-alive on every data connection: an idle pooled connection whose other end lost power or sits
# behind a partition is found dead (and its thread and descriptor freed) in about 2 minutes, not never.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 6


def keep_alive(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's defaults apply
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
OK, MISSING = 0, 1


class PageOutcome(enum.IntEnum):
    MISS = 0  # absent, stale, unreachable, too slow: the page was not read
    HIT = 1  # read whole and verified
    CORRUPT = 2  # bytes arrived that do not match the page's checksum (never handed out)


class PageSource(Protocol):
    """What the server reads pages from (the published pool)."""

    def acquire(self, key: bytes, generation: int = 0) -> PoolEntry | None: ...

    def release(self, entry: PoolEntry) -> None: ...

    def view(self, entry: PoolEntry) -> memoryview: ...


@dataclass(frozen=True, slots=True)
class PageRead:
    """One page to read: which (key, generation, range) the directory named, its checksum, and where
    it goes (a writable buffer of exactly ``length`` bytes)."""

    key: bytes
    generation: int
    offset: int
    length: int
    checksum: bytes
    dest: memoryview


@dataclass(slots=True)
class ReadProgress:
    """What a read received, filled in by ``Transport.read`` as bytes arrive: a read cut short by its
    deadline while a page was still arriving measured the link (bytes over the time until the last of
    them), where one that waited on nothing at all did not."""

    bytes: int = 0  # page bytes received, whole pages and the one cut short
    last_byte_at: float = 0.0  # perf_counter when the last of them arrived
    cut_mid_page: bool = False  # the read ended with a page part-way in


@dataclass(frozen=True, slots=True)
class ReadStats:
    pages: int
    bytes: int
    seconds: float


class Transport(Protocol):
    def read(self, host: str, port: int, pages: Sequence[PageRead], deadline: float,
             progress: ReadProgress | None = None) -> list[PageOutcome]:  # fmt: skip
        """Per page: read and verified, or why not. ``progress``: filled in with what arrived."""
        ...

    def forget(self, host: str, port: int) -> None:
        """Drop every idle connection to a peer (it left the cluster)."""
        ...

    def close(self) -> None: ...


# --- the owner's side ---------------------------------------------------------------------------------


REFUSAL_LOG_INTERVAL_S = 10.0


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket: IPv6 for an IPv6 host (``::`` takes IPv4 readers too, as the control
    port's ZeroMQ socket does), IPv4 otherwise as before."""
    family = listen_family(host)
    dualstack = family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6()
    return socket.create_server((host, port), family=family, backlog=128, reuse_port=False, dualstack_ipv6=dualstack)


class DataServer:
    """Accepts readers on ``host:port`` (0 picks a free port) and serves each connection on a thread."""

    def __init__(self, source: PageSource, secret: bytes, host: str = "127.0.0.1", port: int = 0, send_timeout_s: float = 30.0) -> None:
        self._source = source
        self._secret = secret
        self._send_timeout = send_timeout_s  # a reader that stops reading cannot pin a page longer
        self._listener = _listen(host, port)
        self.port = self._listener.getsockname()[1]
        self._closing = threading.Event()
        self._conns: set[socket.socket] = set()
        # Of those, the ones that have not proved the secret yet, oldest first: at the cap, the oldest
        # of them makes way for a new connection, so strangers that never finish a handshake cannot
        # hold every place (a reader's handshake takes a round trip, theirs HANDSHAKE_TIMEOUT_S).
        self._handshaking: dict[socket.socket, None] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.refused = 0  # handshakes that failed
        self._refusal_logged = -1e9  # when a refusal was last logged (a node without the secret retries per read)
        self.served_pages = 0
        self.served_bytes = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name="kvdepot-peer-data", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _accept_loop(self) -> None:
        """Accept until closed. A failed accept (no file descriptor or memory left for a moment) or a
        thread that cannot start costs that one connection, never the loop: a node whose loop ended
        would keep publishing pages nobody could read."""
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closing.is_set():
                    return
                self._say_refused(f"cannot accept a connection ({exc})")
                time.sleep(ACCEPT_RETRY_S)  # EMFILE and the like: they pass as connections close
                continue
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                keep_alive(conn)
                with self._lock:
                    if len(self._conns) >= MAX_CONNECTIONS:
                        self.refused += 1  # one thread per connection: a flood must not take the host's threads
                        victim = next(iter(self._handshaking), None)
                        if victim is None:
                            self._say_refused(f"{MAX_CONNECTIONS} connections are open: a new one was closed")
                            conn.close()
                            continue
                        del self._handshaking[victim]
                        self._conns.discard(victim)
                        self._say_refused(f"{MAX_CONNECTIONS} connections are open: the oldest one still in its handshake was closed")
                        try:
                            victim.shutdown(socket.SHUT_RDWR)  # its thread ends at once
                        except OSError:
                            pass
                    self._conns.add(conn)
                    self._handshaking[conn] = None
                self._start_serving(conn)
            except (OSError, RuntimeError) as exc:  # RuntimeError: "can't start new thread"
                with self._lock:
                    self._conns.discard(conn)
                    self._handshaking.pop(conn, None)
                conn.close()
                self._say_refused(f"cannot serve a connection ({type(exc).__name__}: {exc})")

    def _start_serving(self, conn: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(conn,), name="kvdepot-peer-conn", daemon=True).start()

    def _say_refused(self, why: str) -> None:
        now = time.monotonic()
        if now - self._refusal_logged >= REFUSAL_LOG_INTERVAL_S:  # counted every time, said once in a while
            self._refusal_logged = now
            log.warning("peer data plane: %s (%d refused so far)", why, self.refused)

    def _serve(self, conn: socket.socket) -> None:
        try:
            # The whole handshake within HANDSHAKE_TIMEOUT_S, not each receive: a byte now and then
            # must not hold a connection (and its thread) that never proves the secret.
            serve_handshake(conn, self._secret, deadline=time.monotonic() + HANDSHAKE_TIMEOUT_S)
            with self._lock:
                self._handshaking.pop(conn, None)
            conn.settimeout(None)  # an idle pooled connection waits for its next request (keep-alive ends a dead one)
            while not self._closing.is_set():
                head = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
                if len(head) < _REQUEST.size:
                    return  # the reader closed it
                magic, count = _REQUEST.unpack(head)
                if magic != REQUEST_MAGIC or count > MAX_PAGES_PER_REQUEST:
                    log.warning("peer data plane: malformed request (%r, %d pages): connection closed", magic, count)
                    return
                conn.settimeout(self._send_timeout)
                items = []
                for _ in range(count):
                    key_len, generation, offset, length = _ITEM.unpack(recv_exact(conn, _ITEM.size))
                    if key_len > MAX_KEY_BYTES:
                        log.warning("peer data plane: key of %d bytes: connection closed", key_len)
                        return
                    items.append((recv_exact(conn, key_len), generation, offset, length))
                for key, generation, offset, length in items:
                    self._send_page(conn, key, generation, offset, length)
                conn.settimeout(None)
        except HandshakeFailed as exc:
            self.refused += 1
            self._say_refused(str(exc))
        except (OSError, ConnectionError, struct.error):
            pass  # the reader went away or stalled past the send timeout
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._handshaking.pop(conn, None)
            conn.close()

    def _send_page(self, conn: socket.socket, key: bytes, generation: int, offset: int, length: int) -> None:
        entry = self._source.acquire(key, generation)
        if entry is None or entry.offset != offset or entry.length != length:
            if entry is not None:
                self._source.release(entry)
            conn.sendall(_REPLY.pack(MISSING, 0))
            return
        try:
            conn.sendall(_REPLY.pack(OK, length))
            conn.sendall(self._source.view(entry))  # straight from pool memory
            self.served_pages += 1
            self.served_bytes += length
        finally:
            self._source.release(entry)


# --- the reader's side --------------------------------------------------------------------------------


_TIMEVAL = struct.Struct("@ll")
RECV_PIECE_BYTES = 256 << 10  # what a reader receives per call and hashes at once (fits a core's cache)


def _arm(conn: socket.socket, deadline: float) -> None:
    """Bound the next blocking send and receive calls on ``conn`` by what is left of ``deadline``.

    Readers' sockets are blocking with kernel timeouts (SO_RCVTIMEO/SO_SNDTIMEO) rather than Python's
    own timeout mode, which turns every call into poll + a non-blocking call: a page then arrives in
    one ``recv_into(MSG_WAITALL)`` instead of dozens of slices, each taking the GIL that the other
    reader threads want. A call past its timeout raises BlockingIOError (an OSError): the read fails."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    seconds = int(remaining)
    timeval = _TIMEVAL.pack(seconds, max(1, int((remaining - seconds) * 1e6)))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class _PeerChannels:
    """Idle connections to one peer, and a cap on how many exist."""

    def __init__(self, cap: int) -> None:
        self.idle: list[socket.socket] = []
        self.slots = threading.BoundedSemaphore(cap)
        self.lock = threading.Lock()


class TcpTransport:
    def __init__(self, secret: bytes, max_channels_per_peer: int = 16, connect_timeout_s: float = 2.0) -> None:
        if max_channels_per_peer < 1:
            raise ValueError("max_channels_per_peer must be at least 1")
        self._secret = secret
        self._cap = max_channels_per_peer
        self._connect_timeout = connect_timeout_s
        self._peers: dict[tuple[str, int], _PeerChannels] = {}
        self._lock = threading.Lock()
        self._refusal_logged: dict[tuple[str, int], float] = {}  # peer -> when its refusal was last logged
        self.dropped = 0  # connections closed after a failure
        self.garbage = 0  # pages whose bytes did not match their checksum

    def read(self, host: str, port: int, pages: Sequence[PageRead], deadline: float,
             progress: ReadProgress | None = None) -> list[PageOutcome]:  # fmt: skip
        out = [PageOutcome.MISS] * len(pages)
        progress = progress if progress is not None else ReadProgress()
        if not pages:
            return out
        peer = self._channels(host, port)
        if not peer.slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return out  # every channel to this peer is busy past our deadline
        try:
            conn = self._lease(peer, host, port, deadline)
            if conn is None:
                return out
            healthy = False
            try:
                # An owner takes at most MAX_PAGES_PER_REQUEST pages a request (a long prompt of small
                # pages asks for more): one request per slice, on the same connection.
                for first in range(0, len(pages), MAX_PAGES_PER_REQUEST):
                    healthy = self._exchange(conn, pages[first : first + MAX_PAGES_PER_REQUEST], out, deadline, first, progress)
                    if not healthy:
                        break
            except (OSError, ConnectionError) as exc:
                healthy = False  # an earlier slice's True says nothing of this one: its replies may still be in flight
                log.info("peer %s: read failed (%s): the rest are misses", host_port(host, port), exc)
            finally:
                if healthy:
                    with peer.lock:
                        peer.idle.append(conn)
                else:
                    self.dropped += 1
                    conn.close()
            return out
        finally:
            peer.slots.release()

    def _channels(self, host: str, port: int) -> _PeerChannels:
        with self._lock:
            peer = self._peers.get((host, port))
            if peer is None:
                peer = self._peers[(host, port)] = _PeerChannels(self._cap)
            return peer

    def _lease(self, peer: _PeerChannels, host: str, port: int, deadline: float) -> socket.socket | None:
        with peer.lock:
            if peer.idle:
                return peer.idle.pop()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        conn: socket.socket | None = None
        try:
            conn = socket.create_connection((host, port), timeout=min(remaining, self._connect_timeout))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            keep_alive(conn)
            client_handshake(conn, self._secret, deadline)  # within the read's deadline, not per receive
            conn.settimeout(None)  # blocking from now on; deadlines are the kernel's (_arm)
            return conn
        except HandshakeFailed as exc:
            now = time.monotonic()
            if now - self._refusal_logged.get((host, port), -1e9) >= REFUSAL_LOG_INTERVAL_S:  # retried on every read
                self._refusal_logged[(host, port)] = now
                log.warning("peer %s: %s", host_port(host, port), exc)
        except OSError as exc:
            log.info("peer %s: cannot connect (%s)", host_port(host, port), exc)
        if conn is not None:
            conn.close()
        return None

    def _exchange(self, conn: socket.socket, pages: Sequence[PageRead], out: list[PageOutcome], deadline: float, first: int = 0,
                  progress: ReadProgress | None = None) -> bool:  # fmt: skip
        """Send one request for every page, receive each into its destination (its outcome goes to
        ``out[first + i]``). True: the connection is in a clean state (every reply read whole) and may
        be reused."""
        parts = [_REQUEST.pack(REQUEST_MAGIC, len(pages))]
        for p in pages:
            parts.append(_ITEM.pack(len(p.key), p.generation, p.offset, p.length))
            parts.append(p.key)
        progress = progress if progress is not None else ReadProgress()
        _arm(conn, deadline)
        conn.sendall(b"".join(parts))
        for i, p in enumerate(pages):
            _arm(conn, deadline)
            status, length = _REPLY.unpack(recv_exact(conn, _REPLY.size))
            if status == MISSING:
                continue
            if status != OK or length != p.length or p.dest.nbytes != length:
                log.warning("peer data plane: reply of %d bytes (status %d) for a page of %d: connection dropped", length, status, p.length)
                return False
            view = p.dest
            running = xxhash.xxh3_128()
            got = 0
            while got < length:
                # A piece per call, the GIL released throughout, hashed while it is still in the cache
                # and while the next piece arrives (one hash pass over the whole page afterwards read it
                # from memory again, with the socket idle). A call returns short only when the armed
                # timeout fires (the deadline has passed) or a signal interrupts it.
                want = min(RECV_PIECE_BYTES, length - got)
                if got:
                    # SO_RCVTIMEO bounds one call, not the page: re-armed per piece, or a page that
                    # keeps arriving, only slowly (a rate-limited link), ran on long past the deadline.
                    try:
                        _arm(conn, deadline)
                    except OSError:
                        progress.cut_mid_page = True
                        raise
                try:
                    k = conn.recv_into(view[got : got + want], want, socket.MSG_WAITALL)
                except OSError:
                    progress.cut_mid_page = got > 0
                    raise
                if k == 0:
                    progress.cut_mid_page = got > 0
                    raise ConnectionError("peer closed the connection mid-page")
                running.update(view[got : got + k])
                got += k
                progress.bytes += k
                progress.last_byte_at = time.perf_counter()
            if running.digest() != p.checksum:
                self.garbage += 1
                out[first + i] = PageOutcome.CORRUPT
                log.warning("peer data plane: a page failed its checksum: a miss, connection dropped")
                return False
            out[first + i] = PageOutcome.HIT
        return True

    def forget(self, host: str, port: int) -> None:
        with self._lock:
            peer = self._peers.pop((host, port), None)
            self._refusal_logged.pop((host, port), None)
        if peer is not None:
            with peer.lock:
                for conn in peer.idle:
                    conn.close()
                peer.idle.clear()

    def close(self) -> None:
        with self._lock:
            peers = list(self._peers)
        for host, port in peers:
            self.forget(host, port)
