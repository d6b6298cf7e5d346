"""``GET /``: what answers here (name and version), and where to look next."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter

from kvdepot import __version__


class Nothing(Protocol):
    """This module needs nothing of the server."""


def routes(backend: Nothing) -> APIRouter:
    router = APIRouter()

    @router.get("/")
    def root() -> dict:
        return {"name": "kvdepot", "version": __version__, "status": "/status", "dashboard": "/dashboard"}

    return router
