"""``GET /events/recent?n=100&kind=...&after=SEQ``: the latest events (L1 stores and removals, error
replies, warnings), newest last, from the server's bounded in-memory ring
(``kvdepot.observability.recent``). ``kind`` repeats to ask for several kinds; ``after`` skips what a
poller has already seen."""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import APIRouter, Query

MAX_EVENTS = 512


class RecentSource(Protocol):
    def recent_events(self, n: int, kinds: tuple[str, ...] = (), after: int = 0) -> list[dict]: ...


def routes(backend: RecentSource) -> APIRouter:
    router = APIRouter()

    @router.get("/events/recent")
    def recent(
        n: Annotated[int, Query(ge=1, le=MAX_EVENTS)] = 100,
        kind: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI copies defaults)
        after: Annotated[int, Query(ge=0)] = 0,
    ) -> dict:
        return {"events": backend.recent_events(n, tuple(kind), after)}

    return router
