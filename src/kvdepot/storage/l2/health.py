"""A tier's health: whether its tasks may touch the backend now. Thread-safe (the adapter's worker
threads report outcomes, the submitting threads ask ``admit``).

::

    UP ──failed──► DOWN ──admit, retry interval passed (one probe)──► PROBING ──succeeded──► UP
                    ▲  ▲                                                 │  │
                    │  └──────────────────────── failed ─────────────────┘  │ admit, another interval
                    │                                                       │ passed (a hung probe
                    └── failed (while DOWN: the error is updated) ◄─────────┘ must not block forever)

Every (state, event) pair is defined, so no event is illegal: ``succeeded`` in any state means the
backend answered, so it is UP; ``failed`` in any state makes it DOWN; ``admit`` lets every task through
when UP, and one probe per ``retry_interval_s`` otherwise (the others fail fast).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class HealthState(enum.Enum):
    UP = "up"
    DOWN = "down"
    PROBING = "probing"


class TierHealth:
    def __init__(self, retry_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = HealthState.UP
        self._since = 0.0  # when it went DOWN, or when the last probe was let through
        self._error = ""

    def __repr__(self) -> str:
        return f"TierHealth({self._state.value}, error={self._error!r})"

    @property
    def state(self) -> HealthState:
        with self._lock:
            return self._state

    @property
    def healthy(self) -> bool:
        return self.state is HealthState.UP

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._error

    def admit(self) -> bool:
        """May a task touch the backend now?"""
        with self._lock:
            if self._state is HealthState.UP:
                return True
            if self._clock() - self._since >= self._retry:
                self._state, self._since = HealthState.PROBING, self._clock()
                return True
            return False

    def failed(self, error: str) -> bool:
        """The backend failed a task; returns True if it was UP until now (worth a warning)."""
        with self._lock:
            was_up = self._state is HealthState.UP
            self._state, self._since, self._error = HealthState.DOWN, self._clock(), error
            return was_up

    def succeeded(self) -> bool:
        """The backend answered a task; returns True if it was not UP until now (it recovered)."""
        with self._lock:
            recovered = self._state is not HealthState.UP
            self._state = HealthState.UP
            return recovered
