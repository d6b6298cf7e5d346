"""``EvictionController``: keeps L1 usage under the high watermark by evicting down to the low one,
and salts under their quotas. It wakes every ``interval_s``, or at once when kicked (a store reserved
space, a quota changed)."""

from __future__ import annotations

import logging
import threading

from kvdepot.storage.l1 import ObjectTable

log = logging.getLogger(__name__)


class EvictionController:
    """Keeps L1 usage under the high watermark by evicting down to the low one.

    It wakes every ``interval_s`` or when ``kick`` is called (after a store reserved space).
    """

    def __init__(self, table: ObjectTable, high: float, low: float, interval_s: float = 0.1) -> None:
        self._table = table
        self._high = int(high * table.capacity)
        self._low = int(low * table.capacity)
        self._interval = interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvdepot-eviction", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run_once(self) -> int:
        n = self._table.enforce_quotas()
        if self._table.used_bytes() > self._high:
            n += self._table.evict_to(self._low)
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                n = self.run_once()
                if n:
                    log.debug("evicted %d objects to the low watermark", n)
            except Exception:  # never let the controller die silently
                log.exception("eviction pass failed")
