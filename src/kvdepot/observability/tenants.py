"""What each tenant (``cache_salt``) holds in L1, tallied from L1's stored/removed events.

Works under every eviction policy (``isolated_lru`` keeps its own per-salt count to enforce quotas;
this one is for showing). Memory is bounded by what L1 holds: a salt leaves the tally with its last
object. Fed by the storage manager's ``subscribe``; read by ``/status`` from any thread. Where the event
bus dropped records (a removal among them, maybe), the tally ``resync``s from what L1 holds then:
otherwise a dropped removal left its object, and its tenant, in the tally for the server's life.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from kvdepot.events import EventKind, ObjectEvent

MAX_EARLY_REMOVALS = 4096


@dataclass
class TenantUsage:
    objects: int = 0
    bytes: int = 0


class TenantTally:
    def __init__(self) -> None:
        self._by_salt: dict[str, TenantUsage] = {}
        self._generations: dict[bytes, tuple[int, str, int]] = {}  # key -> (generation, salt, size) now stored
        self._removed_early: OrderedDict[bytes, int] = OrderedDict()  # key -> a generation removed before its STORED came
        self._lock = threading.Lock()

    def on_events(self, batch: list[ObjectEvent]) -> None:
        """An L1 event listener. Batches may arrive out of order: a REMOVED before its STORED is
        remembered (a bounded few) so the late STORED is not counted; nothing drives a count below zero."""
        with self._lock:
            for ev in batch:
                held = self._generations.get(ev.key)
                if ev.kind is EventKind.STORED:
                    if (held is not None and held[0] >= ev.generation) or self._removed_early.get(ev.key, -1) >= ev.generation:
                        continue
                    if held is not None:
                        self._take(held[1], held[2])
                    self._generations[ev.key] = (ev.generation, ev.salt, ev.size)
                    usage = self._by_salt.setdefault(ev.salt, TenantUsage())
                    usage.objects += 1
                    usage.bytes += ev.size
                elif held is not None and held[0] == ev.generation:
                    del self._generations[ev.key]
                    self._take(held[1], held[2])
                elif held is None or held[0] < ev.generation:
                    self._removed_early[ev.key] = ev.generation
                    if len(self._removed_early) > MAX_EARLY_REMOVALS:
                        self._removed_early.popitem(last=False)

    def resync(self, ready: list[ObjectEvent]) -> None:
        """Start over from ``ready``, what L1 holds now (one STORED event per READY object): the events
        since some were lost. Events published before it and handed over after it change nothing (a
        store it holds is skipped by its generation; a removal of one it lacks is remembered as early)."""
        with self._lock:
            self._by_salt = {}
            self._generations = {}
            for ev in ready:
                self._generations[ev.key] = (ev.generation, ev.salt, ev.size)
                usage = self._by_salt.setdefault(ev.salt, TenantUsage())
                usage.objects += 1
                usage.bytes += ev.size

    def _take(self, salt: str, size: int) -> None:
        usage = self._by_salt[salt]
        usage.objects -= 1
        usage.bytes -= size
        if usage.objects == 0:
            del self._by_salt[salt]

    def snapshot(self) -> dict[str, TenantUsage]:
        with self._lock:
            return {salt: TenantUsage(u.objects, u.bytes) for salt, u in self._by_salt.items()}
