"""Which clients are alive, and which may still touch the arena.

A client is gone when its process exits (same host: seen at once through a pidfd), or when it has been
silent longer than ``client_timeout_s`` with no request in flight. Silence is not death: a process
paused by SIGSTOP, a debugger, a long GC or a stalled VM is silent and alive, and on the shm path it
holds writable views of arena slots that the server cannot take back. So a silent client is *revoked*,
not forgotten, while it may still run::

    (new) ──register──► ACTIVE ──process exited / clean goodbye──► (forgotten)
                          │  ▲
       revoke (missed     │  │ resume (it registers again)
       heartbeats)        ▼  │
                        REVOKED ──process exited──► (forgotten)

``ClientRecord.revoke`` and ``ClientRecord.resume`` are the two transitions between states; each checks
the state it leaves and raises IllegalTransition (changing nothing) from the other one. A revoked client
keeps its record (pidfd, liveness lock) until its process is gone, so the object table can keep the
space it could still write to in quarantine; the client's next request learns what happened
(``take_notice``). Whether a client "may still touch the arena" is answered by its liveness lock in the
arena file (any PID namespace) or its pidfd (same PID namespace).

Threads: the tracker belongs to the RPC loop thread (registration and goodbyes are SYNC handlers, and
``ClientWatch.sweep`` runs in the loop's housekeeping). Two things may be asked from any thread:
``snapshot()`` (``/status``, built on the HTTP thread, reads an immutable snapshot the loop thread
publishes after each change) and ``take_notice()`` (a BLOCKING handler may be the first to see a revoked
client), which has its own lock.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvdepot.errors import IllegalTransition
from kvdepot.protocol.identity import local_client_info
from kvdepot.protocol.messages import ClientInfo
from kvdepot.types import ClientId

log = logging.getLogger(__name__)

MAX_PID = 1 << 22  # Linux's PID_MAX_LIMIT
MAX_NOTICES = 4096  # revocation notices kept for clients whose records are gone


def check_client_info(info: ClientInfo) -> str:
    """Why ``info`` cannot be accepted ('' when it can)."""
    if not 0 <= info.pid < MAX_PID:
        return f"pid {info.pid} is outside [0, {MAX_PID})"
    if not 0 <= info.pid_namespace < 1 << 64:
        return f"pid_namespace {info.pid_namespace} is not an inode number"
    if len(info.hostname) > 255 or len(info.boot_id) > 64:
        return "hostname or boot_id is too long"
    return ""


class ClientState(enum.Enum):
    ACTIVE = "active"
    REVOKED = "revoked"


@dataclass(frozen=True, slots=True)
class Revocation:
    why: str
    at: float  # wall-clock time

    def message(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at))
        return (
            f"this client was declared gone at {stamp} ({self.why}); its leases were revoked, nothing it was "
            f"writing was kept, and it must register again"
        )


@dataclass(slots=True)
class ClientRecord:
    id: ClientId
    last_seen: float
    in_flight: int = 0
    pidfd: int = -1
    lock_offset: int = -1  # its liveness lock in the arena file (-1: the client was offered no arena)
    lock_seen: bool = False  # the liveness lock was seen held at least once
    state: ClientState = ClientState.ACTIVE
    revocation: Revocation | None = None
    info: ClientInfo = field(default_factory=ClientInfo)

    def revoke(self, revocation: Revocation) -> None:
        """ACTIVE -> REVOKED: it went silent while its process may still run."""
        self._require(ClientState.ACTIVE, "revoke")
        self.state, self.revocation = ClientState.REVOKED, revocation

    def resume(self) -> None:
        """REVOKED -> ACTIVE: it registered again (it was paused, not dead)."""
        self._require(ClientState.REVOKED, "resume")
        self.state, self.revocation = ClientState.ACTIVE, None

    def _require(self, state: ClientState, what: str) -> None:
        if self.state is not state:
            raise IllegalTransition(f"client {self.id.hex()[:12]} is {self.state.value}, cannot {what}")


@dataclass(frozen=True, slots=True)
class ClientView:
    """What ``/status`` shows of one client."""

    pid: int
    hostname: str
    state: ClientState


@dataclass(frozen=True, slots=True)
class LivenessSnapshot:
    """An immutable picture of the tracker, safe to read from any thread."""

    clients: Mapping[ClientId, ClientView]

    @property
    def active(self) -> int:
        return sum(1 for c in self.clients.values() if c.state is ClientState.ACTIVE)


_EMPTY = LivenessSnapshot(MappingProxyType({}))


class LivenessTracker:
    def __init__(
        self,
        client_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        lock_held: Callable[[int], bool] | None = None,
    ) -> None:
        self._timeout = client_timeout_s
        self._clock = clock
        self._lock_held = lock_held
        self._clients: dict[ClientId, ClientRecord] = {}
        self._by_pidfd: dict[int, ClientId] = {}
        self._notices: OrderedDict[ClientId, Revocation] = OrderedDict()
        self._notices_lock = threading.Lock()
        self._snapshot = _EMPTY
        self._me = local_client_info()

    def __repr__(self) -> str:
        snap = self._snapshot
        return f"LivenessTracker(active={snap.active}, revoked={len(snap.clients) - snap.active})"

    @property
    def timeout_s(self) -> float:
        return self._timeout

    # --- life cycle (loop thread) --------------------------------------------------------------------

    def register(self, client: ClientId, info: ClientInfo, lock_offset: int = -1) -> ClientRecord:
        """A client registered a context: a new record (ACTIVE), a known one refreshed, or a revoked one
        resumed."""
        rec = self._clients.get(client)
        if rec is None:
            rec = self._clients[client] = ClientRecord(client, self._clock(), info=info)
            if self._same_pid_space(info):
                try:
                    rec.pidfd = os.pidfd_open(info.pid)
                    self._by_pidfd[rec.pidfd] = client
                except OSError as exc:  # already gone, or no permission: fall back to timeouts
                    log.debug("pidfd_open(%d) failed: %s", info.pid, exc)
        elif rec.state is ClientState.REVOKED:
            log.info("client %s (pid %d) is back after its revocation", client.hex()[:12], rec.info.pid)
            rec.resume()
        rec.last_seen = self._clock()
        if lock_offset >= 0:
            rec.lock_offset = lock_offset
        self._publish()
        return rec

    def revoke(self, client: ClientId, why: str) -> bool:
        """The client went silent. Keep it (REVOKED) while it may still touch the arena; returns whether
        it was kept. Either way its next request is told why (``take_notice``)."""
        rec = self._clients.get(client)
        revocation = Revocation(why, time.time())
        with self._notices_lock:
            self._notices[client] = revocation
            self._notices.move_to_end(client)
            while len(self._notices) > MAX_NOTICES:
                self._notices.popitem(last=False)
        if rec is None:
            return False
        if self.may_touch_arena(client):
            rec.revoke(revocation)
            self._publish()
            return True
        self.forget(client)
        return False

    def forget(self, client: ClientId) -> None:
        rec = self._clients.pop(client, None)
        if rec is not None:
            if rec.pidfd >= 0:
                self._by_pidfd.pop(rec.pidfd, None)
                os.close(rec.pidfd)
            self._publish()

    def close(self) -> None:
        for client in list(self._clients):
            self.forget(client)

    # --- any thread ----------------------------------------------------------------------------------

    def snapshot(self) -> LivenessSnapshot:
        return self._snapshot

    def take_notice(self, client: ClientId) -> Revocation | None:
        """The revocation this client has not been told about yet (told once)."""
        with self._notices_lock:
            return self._notices.pop(client, None)

    # --- what the server asks (loop thread) ----------------------------------------------------------

    def record(self, client: ClientId) -> ClientRecord | None:
        return self._clients.get(client)

    def may_touch_arena(self, client: ClientId) -> bool:
        """Could a process of this client still read or write arena memory it was given?"""
        rec = self._clients.get(client)
        if rec is None:
            return False
        if rec.lock_offset >= 0 and self._lock_held is not None and self._lock_held(rec.lock_offset):
            return True
        return rec.pidfd >= 0 and not _exited(rec.pidfd)

    def watchable(self, client: ClientId) -> bool:
        """Can the server tell when this client's process is gone? Only such clients may be given arena
        offsets: otherwise a paused one could write into reused space, or its space could never come back."""
        rec = self._clients.get(client)
        if rec is None:
            return False
        if rec.pidfd >= 0:
            return True
        if not rec.lock_seen and rec.lock_offset >= 0 and self._lock_held is not None:
            rec.lock_seen = self._lock_held(rec.lock_offset)
        return rec.lock_seen

    def request_started(self, client: ClientId) -> None:
        rec = self._clients.get(client)
        if rec is not None:
            rec.last_seen = self._clock()
            rec.in_flight += 1

    def request_finished(self, client: ClientId) -> None:
        rec = self._clients.get(client)
        if rec is not None:
            rec.last_seen = self._clock()
            rec.in_flight = max(0, rec.in_flight - 1)

    def pidfds(self) -> list[int]:
        return list(self._by_pidfd)

    def client_of_pidfd(self, fd: int) -> ClientId | None:
        return self._by_pidfd.get(fd)

    def timed_out(self) -> list[ClientId]:
        now = self._clock()
        return [
            c.id
            for c in self._clients.values()
            if c.state is ClientState.ACTIVE and c.in_flight == 0 and now - c.last_seen > self._timeout
        ]

    def vanished(self) -> list[ClientId]:
        """Revoked clients whose process is now gone (for those watched by a lock only: polled)."""
        return [c.id for c in self._clients.values() if c.state is ClientState.REVOKED and not self.may_touch_arena(c.id)]

    # --- internals -----------------------------------------------------------------------------------

    def _same_pid_space(self, info: ClientInfo) -> bool:
        return (
            info.pid > 0
            and bool(info.boot_id)
            and info.boot_id == self._me.boot_id
            and info.pid_namespace == self._me.pid_namespace
            and hasattr(os, "pidfd_open")
        )

    def _publish(self) -> None:
        """A new snapshot for other threads (a reference swap: readers see the old one or the new one)."""
        self._snapshot = LivenessSnapshot(
            MappingProxyType({c.id: ClientView(c.info.pid, c.info.hostname, c.state) for c in self._clients.values()})
        )


ClientGone = Callable[[ClientId, str, bool], None]  # (client, why, exited)


class ClientWatch:
    """The loop thread's check of every client, run from the RPC loop's housekeeping: a client whose
    process exited (its pidfd became readable, or a revoked client's liveness lock was released) is
    ended and forgotten; one silent past the timeout is revoked. ``on_gone(client, why, exited)`` cleans
    up after it (its contexts, sessions and leases) while its record still says what it may touch."""

    def __init__(self, tracker: LivenessTracker, on_gone: ClientGone) -> None:
        self._tracker = tracker
        self._on_gone = on_gone
        self._poll = select.poll()
        self._watched: set[int] = set()

    def sweep(self) -> None:
        t = self._tracker
        current = set(t.pidfds())
        for fd in self._watched - current:  # forgotten clients: their pidfd is already closed
            self._poll.unregister(fd)
        for fd in current - self._watched:
            self._poll.register(fd, select.POLLIN)
        for fd, _ in self._poll.poll(0):
            client = t.client_of_pidfd(fd)
            self._poll.unregister(fd)
            current.discard(fd)
            if client is not None:
                self._gone(client, "process exited", exited=True)
        for client in t.vanished():
            self._gone(client, "process exited", exited=True)
        for client in t.timed_out():
            self._gone(client, f"no request or heartbeat for {t.timeout_s:g} s", exited=False)
        self._watched = {fd for fd in current if t.client_of_pidfd(fd) is not None}

    def _gone(self, client: ClientId, why: str, exited: bool) -> None:
        """Clean up after the client, then forget it (it exited) or revoke it (it went silent: it may be
        paused, not dead)."""
        try:
            self._on_gone(client, why, exited)
        except Exception:
            log.exception("cleaning up after client %s failed", client.hex())
        finally:
            if exited:
                self._tracker.forget(client)
            else:
                self._tracker.revoke(client, why)


def _exited(pidfd: int) -> bool:
    poll = select.poll()  # not select(): a pidfd may be numbered above FD_SETSIZE
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))
