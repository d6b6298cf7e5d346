"""``POST /cache/clear`` (``{"scope": "l1" | "tiers" | "all"}``, default L1), and ``POST /clear-cache``,
the same operation under the name LMCache's admin API uses."""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from kvdepot.admin.routes._slow import run_slow
from kvdepot.types import ClearScope


class Clearer(Protocol):
    def clear(self, scope: ClearScope) -> dict: ...


class ClearBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scope: ClearScope = Field(ClearScope.L1, description="L1, every L2 tier, or both")


def routes(backend: Clearer) -> APIRouter:
    router = APIRouter()

    @router.post("/cache/clear")
    async def clear(body: ClearBody | None = None) -> dict:
        return await run_slow(lambda: backend.clear((body or ClearBody()).scope))

    @router.post("/clear-cache")
    async def clear_alias(body: ClearBody | None = None) -> dict:
        return await run_slow(lambda: backend.clear((body or ClearBody()).scope))

    return router
