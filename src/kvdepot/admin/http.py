"""The HTTP API: ``GET /healthcheck``, ``GET /status``, ``GET /metrics`` (Prometheus), ``POST /cache/clear``
(``{"scope": "l1" | "tiers" | "all"}``, default L1), and per-``cache_salt``
quotas at ``GET|PUT|DELETE /quota/{cache_salt}`` (``GET /quota`` lists them; the salt-less tenant is
``__default__``; a salt with ``/`` in it is written percent-encoded or as is). Quotas need
``--eviction-policy isolated_lru``; otherwise they answer 409.

Every request passes ``AdminGuard`` first (Host, and for mutating requests Content-Type and Origin:
see ``guard.py``). No page is served that loads scripts from elsewhere: ``/docs`` and ``/redoc`` are
off; the OpenAPI document itself is at ``/openapi.json``.

It runs uvicorn on its own thread with its own event loop; handlers only read thread-safe snapshots
or call the same storage methods the RPC handlers use.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
from typing import Protocol

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvdepot import __version__
from kvdepot.admin.guard import AdminGuard
from kvdepot.admin.routes import lifecycle
from kvdepot.config import HttpConfig
from kvdepot.errors import EndpointInUse
from kvdepot.types import ClearScope

DEFAULT_SALT_NAME = "__default__"
MAX_QUOTA_BYTES = 1 << 62

log = logging.getLogger(__name__)


class Quotas(Protocol):
    def get(self, salt: str) -> int | None: ...
    def set(self, salt: str, quota_bytes: int | None) -> None: ...
    def used(self, salt: str) -> int: ...
    def all(self) -> dict[str, int]: ...


class AdminBackend(Protocol):
    """What the admin API needs of a server, and nothing more (the server implements it; this module
    never imports the server)."""

    def rpc_alive(self) -> bool: ...
    def status(self) -> dict: ...
    def degraded_reasons(self) -> list[str]: ...
    def clear(self, scope: ClearScope) -> dict: ...
    def quotas(self) -> Quotas | None: ...
    def largest_chunk_bytes(self) -> int: ...
    def metrics_text(self) -> bytes: ...


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quota_bytes: StrictInt = Field(ge=0, le=MAX_QUOTA_BYTES, description="bytes of L1 this cache_salt may hold")


class ClearBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scope: ClearScope = Field(ClearScope.L1, description="L1, every L2 tier, or both")


def build_app(server: AdminBackend, guard: AdminGuard) -> FastAPI:
    app = FastAPI(title="kvdepot", version=__version__, docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def admin_guard(request: Request, call_next):
        refusal = guard.check(request.method, request.headers)
        if refusal is not None:
            log.warning("admin API refused %s %s: %s", request.method, request.url.path, refusal.reason)
            return JSONResponse({"detail": refusal.reason}, status_code=refusal.status)
        return await call_next(request)

    @app.get("/healthcheck")
    def healthcheck() -> JSONResponse:
        """200 ``ok``; 200 ``degraded`` with reasons while the server serves but a tier is down (a
        liveness probe must not restart it for that: L1 still serves); 503 when it cannot serve."""
        if not server.rpc_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the RPC loop is not running"}, status_code=503)
        reasons = server.degraded_reasons()
        if reasons:
            return JSONResponse({"status": "degraded", "reason": "; ".join(reasons), "reasons": reasons})
        return JSONResponse({"status": "ok"})

    @app.get("/status")
    def status() -> dict:
        return server.status()

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(server.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/cache/clear")
    def clear(body: ClearBody | None = None) -> dict:
        return server.clear((body or ClearBody()).scope)

    def quota_policy() -> Quotas:
        quotas = server.quotas()
        if quotas is None:
            raise HTTPException(409, "per-cache_salt quotas need --eviction-policy isolated_lru")
        return quotas

    def salt_of(name: str) -> str:
        return "" if name == DEFAULT_SALT_NAME else name

    def quota_doc(quotas: Quotas, salt: str) -> dict:
        return {"cache_salt": salt or DEFAULT_SALT_NAME, "quota_bytes": quotas.get(salt), "used_bytes": quotas.used(salt)}

    @app.get("/quota")
    def list_quotas() -> dict:
        quotas = quota_policy()
        return {"quotas": [quota_doc(quotas, salt) for salt in sorted(quotas.all())]}

    @app.get("/quota/{cache_salt:path}")
    def get_quota(cache_salt: str) -> dict:
        return quota_doc(quota_policy(), salt_of(cache_salt))

    @app.put("/quota/{cache_salt:path}")
    def put_quota(cache_salt: str, body: QuotaBody) -> dict:
        quotas = quota_policy()
        quotas.set(salt_of(cache_salt), body.quota_bytes)  # enforced at once
        doc = quota_doc(quotas, salt_of(cache_salt))
        chunk = server.largest_chunk_bytes()
        if body.quota_bytes == 0:
            doc["warning"] = "a quota of 0 bytes refuses every store for this cache_salt (OVER_QUOTA)"
        elif body.quota_bytes < chunk:
            doc["warning"] = (
                f"a quota of {body.quota_bytes} bytes is below one chunk ({chunk} bytes for the largest registered "
                f"context): stores for this cache_salt will be refused (OVER_QUOTA) until it is raised"
            )
        if "warning" in doc:
            log.warning("quota for cache_salt %r: %s", cache_salt, doc["warning"])
        return doc

    @app.delete("/quota/{cache_salt:path}")
    def delete_quota(cache_salt: str) -> dict:
        quotas = quota_policy()
        if quotas.get(salt_of(cache_salt)) is None:
            raise HTTPException(404, f"no quota for cache_salt {cache_salt!r}")
        quotas.set(salt_of(cache_salt), None)
        return quota_doc(quotas, salt_of(cache_salt))

    app.include_router(lifecycle.routes(server))
    return app


class HttpServer:
    def __init__(self, server: AdminBackend, config: HttpConfig) -> None:
        self._config = config
        guard = AdminGuard(config.host, config.port, config.allowed_hosts)
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(build_app(server, guard), host=config.host, port=config.port, log_level="warning", lifespan="off")
        )
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self._config.host}:{self._config.port}"

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
