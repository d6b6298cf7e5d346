"""What the server knows about its clients' contexts (never about bytes: that is storage).

A context is one engine worker's (model, rank, layout, chunk size), owned by the client that registered
it. (Sessions, one engine request each, are in ``sessions.py``.)
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

from kvdepot.errors import UnknownContext
from kvdepot.keys import NamespaceSpec
from kvdepot.layout import KVLayout
from kvdepot.types import ClientId, ContextId, ObjectKey


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

    def namespaces(self) -> list[tuple[NamespaceSpec, int]]:
        """Each distinct namespace registered now, with its chunk's bytes (for naming objects over HTTP)."""
        with self._lock:
            seen: dict[NamespaceSpec, int] = {}
            for c in self._contexts.values():
                seen.setdefault(c.spec, c.chunk_bytes)
            return list(seen.items())

    def owned_by(self, owner: ClientId) -> int:
        return sum(1 for c in self._contexts.values() if c.owner == owner)

    def remove_owner(self, owner: ClientId) -> list[Context]:
        with self._lock:
            gone = [c for c in self._contexts.values() if c.owner == owner]
            for c in gone:
                del self._contexts[c.id]
            return gone
