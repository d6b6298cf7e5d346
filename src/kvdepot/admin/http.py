"""The HTTP API: ``GET /healthcheck``, ``GET /status``, ``POST /cache/clear``, and per-``cache_salt``
quotas at ``GET|PUT|DELETE /quota/{cache_salt}`` (``GET /quota`` lists them; the salt-less tenant is
``__default__``). Quotas need ``--eviction-policy isolated_lru``; otherwise they answer 409.

It runs uvicorn on its own thread with its own event loop; handlers only read thread-safe snapshots
or call the same storage methods the RPC handlers use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from kvdepot import __version__
from kvdepot.config import HttpConfig
from kvdepot.storage.eviction import IsolatedLRUPolicy

DEFAULT_SALT_NAME = "__default__"


class QuotaBody(BaseModel):
    quota_bytes: int = Field(ge=0, description="bytes of L1 this cache_salt may hold")

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

    def quota_policy() -> IsolatedLRUPolicy:
        policy = server.storage.table.policy
        if not isinstance(policy, IsolatedLRUPolicy):
            raise HTTPException(409, "per-cache_salt quotas need --eviction-policy isolated_lru")
        return policy

    def salt_of(name: str) -> str:
        return "" if name == DEFAULT_SALT_NAME else name

    def quota_doc(policy: IsolatedLRUPolicy, salt: str) -> dict:
        return {"cache_salt": salt or DEFAULT_SALT_NAME, "quota_bytes": policy.quota(salt), "used_bytes": policy.used(salt)}

    @app.get("/quota")
    def list_quotas() -> dict:
        policy = quota_policy()
        return {"quotas": [quota_doc(policy, salt) for salt in sorted(policy.quotas())]}

    @app.get("/quota/{cache_salt}")
    def get_quota(cache_salt: str) -> dict:
        return quota_doc(quota_policy(), salt_of(cache_salt))

    @app.put("/quota/{cache_salt}")
    def put_quota(cache_salt: str, body: QuotaBody) -> dict:
        policy = quota_policy()
        policy.set_quota(salt_of(cache_salt), body.quota_bytes)
        server.storage.eviction.kick()  # bring the salt under its new quota now
        return quota_doc(policy, salt_of(cache_salt))

    @app.delete("/quota/{cache_salt}")
    def delete_quota(cache_salt: str) -> dict:
        policy = quota_policy()
        if policy.quota(salt_of(cache_salt)) is None:
            raise HTTPException(404, f"no quota for cache_salt {cache_salt!r}")
        policy.set_quota(salt_of(cache_salt), None)
        return quota_doc(policy, salt_of(cache_salt))

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
