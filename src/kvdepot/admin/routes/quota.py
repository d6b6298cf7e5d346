"""Per-``cache_salt`` L1 quotas: ``GET /quota`` lists them, ``GET|PUT|DELETE /quota/{cache_salt}`` one
(the salt-less tenant is ``__default__``; a salt with ``/`` in it is written percent-encoded or as is).
Quotas need ``--eviction-policy isolated_lru``; otherwise they answer 409."""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvdepot.admin.backend import Quotas

DEFAULT_SALT_NAME = "__default__"
MAX_QUOTA_BYTES = 1 << 62

log = logging.getLogger(__name__)


class QuotaOwner(Protocol):
    def quotas(self) -> Quotas | None: ...
    def largest_chunk_bytes(self) -> int: ...


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    quota_bytes: StrictInt = Field(ge=0, le=MAX_QUOTA_BYTES, description="bytes of L1 this cache_salt may hold")


def salt_of(name: str) -> str:
    """The cache_salt a URL names. An empty name is refused: ``PUT /quota/$SALT`` with ``$SALT`` unset
    would otherwise set the quota of the salt-less tenant, most deployments' whole traffic."""
    if not name:
        raise HTTPException(400, f"name the cache_salt in the path; the tenant without one is {DEFAULT_SALT_NAME}")
    return "" if name == DEFAULT_SALT_NAME else name


def quota_doc(quotas: Quotas, salt: str) -> dict:
    return {"cache_salt": salt or DEFAULT_SALT_NAME, "quota_bytes": quotas.get(salt), "used_bytes": quotas.used(salt)}


def routes(backend: QuotaOwner) -> APIRouter:
    router = APIRouter()

    def quota_policy() -> Quotas:
        quotas = backend.quotas()
        if quotas is None:
            raise HTTPException(409, "per-cache_salt quotas need --eviction-policy isolated_lru")
        return quotas

    @router.get("/quota")
    def list_quotas() -> dict:
        quotas = quota_policy()
        return {"quotas": [quota_doc(quotas, salt) for salt in sorted(quotas.all())]}

    @router.get("/quota/{cache_salt:path}")
    def get_quota(cache_salt: str) -> dict:
        return quota_doc(quota_policy(), salt_of(cache_salt))

    @router.put("/quota/{cache_salt:path}")
    def put_quota(cache_salt: str, body: QuotaBody) -> dict:
        quotas = quota_policy()
        quotas.set(salt_of(cache_salt), body.quota_bytes)  # enforced at once
        doc = quota_doc(quotas, salt_of(cache_salt))
        chunk = backend.largest_chunk_bytes()
        if body.quota_bytes == 0:
            doc["warning"] = "a quota of 0 bytes refuses every store for this cache_salt (OVER_QUOTA)"
        elif body.quota_bytes < chunk:
            doc["warning"] = (
                f"a quota of {body.quota_bytes} bytes is below one chunk ({chunk} bytes for the largest registered "
                f"context): stores for this cache_salt will be refused (OVER_QUOTA) until it is raised"
            )
        elif (pinned := quotas.pinned(salt_of(cache_salt))) > body.quota_bytes:
            # Pins are never trimmed: the tenant stays over its quota, so each of its stores is refused.
            doc["warning"] = (
                f"this cache_salt has {pinned} bytes pinned, above its quota of {body.quota_bytes}: pins are not "
                f"trimmed, so its stores will be refused (OVER_QUOTA) until it is raised or pins are released"
            )
        if "warning" in doc:
            log.warning("quota for cache_salt %r: %s", cache_salt, doc["warning"])
        return doc

    @router.delete("/quota/{cache_salt:path}")
    def delete_quota(cache_salt: str) -> dict:
        quotas = quota_policy()
        if quotas.get(salt_of(cache_salt)) is None:
            raise HTTPException(404, f"no quota for cache_salt {cache_salt!r}")
        quotas.set(salt_of(cache_salt), None)
        return quota_doc(quotas, salt_of(cache_salt))

    return router
