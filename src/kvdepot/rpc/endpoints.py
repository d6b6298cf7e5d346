"""One server per ipc:// socket path.

A Unix socket path can be bound again after ``unlink``, so a second server would silently take the
endpoint over from a live one (its clients then reach the wrong server, and the first becomes
unreachable). A server therefore holds an exclusive ``flock`` on ``PATH.lock`` for as long as it
serves ``ipc://PATH``. A held lock means a live server: refuse to start. A free lock with the socket
file still there means a server died without cleaning up: the stale socket is removed and bound anew.
At a clean exit the socket file is removed; the lock file stays (removing it would let two later
servers lock two different files of the same name).

TCP endpoints on IPv6: ZeroMQ refuses an IPv6 address (``No such device``) unless the socket has
``ZMQ_IPV6`` set before it binds or connects, and ``tcp://HOST:PORT`` must bracket an IPv6 literal
(``tcp://[::1]:5555``; ``kvdepot.config.tcp_endpoint`` writes one). ``enable_ipv6`` sets the option
on a socket whose endpoints need it.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import stat
from collections.abc import Iterable

import zmq

from kvdepot.errors import EndpointInUse

__all__ = ["EndpointInUse", "IpcClaim", "enable_ipv6", "ipc_access_problem", "is_ipv6_endpoint"]


def is_ipv6_endpoint(endpoint: str) -> bool:
    """Does this ``tcp://`` endpoint name an IPv6 address (so its socket needs ``ZMQ_IPV6``)?
    (``kvdepot.config.is_ipv6_endpoint`` is the same test for the layers that read configuration: the
    RPC layer reads none, see tests/unit/test_imports.py.)"""
    if not endpoint.startswith("tcp://"):
        return False
    address = endpoint[len("tcp://") :]
    if address.startswith("["):  # only IPv6 is ever bracketed
        return True
    host = address.rsplit(":", 1)[0].split(";", 1)[-1]  # ZeroMQ's "SOURCE;DEST" form: the destination decides
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def enable_ipv6(sock: zmq.Socket, endpoints: Iterable[str] | str) -> None:
    """Set ``ZMQ_IPV6`` on ``sock`` when one of ``endpoints`` is IPv6; call before bind or connect.
    (Only then: with it set a wildcard ``*`` binds ``::`` instead of ``0.0.0.0``, and a host name may
    resolve to an IPv6 address the server does not listen on: an IPv4 set-up keeps what it had.)"""
    eps = [endpoints] if isinstance(endpoints, str) else endpoints
    if any(is_ipv6_endpoint(ep) for ep in eps):
        sock.setsockopt(zmq.IPV6, 1)


def ipc_access_problem(endpoint: str) -> str:
    """Why the file system keeps this process from connecting to ``ipc://PATH`` ('' when nothing does, or
    for another transport). ZeroMQ retries a refused connect quietly, so without this a socket of
    another user reads as a server that does not answer."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # @: Linux's abstract namespace
        return ""
    path = endpoint[len("ipc://") :]
    try:
        st = os.stat(path)
    except PermissionError:
        return (
            f"{path} cannot be reached by this process (uid {os.geteuid()}): a directory on the way to it does "
            f"not let it in (permission denied)"
        )
    except FileNotFoundError:
        return f"there is no socket at {path} (is the server running, with this --ipc-path?)"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        # connect(2) on a Unix socket needs write permission on it; the server's umask set its mode
        return (
            f"{path} (owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}) is not writable by this process "
            f"(uid {os.geteuid()}), and connecting to a Unix socket needs write permission (permission denied): "
            f"run the server under a umask that lets this user in (a shared group and umask 007), or connect over tcp://"
        )
    return ""


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
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError:
            os.close(fd)
            raise
        if mode is not None and not stat.S_ISSOCK(mode):
            # Only a socket can be a dead server's: anything else there (a file named by mistake, a
            # directory) is someone's, and is never removed.
            os.close(fd)
            raise FileExistsError(errno.EEXIST, "exists and is not a socket: give --ipc-path a path of its own", self.path)
        self._fd = fd
        if mode is not None:
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
