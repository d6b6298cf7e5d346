"""StorageManager: the one thing the server's handlers and its admin API see of storage.

It owns the arena, the object table, the L2 tiers and the background work that keeps them healthy
(prefault, watermark eviction, the L2 controllers), and offers them as verbs: reserve / commit / abort
a write, lock a prefix / release it, look up (prefetching what L2 holds), renew and end leases, clear
(L1, tiers, or both), quotas, and one status snapshot. Eviction is kicked inside (a reservation, a quota
change); nobody outside reaches into the table, the arena or a controller.

Composition: ``__init__`` builds (tiers first: a tier that cannot be built fails before real memory is
taken), ``start`` starts threads, ``close`` stops them in reverse order. Tier factories receive the
shared services (``TierServices``: the node's identity, the arena, L1's events) from here, not only their
config. ``snapshot`` is typed all the way down, so ``/status`` and ``/metrics`` name every field they show.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from kvdepot.config import EvictionPolicyName, StorageConfig
from kvdepot.errors import ConfigError
from kvdepot.events import NO_EVENTS, EventListener, EventSink, ObjectEvent
from kvdepot.shm import HEADER_BYTES, Prefaulter, SharedArena, liveness_offset
from kvdepot.storage.allocator import SLOT_PAGE_OFFSET, ExtentAllocator
from kvdepot.storage.controllers import (
    BACKGROUND_LEASE_TTL_S,
    EvictionController,
    PrefetchController,
    Prefetched,
    PrefetchJob,
    PrefetchStats,
    StoreController,
    StoreStats,
    TierDriver,
)
from kvdepot.storage.eviction import IsolatedLRUPolicy, make_policy
from kvdepot.storage.l1 import (
    HolderAlive,
    L1Stats,
    ObjectTable,
    QuarantineEntry,
    ReadLock,
    Reservation,
    Toucher,
)
from kvdepot.storage.l2 import registry
from kvdepot.storage.l2.contract import L2Usage, LookupHints, TaskKind, TaskResult, TierServices
from kvdepot.storage.pins import PinInfo, PinState, Protections, SessionInfo, SessionState
from kvdepot.types import ClearScope, ClientId, LeaseId, NodeId, ObjectKey

# The value types handlers and /status hold (a read lock's offsets, who touches a lease, the snapshot's
# parts) come from here too, so that the server imports storage through this module alone.
__all__ = [
    "ClearResult",
    "DeleteResult",
    "L1Stats",
    "L2Usage",
    "PinInfo",
    "PinState",
    "PrefaultStatus",
    "Prefetched",
    "PrefetchStats",
    "QuarantineEntry",
    "QuotaControl",
    "SessionInfo",
    "SessionState",
    "ReadLock",
    "StorageManager",
    "StorageHealth",
    "StorageSnapshot",
    "StoreStats",
    "Toucher",
]

log = logging.getLogger(__name__)

ALIGNMENT = 4096
# Lease ids start at a random point below this: a client's finish (a release sent behind, a late commit)
# meant for a lease of this server before a restart then never names a lease of the new one.
LEASE_ID_SPREAD = 1 << 48
TIER_CLEAR_WAIT_S = 30.0
# At close (a SIGTERM), how long the pushes still queued for the tiers are given to land before the
# rest is dropped (and said so): a graceful stop must not lose what a persistent tier was about to hold.
L2_FLUSH_AT_CLOSE_S = 5.0


@dataclass(frozen=True)
class ClearResult:
    l1_removed: int = 0
    tiers_removed: dict[str, int] = field(default_factory=dict)  # tier name -> objects; -1: failed / timed out


@dataclass(frozen=True)
class DeleteResult:
    l1_removed: int = 0
    l1_doomed: int = 0  # locked or being written: they go when their lease ends, invisible meanwhile
    tiers_removed: dict[str, int] = field(default_factory=dict)  # tier name -> objects; -1: failed / timed out


@dataclass(frozen=True)
class ShmOffer:
    """What a client needs to map the arena, and the liveness lock it must hold while it does."""

    path: str
    size: int
    nonce: bytes
    liveness_lock: int


@dataclass(frozen=True)
class PrefaultStatus:
    state: str
    progress: float
    finished: bool
    supported: bool
    error: str = ""


@dataclass(frozen=True)
class TierHealth:
    name: str
    kind: str
    healthy: bool
    last_error: str


@dataclass(frozen=True)
class StorageHealth:
    """What ``/healthcheck`` says of storage: read from memory only, never asked of a backend."""

    tiers: list[TierHealth]
    prefault: PrefaultStatus


@dataclass(frozen=True)
class StorageSnapshot:
    l1: L1Stats
    prefault: PrefaultStatus
    quarantine: list[QuarantineEntry]
    tiers: list[L2Usage]
    store: StoreStats | None  # None: no L2 tiers, so no L2 controllers
    prefetch: PrefetchStats | None
    shm_path: str
    eviction_policy: EvictionPolicyName


class QuotaControl:
    """Per-``cache_salt`` L1 quotas (the ``isolated_lru`` policy's); a change is enforced at once."""

    def __init__(self, policy: IsolatedLRUPolicy, trim: Callable[[], object], kick: Callable[[], None],
                 pinned: Callable[[str], int] = lambda salt: 0) -> None:  # fmt: skip
        self._policy = policy
        self._trim = trim
        self._kick = kick
        self._pinned = pinned

    def get(self, salt: str) -> int | None:
        return self._policy.quota(salt)

    def set(self, salt: str, quota_bytes: int | None) -> None:
        self._policy.set_quota(salt, quota_bytes)
        # Trimmed here, not only on the eviction thread a moment later: the caller's reply (PUT /quota)
        # says what the tenant holds under its new quota (what is pinned or being read stays).
        self._trim()
        self._kick()

    def used(self, salt: str) -> int:
        return self._policy.used(salt)

    def pinned(self, salt: str) -> int:
        """Bytes of ``salt``'s objects its pins hold: never trimmed, and counted against its quota."""
        return self._pinned(salt)

    def all(self) -> dict[str, int]:
        return self._policy.quotas()


class StorageManager:
    def __init__(
        self, config: StorageConfig, holder_alive: HolderAlive | None = None, node: NodeId = NodeId(""), events: EventSink = NO_EVENTS
    ) -> None:
        """``holder_alive(client)``: may that client's process still touch arena memory it was given?
        (the server's liveness tracker answers; without one, every client is assumed to run).
        ``node``: this server's identity, for tiers that talk to peers. ``events``: where L1's batches,
        the tiers' acknowledged stores and removals, and clears are published (the event bus)."""
        self.config = config
        self._events = events
        # Specs first: a bad one must fail before the arena (real memory) exists.
        specs = [registry.parse_spec(spec, i) for i, spec in enumerate(config.l2)]
        names = [spec.name for spec in specs]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            # /status, the metrics' tier label, a clear's reply and the KV events' medium know a tier by its name
            raise ConfigError(f"--l2: two tiers are named {twice[0]!r}: give each its own name=")
        self._arena = SharedArena.create(
            HEADER_BYTES + ALIGNMENT + config.l1_size_bytes, shm_dir=config.shm_dir, allow_over_memory=config.l1_over_memory
        )
        allocator = ExtentAllocator(config.l1_size_bytes, alignment=ALIGNMENT, base=HEADER_BYTES + SLOT_PAGE_OFFSET)
        extra = {} if holder_alive is None else {"holder_alive": holder_alive}
        policy = make_policy(config.eviction_policy)
        quota_of = policy.quota if isinstance(policy, IsolatedLRUPolicy) else (lambda salt: None)
        self._protections = Protections(config.agent_session_ttl_s, quota_of)
        self._table = ObjectTable(
            allocator, policy, lease_ttl_s=config.lease_ttl_s, protected=self._protections.is_protected,
            pinned=self._protections.is_pinned, first_lease_id=1 + secrets.randbelow(LEASE_ID_SPREAD), **extra
        )
        services = TierServices(node=node, arena=self._arena, events=self._table, sink=events)
        try:
            self._tiers = [registry.build(spec, services) for spec in specs]
        except BaseException:
            self._arena.close()
            raise
        self._eviction = EvictionController(self._table, config.high_watermark, config.low_watermark)
        self._prefaulter = Prefaulter(self._arena) if config.prefault else None
        self._driver: TierDriver | None = None
        self._store: StoreController | None = None
        self._prefetcher: PrefetchController | None = None
        self._clears: dict[tuple[int, int], Future] = {}  # (tier index, task id) -> its result
        self._clears_lock = threading.Lock()
        if self._tiers:
            self._driver = TierDriver(self._tiers)
            self._store = StoreController(
                self._table, self._arena, self._tiers, self._driver.wake, config.l2_placement, config.l2_queue_limit
            )
            self._prefetcher = PrefetchController(self._table, self._arena, self._tiers, self._driver.wake)
            self._driver.add(self._store.step)
            self._driver.add(self._prefetcher.step)
            self._driver.add(self._clear_step)
            self._table.hold_for_l2(self._store.holds)
            self._table.subscribe(self._store.on_events)

    def __repr__(self) -> str:
        return f"StorageManager({self._table!r}, tiers={[t.name for t in self._tiers]})"

    # --- life cycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._prefaulter is not None:
            self._prefaulter.start()
        self._eviction.start()
        for tier in self._tiers:
            try:
                tier.start()
            except OSError as exc:  # e.g. an fs path that cannot be made: its configuration is wrong
                raise ConfigError(f"--l2 tier {tier.name} ({tier.kind}): cannot start: {exc}") from None
            except ConfigError as exc:  # e.g. a directory another tier (here or in another server) holds
                raise ConfigError(f"--l2 tier {tier.name} ({tier.kind}): {exc}") from None
            except ValueError as exc:
                raise ValueError(f"--l2 tier {tier.name} ({tier.kind}): {exc}") from None
        if self._driver is not None:
            self._driver.start()

    def close(self) -> None:
        self._flush_l2(L2_FLUSH_AT_CLOSE_S)
        if self._driver is not None:
            self._driver.stop()
        for tier in self._tiers:
            tier.close()
        self._eviction.stop()
        if self._prefaulter is not None:
            self._prefaulter.stop()
        self._arena.close()

    def _flush_l2(self, timeout_s: float) -> None:
        """Before the tiers close: let the store controller push what is queued and in flight (the
        server takes no new requests by now), for at most ``timeout_s``; then say what was not pushed.
        A tier that is down fails its pushes at once, so it does not hold the stop up."""
        if self._store is None or self._driver is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            s = self._store.snapshot()
            if not s.queued and not s.in_flight:
                return
            if time.monotonic() >= deadline:
                break
            self._driver.wake()
            time.sleep(0.01)
        log.warning(
            "closing with L2 pushes unfinished after %.1f s: %d objects queued and %d batches in flight are "
            "not pushed to the tiers (they are lost with L1)", timeout_s, s.queued, s.in_flight,
        )  # fmt: skip

    # --- capacity and the arena ----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._table.capacity

    @property
    def tier_count(self) -> int:
        return len(self._tiers)

    def tier_names(self) -> list[tuple[str, str]]:
        """(name, kind) of each tier, in lookup order."""
        return [(t.name, t.kind) for t in self._tiers]

    def shm_offer(self, client: ClientId) -> ShmOffer:
        a = self._arena
        return ShmOffer(a.path, a.size, a.nonce, liveness_offset(a.size, client))

    def arena_bytes(self):
        """The whole arena as a writable uint8 array (the server-driven path copies between it and a
        worker's GPU blocks itself, under the leases of its reservations and read locks; it pins it with
        CUDA). Offsets of reservations and read locks index it."""
        return self._arena.buffer

    def lock_held(self, offset: int) -> bool:
        """Does a worker hold the liveness lock at ``offset`` of the arena file?"""
        return self._arena.lock_held(offset)

    # --- writes --------------------------------------------------------------------------------------

    def reserve(
        self,
        keys: Sequence[ObjectKey],
        size: int,
        owner: ClientId,
        salt: str = "",
        *,
        toucher: Toucher,
        protect: Sequence[ObjectKey] = (),
        ttl_s: float | None = None,
    ) -> Reservation:
        """Slots for the absent keys (see ObjectTable.reserve_write); the eviction controller is kicked."""
        res = self._table.reserve_write(keys, size, owner, salt, ttl_s=ttl_s, protect=protect, toucher=toucher)
        self._eviction.kick()
        return res

    def commit(self, lease: LeaseId, owner: ClientId, by_client: bool = False) -> int:
        """``by_client``: the owner named the lease in a request (a COMMIT); the server's own finish of
        its copies passes False. A client may not end a lease the server is still copying into."""
        return self._table.commit_write(lease, owner, by_client)

    def abort(self, lease: LeaseId, owner: ClientId, by_client: bool = False) -> int:
        return self._table.abort_write(lease, owner, by_client)

    def copy_into(self, offset: int, frames: Sequence) -> None:
        """Copy received payload frames, in order, into the slot at ``offset`` (the inline store)."""
        buf = self._arena.buffer
        pos = offset
        for frame in frames:
            src = memoryview(frame).cast("B")
            buf[pos : pos + src.nbytes] = src
            pos += src.nbytes

    # --- reads ---------------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ObjectKey]) -> int:
        return self._table.lookup(keys)

    def lock_prefix(self, keys: Sequence[ObjectKey], owner: ClientId, *, session: str = "", toucher: Toucher) -> ReadLock:
        return self._table.acquire_read(keys, owner, session=session, toucher=toucher)

    def locked_offsets(self, lease: LeaseId, owner: ClientId, start: int, toucher: Toucher) -> list[int]:
        """The offsets under a lease taken earlier (a session's lookup), now told to ``toucher``."""
        return self._table.read_lease_offsets(lease, owner, start, toucher)

    def release(self, lease: LeaseId, owner: ClientId, start: int = 0, end: int | None = None, by_client: bool = False) -> int:
        return self._table.release_read(lease, owner, start, end, by_client)

    def payload(self, offset: int, size: int):
        """The bytes of the object at ``offset``, without a copy (under a read lock: for a send)."""
        return self._arena.buffer[offset : offset + size]

    def prefetch(self, keys: list[ObjectKey], start: int, size: int, salt: str, on_done: Callable[[Prefetched], None],
                 hints: LookupHints | None = None, wanted: Callable[[], bool] | None = None) -> bool:  # fmt: skip
        """Fetch ``keys[start:]`` from the tiers into L1 in the background; ``on_done`` (on the tier
        driver's thread) gets how many more leading chunks are now in L1, and from which tiers
        (``Prefetched``). ``hints`` go to the tiers' lookups. ``wanted()`` (on the driver's thread):
        does anyone still wait for it? Once not, it asks no more tiers and loads nothing more, and
        ``on_done`` gets what it had. False: there are no tiers."""
        if self._prefetcher is None:
            return False
        self._prefetcher.submit(PrefetchJob(keys, start, size, salt, on_done, hints, wanted))
        return True

    # --- leases --------------------------------------------------------------------------------------

    def renew(self, owner: ClientId, leases: Sequence[LeaseId], sessions: Sequence[str]) -> int:
        return self._table.renew(owner, leases, sessions)

    def expire(self) -> int:
        return self._table.expire()

    def release_owner(self, owner: ClientId, why: str, revoked: bool) -> int:
        return self._table.release_owner(owner, why, revoked)

    def recheck_quarantine(self) -> int:
        return self._table.recheck_quarantine() if self._table.stats().quarantined_leases else 0

    def leases_of(self, owner: ClientId) -> int:
        return self._table.leases_of(owner)

    def lease_active(self, lease_id: LeaseId) -> bool:
        return self._table.lease_active(lease_id)

    @property
    def prefetch_bound_s(self) -> float:
        """How long an L2 prefetch may run at most (its lease's TTL: a hung backend ends there)."""
        return BACKGROUND_LEASE_TTL_S

    def quarantine(self) -> list[QuarantineEntry]:
        return self._table.quarantine()

    # --- events --------------------------------------------------------------------------------------

    def subscribe(self, listener: EventListener) -> None:
        """Every batch of L1 stored/removed events (see ObjectTable)."""
        self._table.subscribe(listener)

    def ready_objects(self) -> list[ObjectEvent]:
        """What L1 holds now, as STORED events: where a subscriber that lost events starts over."""
        return self._table.ready_objects()

    # --- admin ---------------------------------------------------------------------------------------

    def clear(self, scope: ClearScope = ClearScope.L1) -> ClearResult:
        """Empty L1, the tiers, or both. Locked L1 objects go when their last lock does; a tier's clear
        is waited for at most TIER_CLEAR_WAIT_S (-1 in the result when it failed or took longer)."""
        with self._push_order():
            on_tiers = scope in (ClearScope.TIERS, ClearScope.ALL)
            if on_tiers and self._prefetcher is not None:
                # Before L1 is emptied: a prefetch loading a tier's copy meanwhile must not bring it back.
                for i in range(len(self._tiers)):
                    self._prefetcher.tier_clear_begins(i)
            l1 = self._table.clear(lambda: self._protections.let_go(None)) if scope in (ClearScope.L1, ClearScope.ALL) else 0
            futures = self._submit_on_every_tier(lambda tier: tier.submit_clear(), self._prefetcher_clear_ended) if on_tiers else []
        return ClearResult(l1, self._await_tiers(futures))

    def delete(self, keys: Sequence[ObjectKey], scope: ClearScope = ClearScope.ALL) -> DeleteResult:
        """Delete these objects from L1, the tiers, or both (pinned or not: deleting is not evicting).
        Locked L1 objects are doomed (see ObjectTable.remove); tiers are waited for as a clear is."""
        with self._push_order():
            removed, doomed = self._table.remove(keys, lambda: self._protections.let_go(keys)) if scope in (ClearScope.L1, ClearScope.ALL) else (0, 0)
            on_tiers = scope in (ClearScope.TIERS, ClearScope.ALL) and bool(keys)
            futures = self._submit_on_every_tier(lambda tier: tier.submit_delete(keys)) if on_tiers else []
        tiers: dict[str, int] = {}
        if on_tiers:
            tiers = self._await_tiers(futures)
            if scope is ClearScope.ALL:
                # A lookup's prefetch may have loaded a tier's copy back into L1 while the tiers were
                # deleting: L1 again, now that they have (a load still running is doomed by this pass).
                again, doomed_again = self._table.remove(keys)
                removed, doomed = removed + again, doomed + doomed_again
        return DeleteResult(removed, doomed, tiers)

    def _push_order(self):
        """Held while a delete or clear removes from L1 and submits its tier tasks: the store controller
        holds it from a batch's read lock to its submission, so a push is either submitted before the
        delete (which then voids it) or finds the objects gone (it pushes none of them)."""
        return self._store.submitting if self._store is not None else contextlib.nullcontext()

    def _submit_on_every_tier(self, submit: Callable, ended: Callable[[int], None] | None = None) -> list[tuple[str, Future]]:
        """Submit one task to every tier: (tier name, the future of its result) each. ``ended(i)`` is
        called once tier ``i``'s task has ended (or could not be submitted)."""
        if self._driver is None:
            return []
        futures = []
        for i, tier in enumerate(self._tiers):
            fut: Future = Future()
            if ended is not None:
                fut.add_done_callback(lambda _, i=i: ended(i))
            try:
                with self._clears_lock:  # submitted under it: its result cannot be taken before it is registered
                    self._clears[(i, submit(tier))] = fut
            except BaseException:
                fut.cancel()  # (its ``ended``, and those of the tiers not reached, run now)
                if ended is not None:
                    for j in range(i + 1, len(self._tiers)):
                        ended(j)
                raise
            futures.append((tier.name, fut))
        self._driver.wake()
        return futures

    def _await_tiers(self, futures: list[tuple[str, Future]]) -> dict[str, int]:
        """Wait for each tier's task at most TIER_CLEAR_WAIT_S: tier name -> its count, -1 when it failed
        or took longer."""
        tiers: dict[str, int] = {}
        for name, fut in futures:
            try:
                result: TaskResult = fut.result(timeout=TIER_CLEAR_WAIT_S)
                tiers[name] = result.value if result.ok else -1
            except FutureTimeout:
                tiers[name] = -1
        return tiers

    def _prefetcher_clear_ended(self, tier: int) -> None:
        if self._prefetcher is not None:
            self._prefetcher.tier_clear_ended(tier)

    def _clear_step(self, results: list[tuple[int, TaskResult]]) -> None:
        for tier_index, result in results:
            if result.kind not in (TaskKind.CLEAR, TaskKind.DELETE):
                continue
            with self._clears_lock:
                fut = self._clears.pop((tier_index, result.task_id), None)
            if fut is not None:
                fut.set_result(result)

    # --- lifecycle: pins and agent sessions (storage/pins.py) -----------------------------------------

    def pin(self, keys: Sequence[ObjectKey], salt: str, ttl_s: float | None = None) -> PinInfo:
        """Pin the leading run of ``keys`` (of ``cache_salt`` ``salt``) that is in L1 now (``ttl_s``: a
        soft pin; None: hard). Keys not in L1 are not pinned: the result says how many were."""

        def protect(found: list[tuple[ObjectKey, int, str]]) -> PinInfo:
            return self._protections.pin(salt, [(key, size) for key, size, _ in found], ttl_s)

        return self._table.with_ready_prefix(keys, protect)

    def unpin(self, pin_id: int) -> PinInfo:
        info = self._protections.unpin(pin_id)
        self._eviction.kick()  # a salt may be over its watermark or quota only because of it
        return info

    def extend_pin(self, pin_id: int, ttl_s: float) -> PinInfo:
        return self._protections.extend(pin_id, ttl_s)

    def pins(self) -> list[PinInfo]:
        return self._protections.pins()

    def pinned_bytes(self, salt: str) -> int:
        return self._protections.pinned_bytes(salt)

    def touch_agent_session(self, salt: str, name: str, keys: Sequence[ObjectKey], ttl_s: float | None = None) -> SessionInfo:
        """A turn of an agent session: open or renew it and move its protection to ``keys``."""
        return self._protections.touch(salt, name, keys, ttl_s)

    def renew_agent_session(self, salt: str, name: str, ttl_s: float | None = None) -> SessionInfo:
        return self._protections.renew(salt, name, ttl_s)

    def close_agent_session(self, salt: str, name: str) -> SessionInfo:
        info = self._protections.close(salt, name)
        self._eviction.kick()
        return info

    def agent_sessions(self) -> list[SessionInfo]:
        return self._protections.sessions()

    def agent_session_state(self, salt: str, name: str) -> SessionState | None:
        return self._protections.session_state(salt, name)

    def expire_protections(self) -> tuple[int, int]:
        """End soft pins and agent sessions past their deadline (the server's housekeeping calls this);
        returns (pins, sessions) ended."""
        ended = self._protections.expire()
        if any(ended):
            self._eviction.kick()
        return ended

    def quotas(self) -> QuotaControl | None:
        """None unless the eviction policy keeps quotas (``isolated_lru``)."""
        policy = self._table.policy
        if not isinstance(policy, IsolatedLRUPolicy):
            return None
        return QuotaControl(policy, self._table.enforce_quotas, self._eviction.kick, self._protections.pinned_bytes)

    # --- status --------------------------------------------------------------------------------------

    def snapshot(self) -> StorageSnapshot:
        """Everything /status and /metrics say of storage. Asks each tier's backend (at most 0.5 s each)."""
        return StorageSnapshot(
            self._table.stats(),
            self._prefault_status(),
            self._table.quarantine(),
            [tier.usage() for tier in self._tiers],
            self._store.snapshot() if self._store is not None else None,
            self._prefetcher.snapshot() if self._prefetcher is not None else None,
            self._arena.path,
            self.config.eviction_policy,
        )

    def health(self) -> StorageHealth:
        """Each tier's health and the prefault's state, without ``snapshot``'s usage queries: those wait
        up to 0.5 s per tier whose backend hangs, and a liveness probe (1 s by default) then failed and
        restarted a server that still served from L1."""
        tiers = [TierHealth(t.name, t.kind, *_tier_health(t)) for t in self._tiers]
        return StorageHealth(tiers, self._prefault_status())

    def _prefault_status(self) -> PrefaultStatus:
        p = self._prefaulter
        if p is None:
            return PrefaultStatus("off", 0.0, False, False)
        return PrefaultStatus(p.state.value, p.progress, p.finished, p.supported, p.error)


def _tier_health(tier) -> tuple[bool, str]:
    """(up, last error): ``health()`` where the adapter has it (every in-tree one); an adapter of another
    package written before it was part of the contract is asked for its usage instead."""
    health = getattr(tier, "health", None)
    if health is not None:
        return health()
    usage = tier.usage()
    return usage.healthy, usage.last_error
