"""Which clients are alive, and which may still touch the arena.

A client is gone when its process exits (same host: seen at once through a pidfd), or when it has been
silent longer than ``client_timeout_s`` with no request in flight. Silence is not death: a process
paused by SIGSTOP, a debugger, a long GC or a stalled VM is silent and alive, and on the shm path it
holds writable views of arena slots that the server cannot take back. So a silent client is *revoked*,
not forgotten, while it may still run::

    (new) ──register──► ACTIVE ──process exited / clean goodbye──► (forgotten)
                          │  ▲
        missed heartbeats │  │ register again (it resumed)
                          ▼  │
                        REVOKED ──process exited──► (forgotten)

A revoked client keeps its record (pidfd, liveness lock) until its process is gone, so the object
table can keep the space it could still write to in quarantine; the client's next request learns what
happened (``take_notice``). Whether a client "may still touch the arena" is answered by its liveness
lock in the arena file (any PID namespace) or its pidfd (same PID namespace).

Everything here runs on the RPC loop thread, so it needs no lock.
"""

from __future__ import annotations

import enum
import logging
import os
import select
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

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
        self._me = local_client_info()

    @property
    def timeout_s(self) -> float:
        return self._timeout

    def __len__(self) -> int:
        return sum(1 for c in self._clients.values() if c.state is ClientState.ACTIVE)

    # --- life cycle ----------------------------------------------------------------------------------

    def register(self, client: ClientId, info: ClientInfo, lock_offset: int = -1) -> ClientRecord:
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
            rec.state, rec.revocation = ClientState.ACTIVE, None
        rec.last_seen = self._clock()
        if lock_offset >= 0:
            rec.lock_offset = lock_offset
        return rec

    def revoke(self, client: ClientId, why: str) -> bool:
        """The client went silent. Keep it (REVOKED) while it may still touch the arena; returns whether
        it was kept. Either way its next request is told why (``take_notice``)."""
        rec = self._clients.get(client)
        revocation = Revocation(why, time.time())
        self._notices[client] = revocation
        self._notices.move_to_end(client)
        while len(self._notices) > MAX_NOTICES:
            self._notices.popitem(last=False)
        if rec is None:
            return False
        if self.may_touch_arena(client):
            rec.state, rec.revocation = ClientState.REVOKED, revocation
            return True
        self.forget(client)
        return False

    def take_notice(self, client: ClientId) -> Revocation | None:
        """The revocation this client has not been told about yet (told once)."""
        return self._notices.pop(client, None)

    def forget(self, client: ClientId) -> None:
        rec = self._clients.pop(client, None)
        if rec is not None and rec.pidfd >= 0:
            self._by_pidfd.pop(rec.pidfd, None)
            os.close(rec.pidfd)

    def close(self) -> None:
        for client in list(self._clients):
            self.forget(client)

    # --- what the server asks ------------------------------------------------------------------------

    def is_registered(self, client: ClientId) -> bool:
        rec = self._clients.get(client)
        return rec is not None and rec.state is ClientState.ACTIVE

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

    def _same_pid_space(self, info: ClientInfo) -> bool:
        return (
            info.pid > 0
            and bool(info.boot_id)
            and info.boot_id == self._me.boot_id
            and info.pid_namespace == self._me.pid_namespace
            and hasattr(os, "pidfd_open")
        )

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

    def revoked(self) -> list[ClientRecord]:
        return [c for c in self._clients.values() if c.state is ClientState.REVOKED]


def _exited(pidfd: int) -> bool:
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)
