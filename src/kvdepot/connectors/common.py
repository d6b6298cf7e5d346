"""What every engine connector needs around a KVClient: telling a transport failure from a request's
own problem, a circuit breaker per direction, and counting both in the log.

Failure classes:

- **transport** (no connection, a timeout, the server shutting down): the server cannot be reached in
  time, so asking again at once would stall every step. The *failing direction* (lookups, loads or
  saves) is switched off for ``retry_after_s``; the other directions go on.
- **per request** (an expired or revoked lease, a chunk evicted since its lookup, a checksum miss, a
  quota refusal, a bad request): that request recomputes what it lacks, and nothing else changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from kvdepot.errors import ErrorCode, KVDepotError

TRANSPORT_CODES = frozenset(
    {ErrorCode.TIMEOUT, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.CONNECTION, ErrorCode.SHUTTING_DOWN, ErrorCode.VERSION_MISMATCH}
)


def is_transport_failure(exc: BaseException) -> bool:
    """True when the server could not be used at all (the breaker opens); False for a problem of one
    request (it recomputes)."""
    return not isinstance(exc, KVDepotError) or exc.code in TRANSPORT_CODES


def failure_class(exc: BaseException) -> str:
    """A short name for logs and counters: 'transport' or the error code's name in lower case."""
    if is_transport_failure(exc):
        return "transport"
    return exc.code.name.lower() if isinstance(exc, KVDepotError) else type(exc).__name__


class CircuitBreaker:
    """One switch per direction ('lookup', 'load', 'save'): open for ``retry_after_s`` after a transport
    failure in that direction, closed otherwise. Thread-safe (loader threads use it)."""

    def __init__(self, retry_after_s: float, clock=time.monotonic) -> None:
        self._retry = retry_after_s
        self._clock = clock
        self._open_until: dict[str, float] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        now = self._clock()
        return f"CircuitBreaker(open={sorted(d for d, t in self._open_until.items() if t > now)})"

    def allows(self, direction: str) -> bool:
        with self._lock:
            return self._clock() >= self._open_until.get(direction, 0.0)

    def trip(self, direction: str) -> None:
        with self._lock:
            self._open_until[direction] = self._clock() + self._retry

    def trip_all(self, *directions: str) -> None:
        for d in directions:
            self.trip(d)


class FailureTally:
    """Counts failures by (direction, class) and logs them: each new class at once, then a summary at
    most every ``every_s`` seconds, so a burst of misses is visible without flooding the log."""

    def __init__(self, logger: logging.Logger, name: str, every_s: float = 30.0) -> None:
        self._log = logger
        self._name = name
        self._every = every_s
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()
        self._last_summary = 0.0

    def add(self, direction: str, exc: BaseException, what: str, retry_after_s: float | None = None) -> str:
        cls = failure_class(exc)
        with self._lock:
            first = (direction, cls) not in self.counts
            self.counts[(direction, cls)] += 1
            now = time.monotonic()
            summary = now - self._last_summary >= self._every and not first
            if summary:
                self._last_summary = now
                totals = ", ".join(f"{d} {c}: {n}" for (d, c), n in sorted(self.counts.items()))
        if cls == "transport":
            self._log.warning(
                "%s: %s failed (%s); no %ss for %.1fs, everything else goes on", self._name, what, exc, direction, retry_after_s or 0.0
            )
        elif first:
            self._log.warning("%s: %s failed (%s: %s); that request recomputes what it lacks", self._name, what, cls, exc)
        if summary:
            self._log.info("%s: failures so far: %s", self._name, totals)
        return cls

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{d}/{c}": n for (d, c), n in self.counts.items()}
