"""``GET /dashboard``: one self-contained HTML page (inline CSS and JS, nothing from elsewhere) that polls
this server's ``/status``, ``/events/recent`` and ``/quota`` and draws them. The page is package data
(``kvdepot/admin/dashboard/index.html``), read once."""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

# The page may run its own inline code and fetch from this origin only; it cannot be framed.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'; frame-ancestors 'none'"


class Nothing(Protocol):
    """The page itself needs nothing of the server (it reads the JSON endpoints)."""


@cache
def page() -> str:
    return files("kvdepot.admin.dashboard").joinpath("index.html").read_text(encoding="utf-8")


def routes(backend: Nothing) -> APIRouter:
    router = APIRouter()

    @router.get("/dashboard", response_class=HTMLResponse)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(page(), headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"})

    return router
