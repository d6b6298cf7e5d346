"""What the server knows about its clients' contexts and sessions (never about bytes: that is storage).

A context is one engine worker's (model, rank, layout, chunk size), owned by the client that registered
it. A session is one engine request: it holds the read locks its LOOKUP took until the request
retrieves, frees them, or ends.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from kvdepot.errors import UnknownContext
from kvdepot.layout import KVLayout
from kvdepot.storage.keys import NamespaceSpec
from kvdepot.types import ClientId, ContextId, LeaseId, ObjectKey


@dataclass(slots=True)
class Context:
    id: ContextId
    owner: ClientId
    layout: KVLayout
    spec: NamespaceSpec
    chunk_bytes: int
    _namespaces: dict[str, bytes]

    @property
    def chunk_size(self) -> int:
        return self.spec.chunk_size

    @property
    def rows(self) -> int:
        """Rows of a chunk on the wire: one per (key/value, layer)."""
        return self.layout.kv_factor * self.layout.num_layers

    def namespace(self, cache_salt: str) -> bytes:
        ns = self._namespaces.get(cache_salt)
        if ns is None:
            if len(self._namespaces) > 4096:
                self._namespaces.clear()  # bounded: salts can be per-user
            ns = self._namespaces[cache_salt] = self.spec.digest(cache_salt)
        return ns

    def keys(self, hashes: list[bytes], cache_salt: str) -> list[ObjectKey]:
        ns = self.namespace(cache_salt)
        return [ObjectKey(ns + h) for h in hashes]


@dataclass(slots=True)
class Session:
    """A request's lookup state. ``hits`` is None while a prefetch from L2 runs. Fields change under
    the SessionTable lock (the RPC loop and the L2 driver thread both touch them)."""

    lease_id: LeaseId
    keys: list[ObjectKey]  # the keys the lease locks, from chunk 0
    hits: int | None
    lock: bool = True
    all_keys: list[ObjectKey] | None = None  # the whole prompt's keys, while a prefetch runs


class FailureCounts:
    """Per-request problems the server saw, by class (thread-safe): each is one request's miss, never
    a reason for anyone to stop caching. ``lease_expired_frees``: locks freed after their lease had
    already ended; ``short_retrieves``: retrieves that found fewer chunks than asked (evicted, or their
    lookup's locks ended, since the lookup)."""

    CLASSES = ("lease_expired_frees", "short_retrieves")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.CLASSES, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class ContextRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._contexts: dict[ContextId, Context] = {}

    def __len__(self) -> int:
        return len(self._contexts)

    def add(self, owner: ClientId, layout: KVLayout, spec: NamespaceSpec) -> Context:
        with self._lock:
            ctx = Context(ContextId(next(self._ids)), owner, layout, spec, layout.chunk_bytes(spec.chunk_size), {})
            self._contexts[ctx.id] = ctx
            return ctx

    def get(self, context_id: int, owner: ClientId) -> Context:
        ctx = self._contexts.get(ContextId(context_id))
        if ctx is None or ctx.owner != owner:
            raise UnknownContext(f"context {context_id} is not registered by this client")
        return ctx

    def remove(self, context_id: int, owner: ClientId) -> Context:
        with self._lock:
            ctx = self.get(context_id, owner)
            del self._contexts[ctx.id]
            return ctx

    def largest_chunk_bytes(self) -> int:
        with self._lock:
            return max((c.chunk_bytes for c in self._contexts.values()), default=0)

    def owned_by(self, owner: ClientId) -> int:
        return sum(1 for c in self._contexts.values() if c.owner == owner)

    def remove_owner(self, owner: ClientId) -> list[Context]:
        with self._lock:
            gone = [c for c in self._contexts.values() if c.owner == owner]
            for c in gone:
                del self._contexts[c.id]
            return gone


class SessionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[tuple[ContextId, str], Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def put(self, context_id: ContextId, session_id: str, session: Session) -> Session | None:
        """Store a session's state; returns the one it replaced (whose locks the caller must release)."""
        with self._lock:
            old = self._sessions.get((context_id, session_id))
            self._sessions[(context_id, session_id)] = session
            return old

    def get(self, context_id: ContextId, session_id: str) -> Session | None:
        return self._sessions.get((context_id, session_id))

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def is_current(self, context_id: ContextId, session_id: str, session: Session) -> bool:
        """Call with ``lock`` held: is ``session`` still the one filed under this id?"""
        return self._sessions.get((context_id, session_id)) is session

    def take_lease(self, session: Session) -> LeaseId:
        """Hand the session's locks to a retrieve (the session keeps no lease afterwards)."""
        with self._lock:
            lease, session.lease_id = session.lease_id, LeaseId(0)
            return lease

    def pop(self, context_id: ContextId, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop((context_id, session_id), None)

    def pop_context(self, context_id: ContextId) -> list[Session]:
        with self._lock:
            keys = [k for k in self._sessions if k[0] == context_id]
            return [self._sessions.pop(k) for k in keys]
