"""What may talk to the admin port: the checks every HTTP request passes before it reaches a route.

A browser on the same machine is the threat: any page it has open can send a "simple" cross-origin
request (a POST with ``Content-Type: text/plain`` needs no CORS preflight), and a DNS-rebinding page
reaches 127.0.0.1 under its own host name. So:

- ``Host`` must name this server: a loopback name, the bound address, this machine's host names, an IP
  literal when bound to a wildcard address, or a name the operator allowed (``--http-allowed-hosts``).
  A rebinding page sends its own domain and is refused (421).
- A mutating request (POST, PUT, PATCH, DELETE) must be ``Content-Type: application/json`` (which a
  page can only send after a preflight this server never grants) (415) and, when it carries an
  ``Origin``, that origin must be this server itself (403).

- With an admin token (``--admin-token`` or ``$KVDEPOT_ADMIN_TOKEN``; required when the port is bound
  off loopback), a mutating request must carry ``Authorization: Bearer TOKEN``: 401 (with
  ``WWW-Authenticate: Bearer``) without one, 403 with a wrong one, compared in constant time. Reads
  (GET, HEAD) stay open: they change nothing, and monitoring (``/metrics``, ``/healthcheck``, the
  dashboard) should not need a secret. Keep the port off untrusted networks if what ``/status``
  shows (models, tenants' salts, clients) is itself sensitive.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with the refusal (WWW-Authenticate)


def _split_host(value: str) -> tuple[str, int | None]:
    """'example:8080' -> ('example', 8080); '[::1]:80' -> ('::1', 80); bad ports -> port -1; a value
    that is no host at all ('[::1') -> ('', -1), which no allowed host matches."""
    try:
        parts = urlsplit("//" + value)
    except ValueError:
        return "", -1
    try:
        port = parts.port
    except ValueError:
        port = -1
    return (parts.hostname or "").lower(), port


def _allowed_name(entry: str) -> str:
    """An ``--http-allowed-hosts`` entry as the Host check compares it: written as a URL shows it
    (``kv.internal:8080``, ``[fd00::1]``, ``http://kv.internal``), it was kept whole, matched nothing,
    and every request under that name was refused (421) while the operator had allowed it."""
    entry = entry.strip().lower()
    if _is_ip(entry):  # a bare IPv6 literal: its colons are no port
        return entry
    try:
        parts = urlsplit(entry if "://" in entry else "//" + entry)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        return entry
    return parts.hostname or entry


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class AdminGuard:
    def __init__(self, bind_host: str, port: int, allowed_hosts: Iterable[str] = (), admin_token: str = "") -> None:
        self.port = port
        self._token = admin_token.encode() if admin_token else b""  # empty: mutating requests need none
        self.wildcard = bind_host in WILDCARDS
        names = set(LOOPBACK_NAMES) | {bind_host.lower()} | {_allowed_name(h) for h in allowed_hosts if h}
        for name in (socket.gethostname(), socket.getfqdn()):
            if name:
                names.add(name.lower())
        self.names = frozenset(n for n in names if n not in WILDCARDS)

    def __repr__(self) -> str:
        return f"AdminGuard(port={self.port}, names={sorted(self.names)}, wildcard={self.wildcard}, token={'set' if self._token else 'none'})"

    def host_allowed(self, host: str) -> bool:
        return host in self.names or (self.wildcard and _is_ip(host))

    def check(self, method: str, headers) -> Refusal | None:
        """None when the request may proceed; else why not. ``headers``: a case-insensitive mapping."""
        host, port = _split_host(headers.get("host", ""))
        if not self.host_allowed(host) or port == -1:
            return Refusal(421, f"Host {headers.get('host', '')!r} does not name this server; add it with --http-allowed-hosts")
        if method.upper() not in MUTATING:
            return None
        if self._token:
            refusal = self._check_token(method, headers.get("authorization", ""))
            if refusal is not None:
                return refusal
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            return Refusal(415, f"{method} needs Content-Type: application/json (got {ctype or 'none'!r})")
        origin = headers.get("origin")
        if origin is not None and not self._own_origin(origin):
            return Refusal(403, f"cross-origin {method} from {origin!r} is not allowed")
        return None

    def authorized(self, headers) -> bool:
        """Whether the request carries what a mutating one needs to (the admin token, when there is one):
        reads stay open, but what is a capability in itself (a pin's id) is shown to these only."""
        return not self._token or self._check_token("GET", headers.get("authorization", "")) is None

    def _check_token(self, method: str, authorization: str) -> Refusal | None:
        scheme, _, credentials = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return Refusal(401, f"{method} needs Authorization: Bearer <admin token>", {"WWW-Authenticate": 'Bearer realm="kvdepot"'})
        if not hmac.compare_digest(credentials.strip().encode(), self._token):
            return Refusal(403, "the admin token does not match", {"WWW-Authenticate": 'Bearer realm="kvdepot", error="invalid_token"'})
        return None

    def _own_origin(self, origin: str) -> bool:
        try:
            parts = urlsplit(origin)
        except ValueError:  # 'http://[zz': no origin of ours
            return False
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False  # includes the opaque origin "null"
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        return self.host_allowed(parts.hostname.lower()) and port == self.port
