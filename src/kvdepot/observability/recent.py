"""The latest things that happened, for people: a bounded ring of plain dicts behind ``/events/recent``.

Each entry is ``{"seq", "t", "kind", ...fields}`` (``t``: wall-clock seconds; ``seq``: this ring's own
count, so a reader polling with ``after=`` sees each entry once). One way in, ``add(kind, **fields)``:
the event bus feeds it L1 object events and error replies (``bus_feed``), a log handler warnings. Thread-safe; the oldest entries fall off when it is full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from kvdepot.events import L1Changed, RequestDone

DEFAULT_CAPACITY = 512


class RecentEvents:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def capacity(self) -> int:
        return self._ring.maxlen or 0

    def add(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self._seq += 1
            self._ring.append({"seq": self._seq, "t": round(time.time(), 3), "kind": kind, **fields})

    def latest(self, n: int = DEFAULT_CAPACITY, kinds: Iterable[str] = (), after: int = 0) -> list[dict[str, Any]]:
        """The latest ``n`` entries (of ``kinds``, when given; newer than ``seq`` ``after``), newest last."""
        wanted = frozenset(kinds)
        with self._lock:
            entries = [e for e in self._ring if e["seq"] > after and (not wanted or e["kind"] in wanted)]
        return entries[-n:] if n > 0 else []

    def __len__(self) -> int:
        with self._lock:
            return len(self._ring)


class RecentLogHandler(logging.Handler):
    """Puts warnings and errors logged under ``kvdepot`` into the ring (kind ``warning`` or ``error``)."""

    def __init__(self, ring: RecentEvents, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self._ring = ring

    def emit(self, record: logging.LogRecord) -> None:
        try:
            kind = "error" if record.levelno >= logging.ERROR else "warning"
            self._ring.add(kind, logger=record.name, message=record.getMessage())
        except Exception:  # a log handler must never raise into the code that logged
            self.handleError(record)


def l1_events_to(ring: RecentEvents):
    """An L1 event listener (``kvdepot.events.EventListener``) that adds one entry per batch and kind of
    change: ``l1_stored {objects, bytes}`` and ``l1_removed {because, objects, bytes}``, so a burst of
    stores does not push the warnings out of the ring."""

    def listen(batch) -> None:
        groups: dict[tuple[str, str], list[int]] = {}
        for ev in batch:
            because = ev.because.value if ev.because is not None else ""
            g = groups.setdefault((ev.kind.value, because), [0, 0])
            g[0] += 1
            g[1] += ev.size
        for (kind, because), (objects, nbytes) in groups.items():
            if because:
                ring.add(f"l1_{kind}", because=because, objects=objects, bytes=nbytes)
            else:
                ring.add(f"l1_{kind}", objects=objects, bytes=nbytes)

    return listen


def bus_feed(ring: RecentEvents):
    """An event-bus subscriber (``KINDS``): L1 batches as ``l1_events_to`` adds them, and error replies
    as ``error_reply {type, code, count}``, one entry per (type, code) in each drained batch."""
    l1 = l1_events_to(ring)

    def handle(events: list) -> None:
        errors: dict[tuple[str, str], int] = {}
        for e in events:
            if isinstance(e, L1Changed):
                l1(e.events)
            elif isinstance(e, RequestDone) and e.outcome != "ok":
                errors[(e.rtype, e.outcome)] = errors.get((e.rtype, e.outcome), 0) + 1
        for (rtype, code), n in errors.items():
            ring.add("error_reply", type=rtype, code=code, count=n)

    return handle


BUS_KINDS = (L1Changed, RequestDone)
