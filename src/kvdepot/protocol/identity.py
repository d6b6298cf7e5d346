"""Who a client says it is (``ClientInfo``): enough for a server on the same host to watch the
process (a pidfd) and free its leases the moment it dies. Used by clients to introduce themselves and
by the server to compare with its own."""

from __future__ import annotations

import os
import socket

from kvdepot.protocol.messages import ClientInfo


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
