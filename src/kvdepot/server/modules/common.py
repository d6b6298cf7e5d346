"""Checks and steps shared by the modules (key validation, agent sessions, locking a prefix for a retrieve)."""

from __future__ import annotations

from collections.abc import Callable

from kvdepot.errors import BadRequest, KVDepotError
from kvdepot.limits import MAX_KEYS
from kvdepot.protocol import messages as m
from kvdepot.rpc.dispatch import Call
from kvdepot.server.modules import ServerContext
from kvdepot.server.state import Context
from kvdepot.storage.manager import ReadLock, Toucher
from kvdepot.types import ObjectKey


# vLLM allows 128 characters; a salt of megabytes would be kept per context (its namespace cache), in
# KV events, traces and spans.
MAX_CACHE_SALT = 1024


def context_and_keys(ctx: ServerContext, call: Call) -> tuple[Context, list[ObjectKey]]:
    """The caller's context and the object keys of its request, after validating the chunk hashes and
    the salt."""
    body = call.body
    context = ctx.context_of(body.context_id, call.client)
    if len(body.cache_salt) > MAX_CACHE_SALT:
        raise BadRequest(f"cache_salt is at most {MAX_CACHE_SALT} characters, got {len(body.cache_salt)}")
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


# What a store that kept none of its chunks was told: refused (a quota, or no space), not one of its turns.
REFUSED = frozenset({m.SlotStatus.OVER_QUOTA, m.SlotStatus.NO_SPACE})


def check_agent_session(call: Call) -> None:
    """Refuse a bad agent_session name before anything is done for the request."""
    name = call.body.agent_session
    if len(name) > MAX_AGENT_SESSION_NAME:
        raise BadRequest(f"agent_session names are at most {MAX_AGENT_SESSION_NAME} characters, got {len(name)}")


def touch_agent_session(ctx: ServerContext, call: Call, keys: list[ObjectKey]) -> None:
    """A LOOKUP or STORE naming an agent session is one of its turns: open or renew it and keep ``keys``
    (the request's whole chain) from eviction until its deadline (storage/pins.py)."""
    check_agent_session(call)
    if call.body.agent_session:
        ctx.storage.touch_agent_session(call.body.cache_salt, call.body.agent_session, keys)


def store_protects(call: Call, keys: list[ObjectKey], prefix: list[ObjectKey]) -> list[ObjectKey]:
    """What a store's reservation must not evict to make room: the prefix it extends, and for an agent
    session's turn its whole chain (the session is touched only once the store is known not refused)."""
    check_agent_session(call)
    return keys if call.body.agent_session else prefix


def touch_after_store(ctx: ServerContext, call: Call, keys: list[ObjectKey], statuses: list[m.SlotStatus]) -> None:
    """A store's agent-session turn, once its reservation is made (and where the server copies the
    chunks itself, once that copy has ended): a store refused outright (every chunk over quota or
    without space), or whose copy failed, stored nothing, so it is no activity of the session: it opens
    none and renews none."""
    if statuses and all(s in REFUSED for s in statuses):
        return
    touch_agent_session(ctx, call, keys)


def lock_for_retrieve(ctx: ServerContext, call: Call, toucher: Toucher, check: Callable[[], None] | None = None) -> tuple[Context, ReadLock]:
    """Read-lock the leading stored run of ``keys[start:]`` (at most ``limit`` chunks), taking over the
    session's lookup locks where they cover it. ``toucher``: who reads the locked extents (the client on
    shm; the server's own send or copy otherwise). ``check`` runs once the caller's context is known,
    before anything is locked (a path's own precondition)."""
    body = call.body
    context, keys = context_and_keys(ctx, call)
    if check is not None:
        check()
    if not 0 <= body.start <= len(keys):
        raise BadRequest(f"start={body.start} is outside the {len(keys)} keys")
    if body.limit < 0:
        raise BadRequest(f"limit={body.limit} is negative")
    if body.limit:
        keys = keys[: body.start + body.limit]
    if body.session_id:
        lease = ctx.sessions.hand_over((context.id, body.session_id), keys, body.start)
        if lease:  # the retrieve now owns the session's locks
            try:
                offsets = ctx.storage.locked_offsets(lease, call.client, body.start, toucher)[: len(keys) - body.start]
                if offsets:
                    return context, ReadLock(lease, offsets, context.chunk_bytes)
                # The session freed the locks where this retrieve starts: lock afresh instead.
                ctx.storage.release(lease, call.client)
            except KVDepotError:
                pass  # expired meanwhile: lock afresh below
    return context, ctx.storage.lock_prefix(keys[body.start :], call.client, toucher=toucher)


def count_short_retrieve(ctx: ServerContext, call: Call, found: int) -> None:
    """A session's retrieve that found fewer chunks than it asked for: what its lookup promised was
    evicted, or its locks ended, meanwhile (that request recomputes the rest)."""
    body = call.body
    asked = (body.limit or len(body.keys) - body.start) if body.session_id else 0
    if found < asked:
        ctx.metrics.request_failures.labels("short_retrieves").inc()
