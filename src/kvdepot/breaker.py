"""A circuit breaker: may a call go to a dependency now, or should it fail fast?

One design serves every place kvdepot guards a dependency that can die or hang: each L2 tier guards its
backend (the adapter's tasks), and each engine connector guards the kvdepot server, one breaker per
direction (lookups, loads, saves, connecting: ``connectors.common.Direction``). Thread-safe: worker
threads report outcomes while other threads ask ``admit``.

::

    UP ──failed──► DOWN ──admit, retry interval passed (one probe)──► PROBING ──succeeded──► UP
                    ▲  ▲                                                 │  │
                    │  └──────────────────────── failed ─────────────────┘  │ admit, another interval
                    │                                                       │ passed (a hung probe
                    └── failed (while DOWN: the error is updated) ◄─────────┘ must not block forever)

Every (state, event) pair is defined, so no event is illegal: ``succeeded`` in any state means the
dependency answered, so it is UP; ``failed`` in any state makes it DOWN; ``admit`` lets every call
through when UP, and one probe per ``retry_interval_s`` otherwise (the others fail fast, so a dead
dependency costs one timeout per interval, not one per call).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable


class BreakerState(enum.Enum):
    UP = "up"
    DOWN = "down"
    PROBING = "probing"


class CircuitBreaker:
    def __init__(self, retry_interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._retry = retry_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.UP
        self._since = 0.0  # when it went DOWN, or when the last probe was let through
        self._error = ""

    def __repr__(self) -> str:
        return f"CircuitBreaker({self._state.value}, error={self._error!r})"

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def up(self) -> bool:
        return self.state is BreakerState.UP

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._error

    def admit(self) -> bool:
        """May a call go to the dependency now?"""
        with self._lock:
            if self._state is BreakerState.UP:
                return True
            if self._clock() - self._since >= self._retry:
                self._state, self._since = BreakerState.PROBING, self._clock()
                return True
            return False

    def failed(self, error: str) -> bool:
        """A call failed; returns True if the breaker was UP until now (worth a warning)."""
        with self._lock:
            was_up = self._state is BreakerState.UP
            self._state, self._since, self._error = BreakerState.DOWN, self._clock(), error
            return was_up

    def succeeded(self) -> bool:
        """The dependency answered; returns True if the breaker was not UP until now (it recovered)."""
        with self._lock:
            if self._state is BreakerState.UP:
                return False
            self._state = BreakerState.UP
            return True
