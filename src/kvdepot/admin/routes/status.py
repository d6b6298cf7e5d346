"""``GET /status``: the server's JSON status document (see ``kvdepot.server.status``)."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter


class StatusSource(Protocol):
    def status(self) -> dict: ...


def routes(backend: StatusSource) -> APIRouter:
    router = APIRouter()

    @router.get("/status")
    def status() -> dict:
        return backend.status()

    return router
