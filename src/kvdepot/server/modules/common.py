"""Checks shared by the modules."""

from __future__ import annotations

from kvdepot.errors import BadRequest
from kvdepot.limits import MAX_KEYS
from kvdepot.rpc.dispatch import Call
from kvdepot.server.modules import ServerContext
from kvdepot.server.state import Context
from kvdepot.types import ObjectKey


def context_and_keys(ctx: ServerContext, call: Call) -> tuple[Context, list[ObjectKey]]:
    """The caller's context and the object keys of its request, after validating the chunk hashes."""
    body = call.body
    context = ctx.context_of(body.context_id, call.client)
    hashes = body.keys
    if len(hashes) > MAX_KEYS:
        raise BadRequest(f"{len(hashes)} keys in one request; at most {MAX_KEYS}")
    size = ctx.digest_size
    for h in hashes:
        if len(h) != size:
            raise BadRequest(f"chunk hashes must be {size} bytes ({ctx.config.storage.hash_algorithm}), got {len(h)}")
    return context, context.keys(hashes, body.cache_salt)
