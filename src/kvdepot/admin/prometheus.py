"""``--prometheus-port``: the same ``/metrics`` exposition on a port of its own, for a scraper that is
let in where the admin API is not. It serves ``GET /metrics`` (and ``/``) and nothing else, behind the
same Host check as the admin API (a DNS-rebinding page cannot read it either)."""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from kvdepot.admin.guard import AdminGuard
from kvdepot.config import host_port
from kvdepot.errors import EndpointInUse

log = logging.getLogger(__name__)


class PrometheusServer:
    def __init__(self, text: Callable[[], bytes], host: str, port: int, allowed_hosts: tuple[str, ...] = ()) -> None:
        self._text = text
        self._host, self._port = host, port
        self._guard = AdminGuard(host, port, allowed_hosts)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return host_port(self._host, self._port)

    def bind(self) -> None:
        """Listen now (``start`` serves): EndpointInUse names a taken port; OSError another failure."""
        if self._server is not None:
            return
        handler = _handler(self._text, self._guard)
        try:
            self._server = _Server((self._host, self._port), handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise EndpointInUse(self.address, f"{self.address} is in use (another process listens there)") from None
            raise OSError(exc.errno, f"cannot listen on {self.address}: {exc.strerror}") from None

    def start(self) -> None:
        self.bind()
        assert self._server is not None
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvdepot-prometheus", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._server is None:
            return
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
        self._server = None


IDLE_TIMEOUT_S = 10.0


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # as uvicorn does: TIME_WAIT is no conflict

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)


def _handler(text: Callable[[], bytes], guard: AdminGuard) -> type[BaseHTTPRequestHandler]:
    class MetricsHandler(BaseHTTPRequestHandler):
        # A connection that sends nothing (or half a request) gives its thread back after this long; with
        # no timeout, a peer that can reach the port held one thread of the server per idle connection.
        timeout = IDLE_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            refusal = guard.check("GET", self.headers)
            if refusal is not None:
                self._reply(refusal.status, refusal.reason.encode(), "text/plain; charset=utf-8")
            elif self.path.split("?", 1)[0] in ("/metrics", "/"):
                self._reply(200, text(), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b"only /metrics is served here", "text/plain; charset=utf-8")

        def _reply(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            log.debug("prometheus port: " + format, *args)

    return MetricsHandler
