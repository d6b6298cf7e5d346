"""The L2 adapter contract: the types every tier speaks, and the Protocol every adapter implements.

Contract (every adapter, whatever its backend; ``tests/contract`` pins it for each one):
- ``submit_*`` never blocks on the backend: it queues the work and returns a ``TaskId`` at once.
- When a task finishes, the adapter's ``eventfd`` becomes readable; ``completed()`` returns every
  finished task's ``TaskResult`` exactly once (the caller owns it from then on).
- A store is all-or-nothing per object: a failed or torn write is never visible to a lookup or load.
- A load checks the object's checksum; a corrupt object is a miss (deleted, and counted), never bytes.
- ``lookup_and_lock`` counts the leading keys present and pins them against the adapter's own eviction
  until ``unlock``; a pin is a hint that ends with the process (L2 data outlives us, pins do not).
- A backend that fails (down, full, slow) makes the adapter *unhealthy*: tasks then fail fast without
  touching it, and it is probed again after a retry interval, so the request path never waits on a
  dead tier and the tier comes back on its own.

Buffers: ``submit_store`` reads the given payload views until the task completes; the caller keeps
them alive (L1 objects under a read lease). ``submit_load`` writes into the given views likewise.

An adapter type is registered as ``ADAPTER = AdapterType(name, config, factory)`` in a module named
``*_adapter.py`` in this package, or through the ``kvdepot.l2_adapters`` entry-point group (how a tier
that lives outside storage, such as the peer tier, plugs in). Its config is a ``ConfigStruct`` with help
text per key, like every server option.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np

from kvdepot.config import ConfigStruct
from kvdepot.events import NO_EVENTS, EventSink, EventSource
from kvdepot.types import NodeId, ObjectKey

TaskId = int


class TaskKind(Enum):
    STORE = "store"
    LOOKUP = "lookup"
    LOAD = "load"
    UNLOCK = "unlock"
    CLEAR = "clear"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class TaskResult:
    """``value`` per kind: STORE list[bool] (stored per key); LOOKUP int (leading keys present and
    pinned); LOAD list[bool] (loaded and verified per key); UNLOCK None; CLEAR int (objects removed);
    DELETE int (of the keys named, how many were present and are gone)."""

    task_id: TaskId
    kind: TaskKind
    value: Any
    ok: bool = True  # False: the backend failed (value is then the all-miss answer)
    error: str = ""


@dataclass(frozen=True, slots=True)
class L2Usage:
    """One tier's state and counters, as ``/status`` and ``/metrics`` show them."""

    name: str
    kind: str
    healthy: bool
    used_bytes: int
    capacity_bytes: int  # 0: unbounded or unknown
    objects: int
    stored: int
    loaded: int
    corrupt: int
    failures: int
    last_error: str
    details: dict[str, Any] | None = None  # what only this kind of tier has to say (the peer tier: members, pull decisions)
    newer_format: int = 0  # loads of a newer kvdepot's objects (servers of two versions sharing the tier): misses, left in place


@dataclass(frozen=True, slots=True)
class LookupHints:
    """What a lookup's engine knows that a tier may use: a router's ``source`` (``HOST[:PORT]`` of where
    the prompt's KV was computed), and what recomputing costs (``chunk_tokens`` per object over the
    engine's ``prefill_tokens_per_s``; 0: unknown). Tiers that cannot use them ignore them."""

    source: str = ""
    chunk_tokens: int = 0
    prefill_tokens_per_s: float = 0.0

    def recompute_s(self, objects: int) -> float | None:
        """Seconds to recompute ``objects`` chunks, or None when the rate is unknown (0 or less, or not
        a finite number: a NaN rate made a NaN cost, which no pull estimate beats, so every pull was refused)."""
        if not 0 < self.prefill_tokens_per_s < math.inf or self.chunk_tokens <= 0:
            return None
        return objects * self.chunk_tokens / self.prefill_tokens_per_s


class ArenaMemory(Protocol):
    """What a tier may use of the L1 arena: its bytes by offset (a tier that serves or fills L1 objects
    in place, like the peer tier's data plane, reads them under the object table's leases)."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...

    def view(self, offset: int, length: int) -> np.ndarray: ...


@dataclass(frozen=True)
class TierServices:
    """What the composition root gives every tier besides its own config: the node it runs in (for
    tiers that talk to peers), the L1 arena (for tiers that read or write it directly) and L1's
    stored/removed events (for tiers that publish what L1 holds). Tiers use what they need; each may be
    absent (a tier built alone, in a test or a benchmark)."""

    node: NodeId = NodeId("")
    arena: ArenaMemory | None = None
    events: EventSource | None = None
    sink: EventSink = NO_EVENTS  # where a tier reports what leaves it on its own (a corrupt object)


class L2Adapter(Protocol):
    name: str
    kind: str

    @property
    def eventfd(self) -> int: ...

    def start(self) -> None: ...

    def submit_store(self, items: Sequence[tuple[ObjectKey, memoryview]]) -> TaskId: ...

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey], hints: LookupHints | None = None) -> TaskId: ...

    def submit_load(self, keys: Sequence[ObjectKey], dests: Sequence[memoryview]) -> TaskId: ...

    def submit_unlock(self, keys: Sequence[ObjectKey]) -> TaskId: ...

    def submit_clear(self) -> TaskId: ...

    def submit_delete(self, keys: Sequence[ObjectKey]) -> TaskId: ...

    def completed(self) -> list[TaskResult]: ...

    def usage(self) -> L2Usage: ...

    def health(self) -> tuple[bool, str]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class AdapterType:
    """One kind of tier: its ``--l2`` type name, its config (a ``ConfigStruct``: unknown keys are refused,
    every key has help text) and a factory ``(tier name, config, services) -> adapter``."""

    name: str
    config: type[ConfigStruct]
    factory: Callable[[str, Any, TierServices], L2Adapter]
    help: str = ""
