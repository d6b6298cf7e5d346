"""What L1 tells the rest of the system: an object was stored, or a stored object left.

The object table queues these under its lock and hands them to subscribers after it, in batches (see
``kvdepot.storage.l1``). Subscribers are the L2 store controller today; the peer tier's directory
(publishing what this node holds), KV events for routers and metrics subscribe the same way. This
module is at the bottom of the layers, so none of them has to reach into L1 for the types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from kvdepot.types import ClientId, ObjectKey


class EventKind(Enum):
    STORED = "stored"  # became READY: visible to readers
    REMOVED = "removed"  # a READY object left L1


class RemovedBecause(Enum):
    EVICTED = "evicted"
    CLEARED = "cleared"
    DISCARDED = "discarded"  # pushed to every tier and dropped from L1 (skip_l1 placement)
    OVER_QUOTA = "over_quota"
    DELETED = "deleted"  # an operator deleted its prefix (DELETE /cache/prefix)


@dataclass(frozen=True, slots=True)
class ObjectEvent:
    """One object's change. ``generation`` is unique per object ever created in the table, so a newer
    object under the same key is told from an older one even when batches reach a subscriber out of
    order."""

    kind: EventKind
    key: ObjectKey
    generation: int
    size: int
    salt: str
    writer: ClientId | None = None  # STORED: who published it
    because: RemovedBecause | None = None  # REMOVED: why


EventListener = Callable[[list[ObjectEvent]], None]
"""Gets each batch of events, outside the table's lock; it must be quick and must not raise."""


class EventSource(Protocol):
    """Where a listener subscribes to L1's events (the object table, through the storage manager)."""

    def subscribe(self, listener: EventListener) -> None: ...
