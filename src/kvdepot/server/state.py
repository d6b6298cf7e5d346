"""What the server knows about its clients' contexts (never about bytes: that is storage).

A context is one engine worker's (model, rank, layout, chunk size), owned by the client that registered
it. (Sessions, one engine request each, are in ``sessions.py``.)
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

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
    _seen: Callable[[Context, str, bytes], None] | None = None  # a namespace this context used the first time
    hash_scheme: str = ""  # how its keys are made from tokens (the handshake)
    pid: int = 0  # its client's process, named when another client cannot share with it

    def terms(self) -> dict[str, str]:
        """What must agree between two contexts of one model and rank for them to share KV."""
        return {"layout": self.spec.layout_fingerprint, "chunk_size": str(self.spec.chunk_size), "hash_scheme": self.hash_scheme or "(unnamed)"}

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
            if self._seen is not None:
                self._seen(self, cache_salt, ns)
        return ns

    def keys(self, hashes: list[bytes], cache_salt: str) -> list[ObjectKey]:
        ns = self.namespace(cache_salt)
        return cast("list[ObjectKey]", [ns + h for h in hashes])  # one cast, not a NewType call per key


_TERMS = ("layout", "chunk_size", "hash_scheme")


class ContextRegistry:
    """The live contexts, by id, and indexed by owner and by (model, world size, rank) and terms, so that
    a registration's checks and a client's goodbye cost what that client or that model has, not what
    every client has (one client registering thousands slowed everyone's requests on the loop)."""

    def __init__(self, on_namespace: Callable[[Context, str, bytes], None] | None = None) -> None:
        """``on_namespace(context, salt, digest)``: a context's first use of a namespace (KV events learn
        what a digest means from it)."""
        self._on_namespace = on_namespace
        self._lock = threading.Lock()
        # From a random start, as lease ids: a client of a restarted server that sends a context id it had
        # before gets UNKNOWN_CONTEXT (and registers again), never the new server's context of that number.
        self._ids = itertools.count(1 + secrets.randbelow(1 << 40))
        self._contexts: dict[ContextId, Context] = {}
        self._by_owner: dict[ClientId, dict[ContextId, Context]] = {}
        # (model, world size, rank) -> the terms its contexts register with -> those contexts
        self._by_group: dict[tuple[str, int, int], dict[tuple[str, ...], dict[ContextId, Context]]] = {}

    def __len__(self) -> int:
        return len(self._contexts)

    @staticmethod
    def _group(spec: NamespaceSpec) -> tuple[str, int, int]:
        return spec.model, spec.world_size, spec.rank

    @staticmethod
    def _terms(ctx: Context) -> tuple[str, ...]:
        terms = ctx.terms()
        return tuple(terms[k] for k in _TERMS)

    def add(self, owner: ClientId, layout: KVLayout, spec: NamespaceSpec, hash_scheme: str = "", pid: int = 0) -> Context:
        with self._lock:
            ctx = Context(ContextId(next(self._ids)), owner, layout, spec, layout.chunk_bytes(spec.chunk_size), {}, self._on_namespace,
                          hash_scheme, pid)  # fmt: skip
            self._contexts[ctx.id] = ctx
            self._by_owner.setdefault(owner, {})[ctx.id] = ctx
            terms = self._terms(ctx)
            self._by_group.setdefault(self._group(spec), {}).setdefault(terms, {})[ctx.id] = ctx
            return ctx

    def _forget(self, ctx: Context) -> None:
        """Under the lock: ``ctx`` out of every index."""
        del self._contexts[ctx.id]
        mine = self._by_owner[ctx.owner]
        del mine[ctx.id]
        if not mine:
            del self._by_owner[ctx.owner]
        group = self._by_group[self._group(ctx.spec)]
        terms = self._terms(ctx)
        del group[terms][ctx.id]
        if not group[terms]:
            del group[terms]
        if not group:
            del self._by_group[self._group(ctx.spec)]

    def cannot_share_with(self, spec: NamespaceSpec, hash_scheme: str) -> tuple[Context, dict[str, str]] | None:
        """A live context of the same model, world size and rank whose KV a context of ``spec`` could
        never read or reuse (another layout, chunk size or hash scheme), and the terms that differ."""
        mine = {"layout": spec.layout_fingerprint, "chunk_size": str(spec.chunk_size), "hash_scheme": hash_scheme or "(unnamed)"}
        with self._lock:
            for terms, contexts in self._by_group.get(self._group(spec), {}).items():
                theirs = dict(zip(_TERMS, terms))
                differ = {k: theirs[k] for k in mine if mine[k] != theirs[k] and not (k == "hash_scheme" and "(unnamed)" in (mine[k], theirs[k]))}
                if differ:
                    return next(iter(contexts.values())), differ
        return None

    def get(self, context_id: int, owner: ClientId) -> Context:
        ctx = self._contexts.get(ContextId(context_id))
        if ctx is None or ctx.owner != owner:
            raise UnknownContext(f"context {context_id} is not registered by this client")
        return ctx

    def owner_of(self, context_id: ContextId) -> ClientId | None:
        ctx = self._contexts.get(context_id)
        return None if ctx is None else ctx.owner

    def remove(self, context_id: int, owner: ClientId) -> Context:
        with self._lock:
            ctx = self.get(context_id, owner)
            self._forget(ctx)
            return ctx

    def largest_chunk_bytes(self) -> int:
        with self._lock:
            return max((c.chunk_bytes for c in self._contexts.values()), default=0)

    def namespaces(self) -> list[tuple[NamespaceSpec, int, frozenset[str]]]:
        """Each distinct namespace registered now, with its chunk's bytes and the hash schemes its
        contexts named ("" for none) (for naming objects over HTTP)."""
        with self._lock:
            seen: dict[NamespaceSpec, tuple[int, set[str]]] = {}
            for c in self._contexts.values():
                seen.setdefault(c.spec, (c.chunk_bytes, set()))[1].add(c.hash_scheme)
            return [(spec, size, frozenset(schemes)) for spec, (size, schemes) in seen.items()]

    def owned_by(self, owner: ClientId) -> int:
        return len(self._by_owner.get(owner, ()))

    def remove_owner(self, owner: ClientId) -> list[Context]:
        with self._lock:
            gone = list(self._by_owner.get(owner, {}).values())
            for c in gone:
                self._forget(c)
            return gone
