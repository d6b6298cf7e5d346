"""Identifier types shared by every layer.

They are ``NewType``s over plain builtins, so they cost nothing at run time but keep a chunk hash from
being passed where an object key is expected.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NewType

ChunkHash = NewType("ChunkHash", bytes)
"""The chained hash of one chunk of tokens (see ``kvdepot.hashing``)."""

ObjectKey = NewType("ObjectKey", bytes)
"""A stored object's identity: a 16-byte namespace digest (model, rank, layout, salt) + its ChunkHash."""

ClientId = NewType("ClientId", bytes)
"""The ZeroMQ routing id of a connected client."""

ContextId = NewType("ContextId", int)
"""A registered KV context (one engine worker's model, rank and layout)."""

LeaseId = NewType("LeaseId", int)
"""A lease on a set of L1 objects: a write reservation or a group of read locks."""

SessionId = NewType("SessionId", str)
"""An engine request id; lookup locks and prefetch state are kept per session."""

NAMESPACE_BYTES = 16


class SlotStatus(IntEnum):
    """Per-chunk outcome of a store reservation (wire values, append-only)."""

    ALLOCATED = 0  # a slot was reserved: write it, then commit
    EXISTS = 1  # already stored (READY): nothing to write
    BUSY = 2  # another writer holds it: nothing to write
    NO_SPACE = 3  # L1 is full of locked objects: not stored
    OVER_QUOTA = 4  # one chunk is larger than its cache_salt's quota: never stored (raise the quota)
