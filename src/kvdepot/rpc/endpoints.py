"""One server per ipc:// socket path.

A Unix socket path can be bound again after ``unlink``, so a second server would silently take the
endpoint over from a live one (its clients then reach the wrong server, and the first becomes
unreachable). A server therefore holds an exclusive ``flock`` on ``PATH.lock`` for as long as it
serves ``ipc://PATH``. A held lock means a live server: refuse to start. A free lock with the socket
file still there means a server died without cleaning up: the stale socket is removed and bound anew.
At a clean exit the socket file is removed; the lock file stays (removing it would let two later
servers lock two different files of the same name).
"""

from __future__ import annotations

import fcntl
import os

from kvdepot.errors import EndpointInUse

__all__ = ["EndpointInUse", "IpcClaim"]


class IpcClaim:
    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1

    def __repr__(self) -> str:
        return f"IpcClaim({self.path!r}, held={self._fd >= 0})"

    def acquire(self) -> None:
        """Take the endpoint, or raise EndpointInUse naming it."""
        fd = os.open(self.path + ".lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EndpointInUse(
                f"ipc://{self.path}",
                f"another kvdepot server is serving ipc://{self.path} (it holds {self.path}.lock); "
                f"stop it or choose another --ipc-path",
            ) from None
        self._fd = fd
        try:
            os.unlink(self.path)  # left by a server that died: nobody serves it (the lock was free)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """Remove the socket file and give the endpoint up (call after the socket is closed)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1
