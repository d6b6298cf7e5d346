"""The event bus: producers publish without waiting; one drain thread feeds the subscribers.

::

    publish(event)  (any thread: RPC loop, workers, L2 driver)
        │  queue full? ──► dropped, counted (tail drop: the newest event goes, publish never waits)
        ▼
    bounded queue ──► drain thread (every TICK_S, or at once when half full) ──► subscribers of the
                      event's type, in subscription order, each handed a list of its events, in order

A subscriber that keeps state from the events (KV events for routers) subscribes to ``Dropped`` too:
after a drop, the drain thread appends one to the queue, so it is handed out after every event
published before the drop, and the subscriber knows where its state stopped being whole.

States: BUILT ──start()──► RUNNING ──close()──► CLOSED. Subscribing happens in BUILT (the composition
root wires everything, then starts); ``close`` delivers what is queued (bounded by a timeout), then
stops; publishing after close is ignored. A subscriber that raises is logged (once a minute) and
counted, and the others still get their events: one broken concern never stops metrics or KV events.
A bus of capacity 0 is off: ``publish`` returns at once and nothing is delivered.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

Handler = Callable[[list], None]
MAX_BATCH = 4096  # events handed out per drain round: bounds the time between two rounds
# The drain thread runs on a tick, not per event: waking it for each publish would make it fight the RPC
# loop for the GIL once per request (a quarter of a PING's latency, measured). A queue half full wakes it
# at once, so a burst never waits a tick to be drained.
TICK_S = 0.02


class BusState(enum.Enum):
    BUILT = "built"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class BusStats:
    capacity: int
    depth: int
    published: int
    dropped: int
    delivered: int
    handler_errors: dict[str, int]


@dataclass(frozen=True, slots=True)
class Dropped:
    """The bus dropped events: every event published before the drop was handed out before this one
    (some published after it may have been too). ``total``: the bus's drops so far."""

    total: int


@dataclass(slots=True)
class _Subscriber:
    concern: str
    handler: Handler
    kinds: tuple[type, ...]
    errors: int = 0
    last_logged: float = 0.0


class EventBus:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._queue: deque = deque()
        self._subscribers: list[_Subscriber] = []
        self._routes: dict[type, list[_Subscriber]] = {}
        self._wake = threading.Event()
        self._wake_at = max(1, capacity // 2)
        self._state = BusState.BUILT
        self._thread: threading.Thread | None = None
        self._published = 0
        self._dropped = 0
        self._drop_lock = threading.Lock()  # taken only to drop: the count must never miss one (see Dropped)
        self._dropped_told = 0  # drops a Dropped was queued for
        self._told = 0  # Dropped records queued (flush waits for them too)
        self._processed = 0  # events taken off the queue and handed out (or found nobody to go to)
        self._delivered = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def state(self) -> BusState:
        return self._state

    def subscribe(self, concern: str, handler: Handler, kinds: Sequence[type]) -> None:
        if self._state is not BusState.BUILT:
            raise RuntimeError(f"subscribe before start (the bus is {self._state.value})")
        self._subscribers.append(_Subscriber(concern, handler, tuple(kinds)))
        self._routes.clear()

    def wants(self, kind: type) -> bool:
        """Does anyone subscribe to this type? (A producer may skip building an event nobody reads.)"""
        return self.enabled and bool(self._route(kind))

    # --- producers ----------------------------------------------------------------------------------

    def publish(self, event: object) -> None:
        if self._state is BusState.CLOSED or not self.capacity:
            return
        if len(self._queue) >= self.capacity:
            with self._drop_lock:
                self._dropped += 1
            return
        self._queue.append(event)
        self._published += 1
        if len(self._queue) >= self._wake_at:
            self._wake.set()

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._state is not BusState.BUILT:
            raise RuntimeError(f"the bus is {self._state.value}")
        self._state = BusState.RUNNING
        if self.capacity:
            self._thread = threading.Thread(target=self._drain, name="kvdepot-events", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        if self._state is BusState.CLOSED:
            return
        was_running = self._state is BusState.RUNNING
        self._state = BusState.CLOSED
        self._wake.set()
        if was_running and self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything published so far has been handed out (tests, orderly shutdown)."""
        target = self._published + self._told
        deadline = time.monotonic() + timeout_s
        while self._processed < target:
            if time.monotonic() > deadline or self._state is not BusState.RUNNING:
                return self._processed >= target
            self._wake.set()
            time.sleep(0.002)
        return True

    def stats(self) -> BusStats:
        return BusStats(
            self.capacity, len(self._queue), self._published, self._dropped, self._delivered,
            {s.concern: s.errors for s in self._subscribers},
        )

    # --- the drain thread ----------------------------------------------------------------------------

    def _drain(self) -> None:
        while True:
            closing = self._state is BusState.CLOSED
            self._tell_drops()
            if not self._queue:
                if closing:
                    return
                self._wake.wait(TICK_S)
                self._wake.clear()
                continue
            batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
            self._hand_out(batch)
            self._processed += len(batch)

    def _tell_drops(self) -> None:
        """Queue a ``Dropped`` behind what is queued now, if events were dropped since the last one:
        every event published before those drops is ahead of it. (The drain thread only: it reads the
        count once, so a drop counted meanwhile is told next round.)"""
        dropped = self._dropped
        if dropped == self._dropped_told:
            return
        self._dropped_told = dropped
        if self._route(Dropped):
            self._queue.append(Dropped(dropped))  # past the capacity, by one: it must not be dropped itself
            self._told += 1

    def _hand_out(self, batch: list) -> None:
        by_subscriber: dict[int, list] = {}
        for event in batch:
            for sub in self._route(type(event)):
                by_subscriber.setdefault(id(sub), []).append(event)
        for sub in self._subscribers:
            events = by_subscriber.get(id(sub))
            if not events:
                continue
            try:
                sub.handler(events)
                self._delivered += len(events)
            except Exception:
                sub.errors += 1
                now = time.monotonic()
                if now - sub.last_logged > 60:
                    sub.last_logged = now
                    log.exception("the %s subscriber of the event bus failed (%d times so far)", sub.concern, sub.errors)

    def _route(self, kind: type) -> list[_Subscriber]:
        route = self._routes.get(kind)
        if route is None:
            route = self._routes[kind] = [s for s in self._subscribers if issubclass(kind, s.kinds)]
        return route
