"""The HTTP admin API: a FastAPI app whose endpoints come from the modules of ``kvdepot.admin.routes``
(found at start-up; each says what it needs of the server in a Protocol of its own), all behind
``AdminGuard``.

Endpoints today: ``GET /`` (name, version), ``/healthcheck``, ``/status``, ``/metrics`` (Prometheus),
``POST /cache/clear`` and its alias ``POST /clear-cache``, ``GET|PUT|DELETE /quota/{cache_salt}``,
``GET /events/recent``, ``GET /dashboard``. Every request passes ``AdminGuard`` first (Host, and for
mutating requests Content-Type and Origin: see ``guard.py``). No page is served that loads scripts from
elsewhere: ``/docs`` and ``/redoc`` are off; the OpenAPI document itself is at ``/openapi.json``.

It runs uvicorn on its own thread with its own event loop; handlers only read thread-safe snapshots
or call the same storage methods the RPC handlers use.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvdepot import __version__
from kvdepot.admin import routes
from kvdepot.admin.backend import AdminBackend, Quotas
from kvdepot.admin.guard import AdminGuard
from kvdepot.config import HttpConfig, host_port
from kvdepot.errors import EndpointInUse

__all__ = ["AdminBackend", "HttpServer", "Quotas", "build_app"]

log = logging.getLogger(__name__)


REFUSAL_LOG_EVERY_S = 60.0
REQUEST_HEAD_TIMEOUT_S = 10.0  # a connection gets this long for each request's head (after it connects, or after a reply)
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class RefusalLog:
    """Refusals are logged at most once a minute per method and path (a few dozen paths, then one for
    all others), with how many went unlogged: a peer sending hundreds of bad requests used to fill the
    log, and the dashboard's recent warnings, with nothing else."""

    MAX_PATHS = 32

    def __init__(self, every_s: float = REFUSAL_LOG_EVERY_S, clock=time.monotonic) -> None:
        self._every, self._clock = every_s, clock
        self._by_path: dict[tuple[str, str], list] = {}  # (method, path) -> [next log time, unlogged]

    def refused(self, method: str, path: str, reason: str) -> None:
        key = (method, path)
        if key not in self._by_path and len(self._by_path) >= self.MAX_PATHS:
            # The method is the client's own token too (uvicorn's h11 parser takes any): past the cap,
            # every other request shares one entry, or a peer that varies it floods the log again.
            key = ("(other methods)" if method not in KNOWN_METHODS else method, "(other paths)")
        entry = self._by_path.setdefault(key, [0.0, 0])
        now = self._clock()
        if now < entry[0]:
            entry[1] += 1
            return
        more = f" ({entry[1]} more refused since the last one logged)" if entry[1] else ""
        entry[0], entry[1] = now + self._every, 0
        log.warning("admin API refused %s %s: %s%s", method, path, reason, more)


class _HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's protocol, with a deadline for each request's head. uvicorn times out an idle connection
    only after it has answered a request on it: one that sends nothing, or half a request head, was
    kept for ever, a descriptor of the server's process each, and off loopback anyone may open them.
    A request being answered (a slow prefetch) is not cut: the deadline starts again after its reply."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def connection_lost(self, exc) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(REQUEST_HEAD_TIMEOUT_S, self._head_deadline_passed)

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered; armed again after its reply
        if not self.transport.is_closing():
            self.transport.close()


def _writable(value):
    """``value`` with every float JSON cannot write (NaN, Infinity: Python's ``json`` reads them in a
    body) spelt as a string, so a refusal that echoes the input can itself be written."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _writable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_writable(v) for v in value]
    return value


def build_app(server: AdminBackend, guard: AdminGuard) -> FastAPI:
    app = FastAPI(title="kvdepot", version=__version__, docs_url=None, redoc_url=None)
    refusals = RefusalLog()

    @app.middleware("http")
    async def admin_guard(request: Request, call_next):
        refusal = guard.check(request.method, request.headers)
        if refusal is not None:
            refusals.refused(request.method, request.url.path, refusal.reason)
            return JSONResponse({"detail": refusal.reason}, status_code=refusal.status, headers=dict(refusal.headers))
        request.state.admin = guard.authorized(request.headers)  # routes show capabilities (pin ids) to these only
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each refused value, and a NaN or Infinity (which a body may hold)
        # made that reply raise: a bad body was answered 500 instead of naming its field.
        return JSONResponse({"detail": _writable(jsonable_encoder(exc.errors()))}, status_code=422)

    for router in routes.routers(server):
        app.include_router(router)
    return app


class HttpServer:
    def __init__(self, server: AdminBackend, config: HttpConfig) -> None:
        self._config = config
        guard = AdminGuard(config.host, config.port, config.allowed_hosts, config.admin_token)
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(build_app(server, guard), host=config.host, port=config.port, log_level="warning", lifespan="off",
                           http=_HeadDeadline)
        )
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return host_port(self._config.host, self._config.port)  # [::1]:8080, not ::1:8080

    def bind(self) -> None:
        """Listen on the port now (``start`` serves it), so a taken port is known before anything
        expensive is built: EndpointInUse names it; OSError for an address that cannot be listened on."""
        if self._sock is not None:
            return
        try:
            infos = socket.getaddrinfo(self._config.host, self._config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot resolve {self._config.host!r}: {exc}") from None
        family, _, _, _, sockaddr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise EndpointInUse(self.address, f"{self.address} is in use (another process listens there)") from None
            raise OSError(exc.errno, f"cannot listen on {self.address}: {exc.strerror}") from None
        self._sock = sock

    def start(self) -> None:
        self.bind()
        self._thread = threading.Thread(target=self._run, name="kvdepot-http", daemon=True)
        self._thread.start()
        for _ in range(200):
            if self._uvicorn.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.025)
        if not self._uvicorn.started:
            raise RuntimeError(f"the HTTP API could not start on {self.address}")

    def _run(self) -> None:
        self._uvicorn.config.install_signal_handlers = False  # the main thread owns signals
        asyncio.run(self._uvicorn.serve(sockets=[self._sock]))

    def close(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
