"""The HTTP API: ``GET /healthcheck``, ``GET /status``, ``POST /cache/clear``.

It runs uvicorn on its own thread with its own event loop; handlers only read thread-safe snapshots
or call the same storage methods the RPC handlers use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvdepot import __version__
from kvdepot.config import HttpConfig

if TYPE_CHECKING:
    from kvdepot.server.main import KVDepotServer

log = logging.getLogger(__name__)


def build_app(server: KVDepotServer) -> FastAPI:
    app = FastAPI(title="kvdepot", version=__version__)

    @app.get("/healthcheck")
    def healthcheck() -> JSONResponse:
        if not server.rpc_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the RPC loop is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/status")
    def status() -> dict:
        return server.status()

    @app.post("/cache/clear")
    def clear() -> dict:
        return {"removed": server.storage.table.clear()}

    return app


class HttpServer:
    def __init__(self, server: KVDepotServer, config: HttpConfig) -> None:
        self._config = config
        self._uvicorn = uvicorn.Server(
            uvicorn.Config(build_app(server), host=config.host, port=config.port, log_level="warning", lifespan="off")
        )
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdepot-http", daemon=True)
        self._thread.start()
        for _ in range(200):
            if self._uvicorn.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.025)
        if not self._uvicorn.started:
            raise RuntimeError(f"the HTTP API could not start on {self._config.host}:{self._config.port}")

    def _run(self) -> None:
        self._uvicorn.config.install_signal_handlers = False  # the main thread owns signals
        asyncio.run(self._uvicorn.serve())

    def close(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)
