"""``GET /healthcheck``: 200 ``ok``; 200 ``degraded`` with reasons while the server serves but a tier is
down (a liveness probe must not restart it for that: L1 still serves); 503 when it cannot serve."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import JSONResponse


class Health(Protocol):
    def rpc_alive(self) -> bool: ...
    def degraded_reasons(self) -> list[str]: ...


def routes(backend: Health) -> APIRouter:
    router = APIRouter()

    @router.get("/healthcheck")
    def healthcheck() -> JSONResponse:
        if not backend.rpc_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the RPC loop is not running"}, status_code=503)
        reasons = backend.degraded_reasons()
        if reasons:
            return JSONResponse({"status": "degraded", "reason": "; ".join(reasons), "reasons": reasons})
        return JSONResponse({"status": "ok"})

    return router
