"""The silent-miss alarm: "0 hits, no error" made loud.

The commonest field report about KV caches is a cache that never hits and never complains: a changed
hash seed, chunk size or layout on one side, and every lookup quietly misses. For each model, this
watches what the bus reports (``ChunkRequestDone``) and fires when, over the last ``window_s``:

    the model has stored objects  and  it had lookups  and  none of them hit

Per model::

    QUIET ──a window of lookups with no hit (the model has stored objects)──► FIRING
      ▲                                                                        │
      └──────────────── a hit, or no lookup for a window ──────────────────────┘

Firing logs one warning (and one line when it ends), sets ``kvdepot_silent_miss_alarm{model}`` to 1 and
adds a ``/healthcheck`` reason. A model forgotten to make room (``MAX_MODELS``) takes its series along. ``check`` runs from the server's housekeeping; events come from the bus's
drain thread; both take the one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvdepot.events import ChunkRequestDone

log = logging.getLogger(__name__)

MAX_MODELS = 256  # models watched; beyond that a new one takes the place of one idle for two windows, or is not watched


@dataclass(slots=True)
class _Model:
    stored: bool = False
    last_lookup: float = 0.0
    quiet_since: float = 0.0  # the first lookup since the last hit (0: none yet)
    firing: bool = False
    last_seen: float = 0.0  # any request of it


class SilentMissAlarm:
    KINDS = (ChunkRequestDone,)

    def __init__(self, window_s: float, on_change: Callable[[str, bool], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, on_forget: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.window_s = window_s
        self._on_change = on_change  # (model, firing): the metric
        self._on_forget = on_forget  # (model): a model no longer watched; its metric series goes
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()

    def handle(self, events: list) -> None:
        now = self._clock()
        with self._lock:
            for e in events:
                if e.outcome != "ok":
                    continue
                m = self._models.get(e.model)
                if m is None:
                    if len(self._models) >= MAX_MODELS and not self._forget_idle(now):
                        continue
                    m = self._models[e.model] = _Model()
                m.last_seen = now
                if e.op == "store" and e.found:
                    m.stored = True
                elif e.op == "lookup":
                    m.last_lookup = now
                    if e.found:
                        m.quiet_since = 0.0
                    elif not m.quiet_since:
                        m.quiet_since = now
        self.check()

    def _forget_idle(self, now: float) -> bool:
        """Make room: forget the model longest without a request, if that is two windows or more and it
        is not firing (an alarm stays until it ends). True if one went."""
        name, m = min(self._models.items(), key=lambda item: item[1].last_seen)
        if m.firing or now - m.last_seen < 2 * self.window_s:
            return False
        del self._models[name]
        if self._on_forget is not None:
            self._on_forget(name)  # a fleet rolling model versions would otherwise keep every old one's series
        return True

    def check(self) -> None:
        now = self._clock()
        changes = []
        with self._lock:
            for name, m in self._models.items():
                firing = (
                    m.stored
                    and m.quiet_since > 0
                    and now - m.quiet_since >= self.window_s
                    and now - m.last_lookup < self.window_s
                )
                if firing != m.firing:
                    m.firing = firing
                    changes.append((name, firing))
        for name, firing in changes:
            if firing:
                log.warning(
                    "silent misses: model %r has stored objects, and its lookups have found nothing for %.0f s. Do the clients "
                    "agree on the hash algorithm, chunk size and layout? (the registrations in the log name each one's)",
                    name, self.window_s,
                )
            else:
                log.info("silent misses over: model %r hits again (or has no lookups)", name)
            if self._on_change is not None:
                self._on_change(name, firing)

    def reasons(self) -> list[str]:
        """For /healthcheck: one line per firing model."""
        with self._lock:
            return [
                f"silent misses: model {name!r} has stored objects and no lookup found any for {self.window_s:.0f} s"
                for name, m in self._models.items()
                if m.firing
            ]
