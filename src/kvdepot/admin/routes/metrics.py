"""``GET /metrics``: the Prometheus exposition of the server's one registry."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST


class MetricsSource(Protocol):
    def metrics_text(self) -> bytes: ...


def routes(backend: MetricsSource) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    def metrics() -> Response:
        return Response(backend.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    return router
