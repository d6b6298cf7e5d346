"""Exceptions and the wire error codes.

``ErrorCode`` values travel on the wire: they are explicit and only ever appended to.
"""

from __future__ import annotations

import errno
from enum import IntEnum


class ErrorCode(IntEnum):
    OK = 0
    INTERNAL = 1
    BAD_REQUEST = 2
    UNKNOWN_REQUEST_TYPE = 3
    VERSION_MISMATCH = 4
    UNKNOWN_CONTEXT = 5
    PAYLOAD_MISMATCH = 6
    MESSAGE_TOO_LARGE = 7
    NO_SPACE = 8
    ILLEGAL_STATE = 9
    UNKNOWN_LEASE = 10
    LEASE_EXPIRED = 11
    TIMEOUT = 12
    DEADLINE_EXCEEDED = 13
    TRANSPORT_UNAVAILABLE = 14
    SHUTTING_DOWN = 15
    CONNECTION = 16
    UNKNOWN_SESSION = 17
    LEASE_REVOKED = 18
    INCOMPATIBLE = 19  # registration: this client's keys could never match what the server (or a live peer) holds
    UNKNOWN_KV_CACHE = 20  # the server-driven path: no paged cache of this client under that id (unregistered, or the server restarted)
    PREFETCH_TOO_SLOW = 21  # the server answered, but its prefetch from L2 did not finish in the caller's window (that request's miss)
    REPLIES_UNREAD = 22  # this client has not read earlier replies that pin KV (MAX_UNSENT_BYTES): refused until it does
    OVERLOADED = 23  # this client has too many requests waiting for the server's workers (MAX_QUEUED_*): refused until they are done


class KVDepotError(Exception):
    """Base of every error kvdepot raises; ``code`` is the server's (or the client's) ErrorCode."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code.name}] {self.message}"


class EndpointInUse(OSError):
    """Another process holds an endpoint a server was to listen on (``endpoint``: tcp://HOST:PORT,
    ipc://PATH, or HOST:PORT for HTTP)."""

    def __init__(self, endpoint: str, message: str) -> None:
        super().__init__(errno.EADDRINUSE, message)
        self.endpoint = endpoint

    def __str__(self) -> str:
        return self.strerror


class ConfigError(ValueError):
    """A configuration that cannot work (a bad flag value, a bad tier spec): ``kvdepot server`` exits 2."""


class BadRequest(KVDepotError):
    code = ErrorCode.BAD_REQUEST


class UnknownContext(KVDepotError):
    code = ErrorCode.UNKNOWN_CONTEXT


class PayloadMismatch(KVDepotError):
    code = ErrorCode.PAYLOAD_MISMATCH


class IllegalTransition(KVDepotError):
    """A state-machine transition was asked for from the wrong state; nothing was changed."""

    code = ErrorCode.ILLEGAL_STATE


class UnknownLease(KVDepotError):
    code = ErrorCode.UNKNOWN_LEASE


class LeaseExpired(KVDepotError):
    """The lease ran out (TTL or client gone) before it was finished: its data must not be trusted."""

    code = ErrorCode.LEASE_EXPIRED


class LeaseRevoked(LeaseExpired):
    """The server declared the client gone (it missed its heartbeats) while it held the lease; what it
    wrote was dropped, and the arena space it could still reach was kept from reuse until now."""

    code = ErrorCode.LEASE_REVOKED


class KVDepotTimeout(KVDepotError):
    code = ErrorCode.TIMEOUT


class ChannelBusy(KVDepotTimeout):
    """The caller's deadline passed while another thread of this process held the client's channel (a
    long save or load of its own): nothing was sent, so it says nothing about the server."""


class ServerUnreachable(KVDepotError):
    """No kvdepot server answered at the URL in time (not running, wrong address, or a firewall)."""

    code = ErrorCode.CONNECTION


class HandshakeRefused(ServerUnreachable):
    """The server is there but the connection's security handshake failed (CurveZMQ keys missing, not
    admitted, or the wrong server key): no request could be sent. ZeroMQ itself only retries silently."""


class ForkedChannel(KVDepotError):
    """This process is a ``fork()`` child of the one whose client (or channel) connected: the connection
    is the parent's and does not work here. Nothing was sent; a client created in this process works."""

    code = ErrorCode.CONNECTION


class TransportUnavailable(KVDepotError):
    code = ErrorCode.TRANSPORT_UNAVAILABLE


class PrefetchTooSlow(KVDepotError):
    """The server answered every poll, but its prefetch from L2 (a slow tier, a peer that stalls) did not
    finish within the caller's window: that request misses. Not a transport failure: the server works,
    and lookups of what is in L1 must go on."""

    code = ErrorCode.PREFETCH_TOO_SLOW


class UnknownKVCache(KVDepotError):
    """The server holds no registered paged cache under that id for this client: it was unregistered,
    dropped with the client's context, or the server restarted. Registering it again fixes it."""

    code = ErrorCode.UNKNOWN_KV_CACHE


_BY_CODE: dict[ErrorCode, type[KVDepotError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnknownContext,
        PayloadMismatch,
        IllegalTransition,
        UnknownLease,
        LeaseExpired,
        LeaseRevoked,
        KVDepotTimeout,
        ServerUnreachable,
        TransportUnavailable,
        UnknownKVCache,
        PrefetchTooSlow,
    )
}


def error_from_code(code: int, message: str) -> KVDepotError:
    """Rebuild the most specific exception for a code received from the server."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return KVDepotError(f"{message} (unknown error code {code})", ErrorCode.INTERNAL)
    cls = _BY_CODE.get(ec, KVDepotError)
    return cls(message, ec)
