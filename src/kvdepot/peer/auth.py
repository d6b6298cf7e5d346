"""The data plane's handshake: both ends prove they hold the cluster secret, without sending it.

::

    server -> client   MAGIC(4) version(2) server nonce(16)
    client -> server   client nonce(16) HMAC-SHA256(secret, "client" | server nonce | client nonce)(32)
    server -> client   HMAC-SHA256(secret, "server" | client nonce | server nonce)(32)

The server closes the connection on a wrong proof (a reader without the secret reads nothing); the
client drops a server whose proof is wrong (a stranger cannot serve it pages). Fresh nonces on both
sides make a recorded handshake useless. An empty secret is an open cluster: the same exchange, keyed
with nothing, so a node with a secret and one without never talk. Pages are not encrypted: the checksum
in the directory record guards their integrity; the control plane is CurveZMQ (``kvdepot.rpc.security``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time

MAGIC = b"KVPD"
VERSION = 1
_HELLO = struct.Struct("<4sH16s")


class HandshakeFailed(ConnectionError):
    """The other end does not hold the cluster secret, or does not speak this protocol."""


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes, or ConnectionError (closed) / TimeoutError (``deadline``, monotonic, passed first:
    the socket's timeout is set from what is left of it before each receive)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            _bound(sock, deadline)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed mid-message")
        got += k
    return bytes(buf)


def _bound(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the handshake took too long")
    sock.settimeout(remaining)


def serve_handshake(sock: socket.socket, secret: bytes, deadline: float) -> None:
    """The owner's half; all of it before ``deadline`` (monotonic), however the reader paces its bytes."""
    server_nonce = os.urandom(16)
    _bound(sock, deadline)
    sock.sendall(_HELLO.pack(MAGIC, VERSION, server_nonce))
    answer = recv_exact(sock, 48, deadline)
    client_nonce, proof = answer[:16], answer[16:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
        raise HandshakeFailed("a reader without the cluster secret was refused")
    _bound(sock, deadline)
    sock.sendall(_mac(secret, b"server", client_nonce, server_nonce))


def client_handshake(sock: socket.socket, secret: bytes, deadline: float | None = None) -> None:
    """The reader's half; all of it before ``deadline`` (monotonic; the read's own), else TimeoutError.
    Without one, each receive waits as long as the socket's timeout allows: three round trips past the
    connect, each up to that timeout, ran far past a read's deadline on a long or stalled link."""
    magic, version, server_nonce = _HELLO.unpack(recv_exact(sock, _HELLO.size, deadline))
    if magic != MAGIC or version != VERSION:
        raise HandshakeFailed(f"not a kvdepot peer data plane (magic {magic!r}, version {version})")
    client_nonce = os.urandom(16)
    if deadline is not None:
        _bound(sock, deadline)
    sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
    try:
        proof = recv_exact(sock, 32, deadline)
    except ConnectionError:
        raise HandshakeFailed("the peer closed the connection: it does not hold our cluster secret") from None
    if not hmac.compare_digest(proof, _mac(secret, b"server", client_nonce, server_nonce)):
        raise HandshakeFailed("the peer does not hold the cluster secret")
