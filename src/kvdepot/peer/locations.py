"""A reader's memory of where pages were: key → the location record the directory last gave for it.

A read of a page that was read (or looked up) a moment ago skips the directory round trip and goes
straight to the data plane. Safe because a location is only ever a guess: the owner serves a
(key, generation) only while that exact page is in its pool, and the reader checks every byte against
the record's checksum, so a stale entry costs one data-plane round trip and a fresh directory lookup
(``PeerNode.fetch``), never another page's bytes. Entries live ``ttl_s`` (a heartbeat's scale: a
node that left stops being usable sooner, and those entries are skipped at once), at most
``max_entries`` of them, oldest dropped first. Only resident pages are kept: a page on a disk must be
promoted first, and its promotion gives it a new record.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from kvdepot.peer.directory import from_an_earlier_run
from kvdepot.protocol.messages import PeerLocation

DEFAULT_MAX_ENTRIES = 65536


class LocationCache:
    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[float, PeerLocation]] = {}  # insertion order: oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get_many(self, keys: Sequence[bytes], usable: Mapping[str, int]) -> list[PeerLocation | None]:
        """Each key's remembered location, if it is younger than the TTL and on a usable node (``usable``:
        node -> its run now; a location from an earlier run of it is gone)."""
        now = time.monotonic()
        out: list[PeerLocation | None] = []
        with self._lock:
            for key in keys:
                hit = self._entries.get(key)
                if hit is None:
                    out.append(None)
                elif hit[0] <= now or from_an_earlier_run(hit[1], usable):
                    del self._entries[key]
                    out.append(None)
                else:
                    out.append(hit[1])
        return out

    def put_many(self, locations: Iterable[PeerLocation | None]) -> None:
        expires = time.monotonic() + self.ttl_s
        with self._lock:
            for loc in locations:
                if loc is not None and loc.resident:
                    self._entries.pop(loc.key, None)  # re-inserted last: the order stays oldest first
                    self._entries[loc.key] = (expires, loc)
            if len(self._entries) > self.max_entries:
                self._shrink(time.monotonic())

    def forget(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _shrink(self, now: float) -> None:
        """Drop the expired, then the oldest, down to three quarters of the bound (so that a full cache
        is not shrunk again at every put)."""
        self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
        excess = len(self._entries) - self.max_entries * 3 // 4
        if excess > 0:
            for key in list(self._entries)[:excess]:
                del self._entries[key]
