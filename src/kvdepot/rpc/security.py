"""CurveZMQ for RPC sockets: who may connect, and encryption of everything on the socket.

Two kinds, one interface (``SocketSecurity``: ``apply_server``, ``apply_client``, ``close``), so
``RpcServer`` and ``RpcChannel`` take either:

- ``CurveSecurity``: peers that share one secret (a peer cluster's control plane). Every holder derives
  the same Curve key pair from it (a hash of the secret is the Curve secret key), serves with it and
  connects with it; the server's ZAP handler (pyzmq's ``zmq.auth``) admits a client only if it presents
  that same public key. A process without the secret can neither complete the handshake nor be admitted.
- Key files made by ``zmq.auth.create_certificates`` (``kvdepot keygen``), for the kvdepot server and
  its clients: ``CurveServerKeys`` serves with the server's key pair and admits the public keys of a
  directory of client certificates, or of one shared client certificate; ``CurveClientKeys`` is a
  client's key pair and the server's public key.

No security object: plain sockets (loopback and trusted networks only; ``config`` refuses a server
bound off loopback without one unless ``--insecure``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kvdepot-peer"
SERVER_ZAP_DOMAIN = "kvdepot"


class SocketSecurity(Protocol):
    """What ``RpcServer`` and ``RpcChannel`` need of a security kind. A kind made for one role raises
    ``TypeError`` when asked to play the other."""

    def apply_server(self, ctx: zmq.Context, sock: zmq.Socket) -> None: ...

    def apply_client(self, sock: zmq.Socket) -> None: ...

    def close(self) -> None: ...


class CurveSecurity:
    def __init__(self, secret: str) -> None:
        if not secret:
            raise ValueError("a Curve security needs a non-empty secret")
        seed = hashlib.sha256(b"kvdepot-peer-curve\0" + secret.encode()).digest()
        self.secret_key = z85.encode(seed)
        self.public_key = zmq.curve_public(self.secret_key)
        self._authenticators: list[ThreadAuthenticator] = []

    def __repr__(self) -> str:
        return "CurveSecurity(<secret>)"

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.public_key

    def apply_server(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Serve with the cluster's key pair; the context's ZAP handler admits only the same key."""
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self._authenticators.append(auth)
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key

    def callback(self, domain: str, client_key: bytes) -> bool:
        """zmq.auth's credentials check: the client presented the cluster's own public key."""
        ok = client_key == self.public_key
        if not ok:
            # Said by the serving RpcServer, at most every 10 s (its handshake monitor): a refused ZeroMQ
            # client retries every 0.1 s, and a warning here each time flooded the log.
            log.debug("refused a connection that does not hold the cluster secret")
        return ok

    def close(self) -> None:
        for auth in self._authenticators:
            auth.stop()
        self._authenticators.clear()


# --- key files (``zmq.auth`` certificates) ---------------------------------------------------------


def load_public_key(path: str | os.PathLike) -> bytes:
    """The public key of a certificate file (public or secret); ValueError naming the file otherwise."""
    public, _ = _load(path)
    return public


def load_key_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) from a secret certificate file (``NAME.key_secret``)."""
    public, secret = _load(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key: give the .key_secret file that zmq.auth.create_certificates wrote")
    return public, secret


def _load(path: str | os.PathLike) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such key file (make one with `kvdepot keygen DIR`)")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a CurveZMQ certificate: {exc}") from None
    if not public:
        raise ValueError(f"{path} is not a CurveZMQ certificate (no public-key line)")
    # ZeroMQ refuses a malformed key only when it is set on a socket, with a bare EINVAL: checked here.
    for which, key in (("public", public), ("secret", secret)):
        if key is not None and not _is_z85_key(key):
            raise ValueError(f"{path}: its {which} key is not a 40-character Z85 CurveZMQ key (a damaged or truncated file?)")
    if secret and zmq.curve_public(secret) != public:
        raise ValueError(f"{path}: its public key is not the one of its secret key (a damaged file?)")
    return public, secret


def _is_z85_key(key: bytes) -> bool:
    if len(key) != 40:
        return False
    try:
        z85.decode(key)
    except Exception:  # a character outside Z85's alphabet (KeyError), a group past 2**32 (struct.error)
        return False
    return True


@dataclass(frozen=True)
class CurveClientKeys:
    """A client's side of CurveZMQ: the server's public key and the client's own key pair (Z85 bytes,
    as ``zmq.auth`` reads them). ``KVClient(..., curve=CurveClientKeys.from_files(...))``."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("server_public_key", "public_key", "secret_key"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, value.encode("ascii"))
            if len(getattr(self, name)) != 40:
                raise ValueError(f"CurveClientKeys.{name} must be a 40-character Z85 key")

    @classmethod
    def from_files(cls, server_public: str | os.PathLike, client_secret: str | os.PathLike) -> CurveClientKeys:
        """``server_public``: the server's certificate (``server.key``); ``client_secret``: this
        client's secret certificate (``client.key_secret``)."""
        public, secret = load_key_pair(client_secret)
        return cls(load_public_key(server_public), public, secret)

    def apply_client(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public_key
        sock.curve_publickey = self.public_key
        sock.curve_secretkey = self.secret_key

    def apply_server(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        raise TypeError("a client's Curve keys cannot serve; the server uses CurveServerKeys")

    def close(self) -> None:
        pass


class CurveServerKeys:
    """The kvdepot server's side of CurveZMQ: its key pair from a secret certificate, and the clients it
    admits: every public certificate (``*.key``) in a directory, read at start, or the one public key of a
    shared client certificate file."""

    def __init__(self, server_secret: str | os.PathLike, clients: str | os.PathLike) -> None:
        self.public_key, self._secret_key = load_key_pair(server_secret)
        path = Path(clients)
        if path.is_dir():
            certs = sorted(p for p in path.iterdir() if p.suffix == ".key" and not p.name.startswith("."))  # as zmq.auth's glob
            if not certs:
                raise ValueError(f"{clients} holds no client certificate (*.key): every client would be refused")
            # Read here, each one named when it cannot be used: zmq.auth's own directory loader gives up
            # on the first bad file with a log line only, and the server then refused every client.
            self.clients_dir: Path | None = path
            self.client_keys: frozenset[bytes] = frozenset(load_public_key(p) for p in certs)
        else:
            self.clients_dir = None
            self.client_keys = frozenset({load_public_key(path)})
        self._authenticators: list[ThreadAuthenticator] = []

    def __repr__(self) -> str:
        admits = f"clients in {self.clients_dir}" if self.clients_dir else f"{len(self.client_keys)} client key"
        return f"CurveServerKeys(public={self.public_key.decode()}, {admits})"

    def apply_server(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve_callback(SERVER_ZAP_DOMAIN, credentials_provider=self)
        self._authenticators.append(auth)
        sock.zap_domain = SERVER_ZAP_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_secretkey = self._secret_key
        sock.curve_publickey = self.public_key

    def callback(self, domain: str, client_key: bytes) -> bool:
        """zmq.auth's credentials check: one of the admitted clients' public keys."""
        ok = client_key in self.client_keys
        if not ok:
            log.debug("refused a CurveZMQ client whose public key is not admitted by --curve-clients")  # said by RpcServer, as above
        return ok

    def apply_client(self, sock: zmq.Socket) -> None:
        raise TypeError("the server's Curve keys cannot connect; a client uses CurveClientKeys")

    def close(self) -> None:
        for auth in self._authenticators:
            auth.stop()
        self._authenticators.clear()


def write_key_files(directory: str | os.PathLike) -> dict[str, Path]:
    """``kvdepot keygen``: a server and a client key pair in ``directory`` (``zmq.auth``'s format), and
    ``clients/`` holding the client's public certificate (what ``--curve-clients`` admits; add more
    clients' ``.key`` files there). Secret files are readable by their owner only. Refuses to overwrite."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    names = ("server.key", "server.key_secret", "client.key", "client.key_secret")
    taken = [n for n in names if (out / n).exists()]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(taken)}: keys are never overwritten")
    # zmq.auth writes with a plain open(): under the usual umask a secret file would be readable by
    # others until the chmod, long enough for a watcher to open it. Written owner-only from the start.
    old_umask = os.umask(0o077)
    try:
        zmq.auth.create_certificates(out, "server")
        zmq.auth.create_certificates(out, "client")
    finally:
        os.umask(old_umask)
    for name in ("server.key_secret", "client.key_secret"):
        os.chmod(out / name, 0o600)
    for name in ("server.key", "client.key"):
        os.chmod(out / name, 0o644)  # public: shared with whoever must connect
    clients = out / "clients"
    clients.mkdir(exist_ok=True)
    (clients / "client.key").write_bytes((out / "client.key").read_bytes())
    return {
        "server_secret": out / "server.key_secret",
        "server_public": out / "server.key",
        "client_secret": out / "client.key_secret",
        "client_public": out / "client.key",
        "clients": clients,
    }
