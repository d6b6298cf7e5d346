"""What L1 tells the rest of the system (an object was stored, or a stored object left), and the records
every producer hands the event bus (``kvdepot.observability.bus``).

The object table queues these under its lock and hands them to subscribers after it, in batches (see
``kvdepot.storage.l1``). Subscribers are the L2 store controller today; the peer tier's directory
(publishing what this node holds), KV events for routers and metrics subscribe the same way. This
module is at the bottom of the layers, so none of them has to reach into L1 for the types.

The bus's records are small frozen values built on the request path and read later on the bus's drain
thread (metrics, the trace recorder, the KV-events publisher, the silent-miss alarm, the recent-events
ring). A record never holds a reference into shared memory or a lock. Producers see the bus only as an
``EventSink``, so storage publishes without importing observability.
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


# --- the event bus's records ---------------------------------------------------------------------


class EventSink(Protocol):
    """Where producers publish. ``publish`` never blocks and never raises."""

    def publish(self, event: object) -> None: ...

    def wants(self, kind: type) -> bool:
        """Does anyone subscribe to this type? (A producer skips building an event nobody reads.)"""
        ...


class NoEvents:
    """The sink of a part built without a bus (unit tests, the bus turned off)."""

    def publish(self, event: object) -> None:
        pass

    def wants(self, kind: type) -> bool:
        return False


NO_EVENTS = NoEvents()


@dataclass(frozen=True, slots=True)
class RequestDone:
    """Any RPC request answered: by type name and outcome (``ok`` or the error code's name)."""

    rtype: str
    outcome: str
    duration_s: float  # from receipt to the reply being built
    t_end: float = 0.0  # time.time() when the reply was built (a span ends here and began duration_s before)
    described: bool = False  # a ChunkRequestDone tells more of this request (now or, prefetching, later)


@dataclass(frozen=True, slots=True)
class ChunkRequestDone:
    """A LOOKUP, STORE or RETRIEVE, with what a trace needs to replay it."""

    op: str  # "lookup" | "store" | "retrieve"
    t: float  # time.time() when the request arrived
    duration_s: float
    model: str
    salt: str
    keys: tuple[bytes, ...]  # the request's chunk hashes (the whole chain), in order
    chunk_tokens: int
    chunk_bytes: int
    found: int  # lookup: leading chunks found (after L2); store: chunks stored; retrieve: chunks returned
    outcome: str  # "ok" or an error code's name
    rtype: str = ""  # the request type's name (LOOKUP, STORE_INLINE, PREPARE_RETRIEVE, ...)
    prefetch_s: float = 0.0  # a LOOKUP that prefetched from L2: the last prefetch_s of duration_s were that
    prefetched: int = 0  # ... and the chunks it brought into L1
    # The head of the request's namespace digest: which rank, world size, layout and salt its keys live in
    # (two TP ranks ask for the same chunk hashes; their objects are apart).
    space: bytes = b""


@dataclass(frozen=True, slots=True)
class NamespaceSeen:
    """A context used a namespace for the first time: what the digest at the head of its keys means
    (KV events name a block's model and salt from it)."""

    namespace: bytes
    model: str
    world_size: int
    rank: int
    salt: str
    chunk_tokens: int


@dataclass(frozen=True, slots=True)
class L1Changed:
    """A batch of the object table's events (objects that became READY, objects that left L1)."""

    events: tuple[ObjectEvent, ...]


@dataclass(frozen=True, slots=True)
class TierStored:
    """Objects now durable in an L2 tier (its store task reported them written)."""

    tier: str  # the tier's name (``--l2 ...,name=``; by default its kind and index: fs0)
    kind: str  # "fs", "valkey", "s3", "memory", "peer"
    keys: tuple[ObjectKey, ...]


@dataclass(frozen=True, slots=True)
class TierRemoved:
    """Objects that left an L2 tier through kvdepot (deleted, found corrupt)."""

    tier: str
    kind: str
    keys: tuple[ObjectKey, ...]
    because: str  # "evicted" (the tier's own LRU), "corrupt"


@dataclass(frozen=True, slots=True)
class TierCleared:
    """An L2 tier was emptied (CLEAR of the tiers). What it stores after this is announced after this."""

    tier: str
    kind: str


@dataclass(frozen=True, slots=True)
class ChunkTokens:
    """A store's chunks and their token ids (sent by a client that opted in), before they are committed:
    KV events put them in the blocks' ``token_ids``."""

    keys: tuple[ObjectKey, ...]
    token_ids: bytes  # uint32 little-endian, ``chunk_tokens`` per key, in key order
    chunk_tokens: int


@dataclass(frozen=True, slots=True)
class TierTaskDone:
    """One task of an L2 tier ran against its backend: how long, and whether it failed (metrics)."""

    tier: str
    kind: str
    task: str  # store, lookup, load, clear, delete, ...
    seconds: float
    ok: bool
