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
    lengths = set(map(len, hashes))  # one C loop over the keys, not a Python one
    if lengths and lengths != {size}:
        wrong = next(n for n in lengths if n != size)
        raise BadRequest(f"chunk hashes must be {size} bytes ({ctx.config.storage.hash_algorithm}), got {wrong}")
    return context, context.keys(hashes, body.cache_salt)


MAX_AGENT_SESSION_NAME = 256


def touch_agent_session(ctx: ServerContext, call: Call, keys: list[ObjectKey]) -> None:
    """A LOOKUP or STORE naming an agent session is one of its turns: open or renew it and keep ``keys``
    (the request's whole chain) from eviction until its deadline (storage/pins.py)."""
    name = call.body.agent_session
    if not name:
        return
    if len(name) > MAX_AGENT_SESSION_NAME:
        raise BadRequest(f"agent_session names are at most {MAX_AGENT_SESSION_NAME} characters, got {len(name)}")
    ctx.storage.touch_agent_session(call.body.cache_salt, name, keys)
