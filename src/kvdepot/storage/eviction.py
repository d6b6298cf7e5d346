"""Eviction policies: which READY, unlocked objects go first when L1 needs room.

A policy only orders keys; the object table decides what may actually be evicted (never a locked or
half-written object) and calls the policy under its own lock, so policies need no locking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvdepot.types import ObjectKey


class EvictionPolicy(Protocol):
    name: str

    def on_ready(self, key: ObjectKey) -> None:
        """``key`` became READY (it is now a candidate)."""

    def on_access(self, key: ObjectKey) -> None:
        """``key`` was looked up or read."""

    def on_remove(self, key: ObjectKey) -> None:
        """``key`` left L1 (evicted, cleared, or expired)."""

    def candidates(self) -> Iterator[ObjectKey]:
        """Keys in eviction order, first victim first. The table skips the ones it cannot evict, and
        must not call the other hooks while it iterates (it collects victims first, then removes)."""


class LRUPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()

    def __repr__(self) -> str:
        return f"LRUPolicy(tracked={len(self._order)})"

    def on_ready(self, key: ObjectKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ObjectKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: ObjectKey) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[ObjectKey]:
        return iter(self._order)


class NoopPolicy:
    """Never evicts: a full L1 refuses new stores instead."""

    name = "noop"

    def on_ready(self, key: ObjectKey) -> None:
        pass

    def on_access(self, key: ObjectKey) -> None:
        pass

    def on_remove(self, key: ObjectKey) -> None:
        pass

    def candidates(self) -> Iterator[ObjectKey]:
        return iter(())


POLICIES = {"lru": LRUPolicy, "noop": NoopPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose from {sorted(POLICIES)}") from None
