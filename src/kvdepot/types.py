"""Identifier types and the small enums every layer shares.

Identifiers are ``NewType``s over plain builtins, so they cost nothing at run time but keep a chunk hash
from being passed where an object key is expected. The enums here travel on the wire or through several
layers (wire, storage, admin), so they live below all of them; each is the one source of its values.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, IntEnum
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

NodeId = NewType("NodeId", str)
"""One kvdepot server in a fleet (``host:port``): what the peer tier's directory records as an owner."""

NO_LEASE = LeaseId(0)
"""No lease: nothing was reserved or locked."""

NAMESPACE_BYTES = 16


class SlotStatus(IntEnum):
    """Per-chunk outcome of a store reservation (wire values, append-only)."""

    ALLOCATED = 0  # a slot was reserved: write it, then commit
    EXISTS = 1  # already stored (READY): nothing to write
    BUSY = 2  # another writer holds it: nothing to write
    NO_SPACE = 3  # L1 is full of locked objects: not stored
    OVER_QUOTA = 4  # one chunk is larger than its cache_salt's quota: never stored (raise the quota)

    @property
    def holds(self) -> bool:
        """Once written (ALLOCATED) or as it is (EXISTS), the chunk is stored: part of a prefix."""
        return self is SlotStatus.ALLOCATED or self is SlotStatus.EXISTS


_SLOT_STATUSES = {int(s): s for s in SlotStatus}


def slot_statuses(wire: Iterable[int]) -> list[SlotStatus]:
    """SlotStatus per chunk from a reply's ints (a dict lookup each: the enum's own call costs ~1 us a
    chunk); a value this client does not know is the ValueError ``SlotStatus(value)`` raises."""
    wire = list(wire)
    try:
        return list(map(_SLOT_STATUSES.__getitem__, wire))
    except KeyError:
        return [SlotStatus(s) for s in wire]


class ClearScope(str, Enum):
    """What a CLEAR empties (the wire's ``ClearRequest.scope`` and the admin API's ``/cache/clear``)."""

    L1 = "l1"  # every unlocked L1 object (locked ones go when their last lock does)
    TIERS = "tiers"  # every object of every L2 tier (of this server's prefix or directory)
    ALL = "all"


def leading_run(flags: Iterable[bool]) -> int:
    """How many of the first items are true: the length of a prefix (chunks after a gap are no hit)."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
