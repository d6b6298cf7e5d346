"""Lifecycle controls over HTTP: pin a prefix, agent-session leases, warm a prefix from L2, delete one.

A prefix is named by ``chunk_hashes`` (hex, the server's hash algorithm) or by ``token_ids`` (hashed with
each registered namespace's chunk size), with ``cache_salt`` and ``model`` (optional while the registered
engines serve one model); see ``server/lifecycle.py`` for how it resolves to objects.

- ``POST /cache/pin`` ``{..prefix, "ttl_s": 60}``: pin what of the prefix is in L1 (soft with ``ttl_s``,
  hard without); says how many chunks it pinned. ``GET /cache/pins``; ``POST /cache/pins/{id}/extend``
  ``{"ttl_s": ..}`` (soft pins); ``DELETE /cache/pins/{id}`` unpins.
- ``POST /cache/sessions`` ``{"cache_salt", "name", "ttl_s"?, ..prefix?}``: open or renew an agent session
  (and move its protection to the prefix when one is named); ``POST /cache/sessions/renew``;
  ``DELETE /cache/sessions`` ``{"cache_salt", "name"}`` closes it; ``GET /cache/sessions``.
- ``POST /cache/prefetch`` ``{..prefix, "wait_s": 30}``: bring the prefix from the L2 tiers into L1;
  answers how many leading chunks are in L1 afterwards.
- ``DELETE /cache/prefix`` ``{..prefix, "scope": "all"}``: delete it from L1 and/or the tiers (locked L1
  objects go when their last reader is done).

Errors: 400 bad input, 404 unknown pin or session, 409 an illegal transition, a pin over its salt's
quota, or no registered context for the model; 502 a delete a tier could not do (``_tiers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Protocol, TypeVar

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvdepot.admin.routes._slow import run_slow
from kvdepot.admin.routes._tiers import tiers_answer
from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.types import ClearScope

T = TypeVar("T")
MAX_TTL_S = 30 * 24 * 3600.0
TokenId = Annotated[StrictInt, Field(ge=0, le=(1 << 32) - 1)]
MAX_TOKENS = 1 << 22  # a prompt this long is far past any context window; bounds the hashing one request costs
MAX_HASHES = 1 << 16  # as many chunks as one RPC request may name (limits.MAX_KEYS)


class LifecycleControl(Protocol):
    def targets(self, model: str | None, cache_salt: str, chunk_hashes_hex: list[str] | None, token_ids: list[int] | None) -> list: ...
    def pin(self, targets: list, cache_salt: str, ttl_s: float | None) -> dict: ...
    def unpin(self, pin_id: int) -> dict: ...
    def extend_pin(self, pin_id: int, ttl_s: float) -> dict: ...
    def pins(self) -> list[dict]: ...
    def open_session(self, cache_salt: str, name: str, ttl_s: float | None, targets: list) -> dict: ...
    def renew_session(self, cache_salt: str, name: str, ttl_s: float | None) -> dict: ...
    def close_session(self, cache_salt: str, name: str) -> dict: ...
    def sessions(self) -> list[dict]: ...
    def prefetch(self, targets: list, cache_salt: str, wait_s: float) -> dict: ...
    def delete(self, targets: list, scope: ClearScope) -> dict: ...


class LifecycleBackend(Protocol):
    """The one server method these routes need."""

    def lifecycle(self) -> LifecycleControl: ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefixBody(_Strict):
    model: str | None = Field(None, description="the model (optional while every registered engine serves one)")
    cache_salt: str = Field("", max_length=4096)
    chunk_hashes: list[str] | None = Field(None, max_length=MAX_HASHES, description="hex chunk hashes from chunk 0 on")
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS, description="the prefix's token ids (only complete chunks count)")


class PinBody(PrefixBody):
    ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S, description="a soft pin ending after this long; none: hard")


class PrefetchBody(PrefixBody):
    wait_s: float = Field(30.0, ge=0, le=300, description="how long to wait for the tiers")


class DeletePrefixBody(PrefixBody):
    scope: ClearScope = Field(ClearScope.ALL, description="L1, every L2 tier, or both")


class SessionName(_Strict):
    cache_salt: str = Field("", max_length=4096)
    name: str = Field(min_length=1, max_length=256)


class SessionRenewBody(SessionName):
    ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S, description="the session's new TTL (default: its own)")


class SessionOpenBody(SessionRenewBody):
    model: str | None = None
    chunk_hashes: list[str] | None = Field(None, max_length=MAX_HASHES)
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)


class ExtendBody(_Strict):
    ttl_s: float = Field(gt=0, le=MAX_TTL_S)


_STATUS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNKNOWN_LEASE: 404,
    ErrorCode.UNKNOWN_SESSION: 404,
    ErrorCode.ILLEGAL_STATE: 409,
    ErrorCode.NO_SPACE: 409,
    ErrorCode.UNKNOWN_CONTEXT: 409,
}


def _answer(work: Callable[[], T]) -> T:
    try:
        return work()
    except KVDepotError as exc:
        raise HTTPException(_STATUS.get(exc.code, 500), exc.message) from None


def routes(backend: LifecycleBackend) -> APIRouter:
    router = APIRouter(tags=["lifecycle"])

    def targets(body: PrefixBody | SessionOpenBody) -> list:
        return backend.lifecycle().targets(body.model, body.cache_salt, body.chunk_hashes, body.token_ids)

    @router.post("/cache/pin")
    def pin(body: PinBody) -> dict:
        return _answer(lambda: backend.lifecycle().pin(targets(body), body.cache_salt, body.ttl_s))

    @router.get("/cache/pins")
    def pins(request: Request) -> dict:
        # A pin's id is its capability (an UNPIN over RPC needs nothing else): a read open to anyone
        # who may see /status lists the pins without it, unless it carries the admin token.
        listed = backend.lifecycle().pins()
        if not getattr(request.state, "admin", False):
            listed = [p | {"id": None} for p in listed]
        return {"pins": listed}

    @router.post("/cache/pins/{pin_id}/extend")
    def extend(pin_id: int, body: ExtendBody) -> dict:
        return _answer(lambda: backend.lifecycle().extend_pin(pin_id, body.ttl_s))

    @router.delete("/cache/pins/{pin_id}")
    def unpin(pin_id: int) -> dict:
        return _answer(lambda: backend.lifecycle().unpin(pin_id))

    @router.post("/cache/sessions")
    def open_session(body: SessionOpenBody) -> dict:
        def work() -> dict:
            named = body.chunk_hashes is not None or body.token_ids is not None
            return backend.lifecycle().open_session(body.cache_salt, body.name, body.ttl_s, targets(body) if named else [])

        return _answer(work)

    @router.post("/cache/sessions/renew")
    def renew_session(body: SessionRenewBody) -> dict:
        return _answer(lambda: backend.lifecycle().renew_session(body.cache_salt, body.name, body.ttl_s))

    @router.delete("/cache/sessions")
    def close_session(body: SessionName) -> dict:
        return _answer(lambda: backend.lifecycle().close_session(body.cache_salt, body.name))

    @router.get("/cache/sessions")
    def sessions() -> dict:
        return {"sessions": backend.lifecycle().sessions()}

    @router.post("/cache/prefetch")
    async def prefetch(body: PrefetchBody) -> dict:
        return await run_slow(lambda: _answer(lambda: backend.lifecycle().prefetch(targets(body), body.cache_salt, body.wait_s)))

    @router.delete("/cache/prefix", response_model=None)
    async def delete_prefix(body: DeletePrefixBody) -> dict | JSONResponse:
        return tiers_answer(await run_slow(lambda: _answer(lambda: backend.lifecycle().delete(targets(body), body.scope))))

    return router
