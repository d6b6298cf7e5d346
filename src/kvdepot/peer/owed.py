"""``OwedRecords``: the keys whose location record did not reach every owner of it.

A publish is best-effort: an owner that is stalled, overloaded past ``control_timeout_s``, or suspected
after an earlier failure does not get the record, and without a membership change nothing would send
it again, so a page would stay invisible on that replica (and on both, if both missed it) for as long
as it lives. The node owes such keys and pays them back on its heartbeat: the record as the page is
*then* (its current generation, resident or on disk), to the owners of *then*; a key that left
meanwhile is dropped. Bounded: past ``limit`` keys the node owes everything, and pays it back with one
full re-publish.

An unpublish that fails is not owed: the stale record it leaves names a generation the owner no longer
serves, which a reader finds out on the data plane (a miss, then the next replica).
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
