"""``OwedRecords``: the keys whose location record did not reach every owner of it.

A publish is best-effort: an owner that is stalled, overloaded past ``control_timeout_s``, or suspected
after an earlier failure does not get the record, and without a membership change nothing would send
it again, so a page would stay invisible on that replica (and on both, if both missed it) for as long
as it lives. The node owes such keys and pays them back on its heartbeat: the record as the page is
*then* (its current generation, resident or on disk), to the owners of *then*; a key that left
meanwhile is dropped. Bounded: past ``limit`` keys the node owes everything, and pays it back with one
full re-publish.

``OwedUnpublishes``: the same for unpublishes. One that fails or is skipped leaves a record of a page
this node no longer holds, which ``exists`` counts for good (a read finds out only on the data plane).
It is owed per (owner, key) with the newest generation to remove, and sent again to that owner on the
heartbeat; an owner that left is dropped (its shard went with it). Bounded: past ``limit`` entries new
ones are dropped and counted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

DEFAULT_LIMIT = 65536


class OwedRecords:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()
        self._everything = False

    def __repr__(self) -> str:
        return f"OwedRecords({'everything' if self._everything else len(self._keys)})"

    def __len__(self) -> int:
        """Keys owed (the limit when everything is)."""
        return self._limit if self._everything else len(self._keys)

    def owe(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            if self._everything:
                return
            self._keys.update(keys)
            if len(self._keys) > self._limit:
                self._keys.clear()
                self._everything = True

    def take(self) -> tuple[bool, set[bytes]]:
        """(everything owed?, the keys owed), and owes nothing from now on: what fails again is owed again."""
        with self._lock:
            everything, keys = self._everything, self._keys
            self._everything, self._keys = False, set()
            return everything, keys


class OwedUnpublishes:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._owed: dict[tuple[str, bytes], int] = {}  # (owner, key) -> the newest generation to remove
        self.dropped = 0  # past the limit: left as stale records

    def __repr__(self) -> str:
        return f"OwedUnpublishes({len(self._owed)}, dropped={self.dropped})"

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, owner: str, items: Iterable[tuple[bytes, int]]) -> None:
        """(key, generation) pairs ``owner`` did not get; an unpublish removes every generation up to
        the one it names, so a key owed twice keeps the newer."""
        with self._lock:
            for key, generation in items:
                at = (owner, key)
                if at in self._owed:
                    self._owed[at] = max(self._owed[at], generation)
                elif len(self._owed) < self._limit:
                    self._owed[at] = generation
                else:
                    self.dropped += 1

    def take(self) -> dict[str, list[tuple[bytes, int]]]:
        """By owner, the (key, generation) pairs owed, and owes nothing from now on: what fails again is owed again."""
        with self._lock:
            owed, self._owed = self._owed, {}
        by_owner: dict[str, list[tuple[bytes, int]]] = {}
        for (owner, key), generation in owed.items():
            by_owner.setdefault(owner, []).append((key, generation))
        return by_owner
