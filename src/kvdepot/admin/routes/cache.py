"""``POST /cache/clear`` (``{"scope": "l1" | "tiers" | "all"}``, default L1), and ``POST /clear-cache``,
the same operation under the name LMCache's admin API uses. 502 when a tier could not clear (``_tiers``)."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvdepot.admin.routes._slow import run_slow
from kvdepot.admin.routes._tiers import tiers_answer
from kvdepot.types import ClearScope


class Clearer(Protocol):
    def clear(self, scope: ClearScope) -> dict: ...


class ClearBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scope: ClearScope = Field(ClearScope.L1, description="L1, every L2 tier, or both")


def routes(backend: Clearer) -> APIRouter:
    router = APIRouter()

    @router.post("/cache/clear", response_model=None)
    async def clear(body: ClearBody | None = None) -> dict | JSONResponse:
        return tiers_answer(await run_slow(lambda: backend.clear((body or ClearBody()).scope)))

    @router.post("/clear-cache", response_model=None)
    async def clear_alias(body: ClearBody | None = None) -> dict | JSONResponse:
        return tiers_answer(await run_slow(lambda: backend.clear((body or ClearBody()).scope)))

    return router
