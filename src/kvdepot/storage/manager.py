"""StorageManager: the facade the server's handlers see. It owns the arena, the object table and the
background work that keeps L1 healthy (prefault, watermark eviction, lease expiry)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvdepot.config import StorageConfig
from kvdepot.errors import ConfigError
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.arena import HEADER_BYTES, Prefaulter, SharedArena
from kvdepot.storage.controllers import Placement, PrefetchController, StoreController, TierDriver
from kvdepot.storage.eviction import make_policy
from kvdepot.storage.l1 import HolderAlive, L1Stats, ObjectTable
from kvdepot.storage.l2 import registry

log = logging.getLogger(__name__)

ALIGNMENT = 4096


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


@dataclass(frozen=True)
class PrefaultStatus:
    state: str
    progress: float
    finished: bool
    supported: bool
    error: str = ""


class StorageManager:
    def __init__(self, config: StorageConfig, holder_alive: HolderAlive | None = None) -> None:
        """``holder_alive(client)``: may that client's process still touch arena memory it was given?
        (the server's liveness tracker answers; without one, every client is assumed to run)."""
        self.config = config
        # Tiers first: a tier that cannot be built must fail before the arena (real memory) exists.
        self.tiers = [registry.build(registry.parse_spec(spec, i)) for i, spec in enumerate(config.l2)]
        self.arena = SharedArena.create(
            config.l1_size_bytes + HEADER_BYTES, shm_dir=config.shm_dir, allow_over_memory=config.l1_over_memory
        )
        allocator = ExtentAllocator(config.l1_size_bytes, alignment=ALIGNMENT, base=HEADER_BYTES)
        extra = {} if holder_alive is None else {"holder_alive": holder_alive}
        self.table = ObjectTable(allocator, make_policy(config.eviction_policy), lease_ttl_s=config.lease_ttl_s, **extra)
        self.eviction = EvictionController(self.table, config.high_watermark, config.low_watermark)
        self.prefaulter = Prefaulter(self.arena) if config.prefault else None
        self.driver: TierDriver | None = None
        self.store_controller: StoreController | None = None
        self.prefetcher: PrefetchController | None = None
        if self.tiers:
            self.driver = TierDriver(self.tiers)
            self.store_controller = StoreController(
                self.table, self.arena, self.tiers, self.driver.wake, Placement(config.l2_placement), config.l2_queue_limit
            )
            self.prefetcher = PrefetchController(self.table, self.arena, self.tiers, self.driver.wake)
            self.driver.add(self.store_controller.step)
            self.driver.add(self.prefetcher.step)
            self.table.add_ready_listener(self.store_controller.on_ready)

    def start(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.start()
        self.eviction.start()
        for tier in self.tiers:
            try:
                tier.start()
            except OSError as exc:  # e.g. an fs path that cannot be made: its configuration is wrong
                raise ConfigError(f"--l2 tier {tier.name} ({tier.kind}): cannot start: {exc}") from None
            except ValueError as exc:  # e.g. a directory another server's tier holds
                raise ValueError(f"--l2 tier {tier.name} ({tier.kind}): {exc}") from None
        if self.driver is not None:
            self.driver.start()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.stop()
        for tier in self.tiers:
            tier.close()
        self.eviction.stop()
        if self.prefaulter is not None:
            self.prefaulter.stop()
        self.arena.close()

    def tiers_status(self) -> list[dict]:
        out = []
        for tier in self.tiers:
            u = tier.usage()
            out.append({f: getattr(u, f) for f in u.__dataclass_fields__})
        return out

    def controllers_status(self) -> dict:
        if self.store_controller is None or self.prefetcher is None:
            return {}
        return {"store": vars(self.store_controller.snapshot()), "prefetch": vars(self.prefetcher.snapshot())}

    def stats(self) -> L1Stats:
        return self.table.stats()

    def prefault_status(self) -> PrefaultStatus:
        p = self.prefaulter
        if p is None:
            return PrefaultStatus("off", 0.0, False, False)
        return PrefaultStatus(p.state.value, p.progress, p.finished, p.supported, p.error)
