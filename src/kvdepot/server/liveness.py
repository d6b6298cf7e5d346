"""Which clients are alive. A client is gone when its process exits (same host: seen at once through a
pidfd), or when it has been silent longer than ``client_timeout_s`` with no request in flight.

Everything here runs on the RPC loop thread, so it needs no lock.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field

from kvdepot.protocol.messages import ClientInfo
from kvdepot.types import ClientId

log = logging.getLogger(__name__)


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def local_client_info() -> ClientInfo:
    return ClientInfo(pid=os.getpid(), hostname=socket.gethostname(), boot_id=boot_id(), pid_namespace=pid_namespace())


@dataclass(slots=True)
class ClientRecord:
    id: ClientId
    last_seen: float
    in_flight: int = 0
    pidfd: int = -1
    info: ClientInfo = field(default_factory=ClientInfo)


class LivenessTracker:
    def __init__(self, client_timeout_s: float, clock=time.monotonic) -> None:
        self._timeout = client_timeout_s
        self._clock = clock
        self._clients: dict[ClientId, ClientRecord] = {}
        self._by_pidfd: dict[int, ClientId] = {}
        self._me = local_client_info()

    def __len__(self) -> int:
        return len(self._clients)

    def register(self, client: ClientId, info: ClientInfo) -> ClientRecord:
        rec = self._clients.get(client)
        if rec is None:
            rec = self._clients[client] = ClientRecord(client, self._clock(), info=info)
            if self._same_pid_space(info):
                try:
                    rec.pidfd = os.pidfd_open(info.pid)
                    self._by_pidfd[rec.pidfd] = client
                except OSError as exc:  # already gone, or no permission: fall back to timeouts
                    log.debug("pidfd_open(%d) failed: %s", info.pid, exc)
        return rec

    def _same_pid_space(self, info: ClientInfo) -> bool:
        return (
            info.pid > 0
            and bool(info.boot_id)
            and info.boot_id == self._me.boot_id
            and info.pid_namespace == self._me.pid_namespace
            and hasattr(os, "pidfd_open")
        )

    def is_registered(self, client: ClientId) -> bool:
        return client in self._clients

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
        return [c.id for c in self._clients.values() if c.in_flight == 0 and now - c.last_seen > self._timeout]

    def forget(self, client: ClientId) -> None:
        rec = self._clients.pop(client, None)
        if rec is not None and rec.pidfd >= 0:
            self._by_pidfd.pop(rec.pidfd, None)
            os.close(rec.pidfd)

    def close(self) -> None:
        for client in list(self._clients):
            self.forget(client)
