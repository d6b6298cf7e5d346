"""CurveZMQ for RPC sockets whose peers share one secret (a peer cluster's control plane).

Every holder of the secret derives the same Curve keypair from it (a hash of the secret is the Curve
secret key), serves with it and connects with it; the server's ZAP handler (pyzmq's ``zmq.auth``)
admits a client only if it presents that same public key. So a process without the secret can neither
complete the handshake (it does not know the server's key pair) nor be admitted, and everything on the
socket is encrypted. No secret: no security object, plain sockets (loopback and trusted networks).
"""

from __future__ import annotations

import hashlib
import logging

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_DOMAIN = "kvdepot-peer"


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
            log.warning("refused a connection that does not hold the cluster secret")
        return ok

    def close(self) -> None:
        for auth in self._authenticators:
            auth.stop()
        self._authenticators.clear()
