"""The L1 object table: the state machine of every object in the arena, and the leases that lock them.

Eviction order: the policy is told about a batch's keys (a prompt's chunks) last chunk first, so under
LRU a prompt loses its tail before its head: a head alone is still a prefix hit, a tail alone never is.

Objects::

    absent ──reserve_write──► WRITING ──commit_write──► READY ◄──release_read── READ-LOCKED(n)
               │   (one writer, invisible)   │            │ ──acquire_read──►
               └──abort / lease end──────────┴─► absent   READY & unlocked: evictable unless
                                                          pinned or an agent session's (pins.py);
                                                          awaiting its L2 push: last (hold_for_l2)
                                                          clear while locked: DOOMED (removed when
                                                          the last lock goes; invisible meanwhile)

Leases (every lock is one, owned by a client, with a TTL)::

    ACTIVE ──commit / abort / release──────────────────────────────► finished
      │ ──renew──► ACTIVE (a later deadline)
      │
      └─ TTL passed, or owner declared gone (``expire`` / ``release_owner``)
           │ nobody can still touch its extents ─────────────────────► ENDED (space back at once)
           └ its toucher may still run ───► QUARANTINED ──finish call, or toucher gone──► ENDED

A lease's *toucher* is whoever was told where its bytes are: NOBODY (a LOOKUP lock), the owning CLIENT
(it got arena offsets on the shm path and may write or read them until its process exits), or the
SERVER itself (an inline copy, a send in flight, an L2 task). Space that a possibly-running toucher can
still reach is never reused: a quarantined write keeps its extents allocated (its objects are gone, so
nothing it writes can become visible), and a quarantined read keeps its pins (the bytes it reads stay
what they were, so finishing it afterwards is still a correct read). The table asks ``holder_alive``
whether a CLIENT toucher's process may still run; SERVER touchers always may. A SERVER-touched lease is
ended by the server's own finish only: a client naming it in a COMMIT or release is refused
(``by_client``), since lease ids are a counter anyone can guess. A client with quarantined leases counts
as holding leases (``leases_of``), so the server keeps watching it until they end.

Events: every object gets a generation number when it is created, and an object becoming READY (``stored``)
or a READY object leaving (``removed``: evicted, cleared, discarded, over quota) queues an ``ObjectEvent``
under the lock; subscribers get them after the lock is released, in batches, in the order queued (two
threads' batches may reach subscribers in either order: the generation tells a newer object from an
older one under the same key). The L2 store controller, the peer tier's directory, the KV-events
stream and the metrics all read them.

Every public method is atomic over its batch of keys and holds one lock; ``holder_alive`` and
subscribers are called with the lock released. An illegal transition (committing another client's lease,
releasing an unknown lease) raises a typed error and changes nothing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from kvdepot.errors import IllegalTransition, LeaseExpired, LeaseRevoked, UnknownLease
from kvdepot.events import EventKind, EventListener, ObjectEvent, RemovedBecause
from kvdepot.storage.allocator import ExtentAllocator
from kvdepot.storage.eviction import EvictionPolicy
from kvdepot.types import NO_LEASE, ClientId, LeaseId, ObjectKey, SlotStatus

log = logging.getLogger(__name__)
T = TypeVar("T")



class ObjectState(Enum):
    WRITING = "writing"
    READY = "ready"


class LeaseKind(Enum):
    READ = "read"
    WRITE = "write"


class Toucher(Enum):
    """Who, besides the table, may touch a lease's extents (see the module docstring)."""

    NOBODY = "nobody"
    CLIENT = "client"
    SERVER = "server"


class LeaseState(Enum):
    ACTIVE = "active"
    QUARANTINED = "quarantined"


@dataclass(slots=True)
class L1Object:
    key: ObjectKey
    offset: int
    size: int
    state: ObjectState
    salt: str = ""
    readers: int = 0
    writer: LeaseId = NO_LEASE
    doomed: bool = False  # cleared while locked: removed as soon as the last lock goes
    doomed_by: RemovedBecause = RemovedBecause.CLEARED  # what doomed it: what its removal is told as (a clear or a delete)
    awaiting_l2: bool = False  # READY but not yet taken by the L2 push: evicted last (see hold_for_l2)
    generation: int = 0  # unique per object ever created in this table


@dataclass(frozen=True, slots=True)
class Ending:
    """Why and when a lease was ended by force (for the error its late finisher gets)."""

    why: str
    at: float  # wall-clock time
    revoked: bool = False  # the owner was declared gone (rather than this lease running past its TTL)

    def describe(self, lease_id: LeaseId) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.at)) + f".{int(self.at * 1000) % 1000:03d}"
        verb = "was revoked" if self.revoked else "expired"
        return f"lease {lease_id} {verb} at {stamp} ({self.why}) before it was finished"


@dataclass(slots=True)
class Lease:
    id: LeaseId
    kind: LeaseKind
    owner: ClientId
    keys: list[ObjectKey | None]  # None: released early (FREE_LOOKUP_LOCKS on part of a read lease)
    expires_at: float
    session: str = ""
    toucher: Toucher = Toucher.CLIENT
    state: LeaseState = LeaseState.ACTIVE
    held: list[tuple[int, int]] = field(default_factory=list)  # quarantined write extents (offset, size)
    ending: Ending | None = None


@dataclass(frozen=True, slots=True)
class Reservation:
    lease_id: LeaseId
    offsets: list[int]  # -1 where the status is not ALLOCATED
    statuses: list[SlotStatus]


@dataclass(frozen=True, slots=True)
class ReadLock:
    lease_id: LeaseId  # NO_LEASE when nothing was found
    offsets: list[int]  # one per leading chunk found
    size: int = 0  # bytes per object (all objects of one lookup share a context, so one size)


@dataclass(frozen=True, slots=True)
class QuarantineEntry:
    owner: ClientId
    leases: int
    bytes: int
    since: float  # wall-clock time of the oldest
    why: str


@dataclass(frozen=True, slots=True)
class L1Stats:
    capacity_bytes: int
    used_bytes: int
    objects: int
    ready: int
    writing: int
    read_locked: int
    leases: int
    fragmentation: float
    largest_free_bytes: int
    evicted_objects: int
    expired_leases: int
    quarantined_leases: int = 0
    quarantined_bytes: int = 0
    quota_refused: int = 0
    awaiting_l2: int = 0  # READY objects held until the L2 push takes them
    evicted_awaiting_l2: int = 0  # held objects evicted all the same (nothing else could go): lost to L2


@dataclass
class _Counters:
    evicted: int = 0
    expired: int = 0
    ready: int = 0  # objects in READY (kept as we go: stats() must not walk the table under its lock)
    read_locked: int = 0  # objects with at least one reader
    awaiting_l2: int = 0  # objects with awaiting_l2 set
    evicted_awaiting_l2: int = 0
    quarantined_bytes: int = 0
    quota_refused: int = 0


HolderAlive = Callable[[ClientId], bool]  # may this client's process still touch arena memory?
Protected = Callable[[ObjectKey], bool]  # is this key pinned or held by an agent session? (storage/pins.py)


@dataclass(slots=True)
class _BatchEviction:
    take_held: bool = False  # an allocation of this batch found only held objects to evict


def _always_alive(owner: ClientId) -> bool:
    return True


def _never_protected(key: ObjectKey) -> bool:
    return False


class ObjectTable:
    def __init__(
        self,
        allocator: ExtentAllocator,
        policy: EvictionPolicy,
        lease_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        holder_alive: HolderAlive = _always_alive,
        protected: Protected = _never_protected,
        pinned: Protected | None = None,
        first_lease_id: int = 1,
    ) -> None:
        """``protected``: kept from eviction (pinned, or an agent session's); ``pinned``: of those, the
        ones a tenant's quota does not override either (default: all of them). ``first_lease_id``: where
        lease ids start (a server starts at a random one, so a finish meant for a lease of the server
        before a restart never names a lease of the new one)."""
        self._alloc = allocator
        self._protected = protected  # called under the lock: it must not call back into the table
        self._pinned = pinned or protected
        self._policy = policy
        self._ttl = lease_ttl_s
        self._clock = clock
        self._holder_alive = holder_alive
        self._lock = threading.Lock()
        self._objects: dict[ObjectKey, L1Object] = {}
        # Bytes of WRITING objects per salt: a quota counts what its tenant is writing as well as what
        # it holds, or two concurrent batches would each fit it and overrun it together until the trim.
        self._writing_bytes: dict[str, int] = {}
        self._leases: dict[LeaseId, Lease] = {}  # ACTIVE
        self._by_owner: dict[ClientId, set[LeaseId]] = {}  # ACTIVE, per owner
        self._quarantine: dict[LeaseId, Lease] = {}  # QUARANTINED
        self._ended: OrderedDict[LeaseId, Ending] = OrderedDict()  # recently ended by force
        if first_lease_id < 1:
            raise ValueError(f"first_lease_id must be at least 1 (0 is NO_LEASE), got {first_lease_id}")
        self._ids = itertools.count(first_lease_id)
        self._generations = itertools.count(1)
        self._counters = _Counters()
        self._listeners: list[EventListener] = []
        self._pending: list[ObjectEvent] = []  # queued under the lock, handed out after it
        self._hold_for_l2: Callable[[ClientId], bool] | None = None

    def hold_for_l2(self, writers: Callable[[ClientId], bool]) -> None:
        """Objects whose writer ``writers(owner)`` says goes to L2 are held from the moment they are
        READY (under the same lock: no eviction comes between) until ``release_l2_hold``: an object
        evicted while queued for its push would never reach L2 (LMCache #5350). An allocation takes a
        held object only when nothing else in L1 can go (L2 a whole L1 behind, or hung), so a stalled
        tier never stops L1 taking new KV; each such loss is counted (``evicted_awaiting_l2``). The
        watermark eviction never takes one."""
        self._hold_for_l2 = writers

    def release_l2_hold(self, keys: Sequence[ObjectKey]) -> None:
        """The L2 push took (or gave up on) these keys: they are ordinary READY objects again."""
        with self._lock:
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None and obj.awaiting_l2:
                    obj.awaiting_l2 = False
                    self._counters.awaiting_l2 -= 1

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"ObjectTable(objects={s.objects}, used={s.used_bytes}/{s.capacity_bytes}, leases={s.leases}, "
            f"quarantined={s.quarantined_leases})"
        )

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def lease_ttl_s(self) -> float:
        return self._ttl

    def subscribe(self, listener: EventListener) -> None:
        """``listener(events)`` gets every batch of stored/removed events, outside the table's lock.
        It must be quick and must not raise (a failure is logged and the others still get theirs)."""
        self._listeners.append(listener)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The table's lock; events queued while it was held go to subscribers once it is released."""
        with self._lock:
            yield
            events, self._pending = self._pending, []
        if events:
            for listener in self._listeners:
                try:
                    listener(events)
                except Exception:
                    log.exception("an L1 event subscriber failed")

    # --- writes ----------------------------------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        size: int,
        owner: ClientId,
        salt: str = "",
        ttl_s: float | None = None,
        protect: Sequence[ObjectKey] = (),
        toucher: Toucher = Toucher.CLIENT,
    ) -> Reservation:
        """Reserve a slot of ``size`` bytes per absent key, evicting if needed.

        Keys already READY are EXISTS and keys another writer holds are BUSY. Once a key cannot get
        space, it and every later key are NO_SPACE: a chunk after a gap can never be a prefix hit.
        Keys whose salt's quota is smaller than one object are OVER_QUOTA (refused and counted, rather
        than stored and evicted at once).
        Neither the EXISTS keys nor ``protect`` (the prefix the caller extends) are evicted to make room.
        """
        offsets: list[int] = []
        statuses: list[SlotStatus] = []
        with self._locked():
            lease_id = LeaseId(next(self._ids))
            reserved: list[ObjectKey] = []
            # Keys this batch reports as EXISTS must survive it: evicting one to make room for a later
            # key would leave a gap in the prefix the caller believes is stored.
            keep: set[ObjectKey] = set(protect)
            out_of_space = False
            over_quota = self._policy.refuses(salt, size)
            # The absent keys' slots side by side from one free extent when one holds them all (what
            # quotas or a later status leave unused goes back below); else one by one, evicting as needed.
            absent = 0 if over_quota else sum(1 for key in keys if key not in self._objects)
            run = self._alloc.allocate_run(size, absent) if absent > 1 else []
            used_of_run = 0
            # Once an allocation of this batch found nothing but held objects to evict, the later ones
            # start there: under this lock nothing can become evictable, and each walk is the whole table.
            batch_eviction = _BatchEviction()
            for key in keys:
                obj = self._objects.get(key)
                if obj is not None:
                    if obj.doomed or obj.state is not ObjectState.READY:
                        statuses.append(SlotStatus.BUSY)  # being written, or cleared while still read
                    else:
                        statuses.append(SlotStatus.EXISTS)
                        keep.add(key)
                        self._policy.on_access(key)
                    offsets.append(-1)
                    continue
                if not over_quota and not out_of_space:
                    # Within its quota, a tenant makes room from its own oldest objects, never from other
                    # tenants' (a batch larger than its quota used to flush everyone's cache, then be
                    # trimmed back); what its own cannot make room for is refused, this key and the rest.
                    over_quota = not self._room_in_quota_locked(salt, self._writing_bytes.get(salt, 0) + size, keep)
                if over_quota:
                    statuses.append(SlotStatus.OVER_QUOTA)
                    offsets.append(-1)
                    self._counters.quota_refused += 1
                    continue
                if used_of_run < len(run):
                    offset = run[used_of_run]
                    used_of_run += 1
                else:
                    offset = None if out_of_space else self._allocate_locked(size, keep, batch_eviction)
                if offset is None:
                    out_of_space = True
                    statuses.append(SlotStatus.NO_SPACE)
                    offsets.append(-1)
                    continue
                self._objects[key] = L1Object(
                    key, offset, size, ObjectState.WRITING, salt, writer=lease_id, generation=next(self._generations)
                )
                self._writing_bytes[salt] = self._writing_bytes.get(salt, 0) + size
                reserved.append(key)
                statuses.append(SlotStatus.ALLOCATED)
                offsets.append(offset)
            for unused in run[used_of_run:]:
                self._alloc.free(unused)
            if reserved:
                self._add_lease_locked(
                    Lease(lease_id, LeaseKind.WRITE, owner, list(reserved), self._deadline(ttl_s), toucher=toucher)
                )
            else:
                lease_id = NO_LEASE
        return Reservation(lease_id, offsets, statuses)

    def commit_write(self, lease_id: LeaseId, owner: ClientId, by_client: bool = False) -> int:
        """WRITING -> READY for every object of the lease; returns how many became visible.
        ``by_client``: the owner asked for it by lease id (see ``_check_finisher``)."""
        return self.finish_write(lease_id, owner, publish=None, by_client=by_client)

    def finish_write(
        self, lease_id: LeaseId, owner: ClientId, publish: set[ObjectKey] | None, by_client: bool = False, run: Sequence[ObjectKey] = ()
    ) -> int:
        """End a write lease, publishing the keys in ``publish`` (all when None) and dropping the rest:
        a loader whose backend failed for some keys must not publish what it did not write.

        ``run``: the prompt's keys from its first chunk on that this write extends (a prefetch's). Its
        leading READY run is told to the policy as one run under the same lock, so the head ends most
        recent: published alone, the new tail was more recent than the head already in L1, and the
        next eviction (the watermark's, which a prefetch that fills L1 brings on) took the head first,
        leaving a tail that is never a hit."""
        if lease_id == NO_LEASE:
            return 0
        with self._locked():
            lease = self._take_lease_locked(lease_id, owner, LeaseKind.WRITE, by_client)
            hold = self._hold_for_l2 is not None and self._hold_for_l2(owner)  # one writer: asked once
            ready: list[ObjectKey] = []
            for key in lease.keys:
                obj = self._objects.get(key) if key is not None else None
                if obj is None or obj.writer != lease_id:
                    continue
                if obj.doomed or (publish is not None and key not in publish):
                    self._remove_locked(obj)
                    continue
                self._written_locked(obj)
                obj.state = ObjectState.READY
                obj.writer = NO_LEASE
                self._counters.ready += 1
                if hold:
                    obj.awaiting_l2 = True
                    self._counters.awaiting_l2 += 1
                ready.append(key)
                self._pending.append(ObjectEvent(EventKind.STORED, key, obj.generation, obj.size, obj.salt, writer=owner))
            self._tell_ready_locked(ready)
            if run:
                self._policy.on_access_run(run[: self._ready_run_locked(run)])
        return len(ready)

    def abort_write(self, lease_id: LeaseId, owner: ClientId, by_client: bool = False) -> int:
        """Drop a reservation: its objects vanish and their space is free again."""
        if lease_id == NO_LEASE:
            return 0
        with self._locked():
            lease = self._take_lease_locked(lease_id, owner, LeaseKind.WRITE, by_client)
            return self._drop_write_locked(lease)

    # --- reads -----------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are READY (no lock taken)."""
        with self._lock:
            n = self._ready_run_locked(keys)
            self._policy.on_access_run(keys[:n])
            return n

    def _ready_run_locked(self, keys: Sequence[ObjectKey]) -> int:
        """How many leading keys are READY."""
        n = 0
        for key in keys:
            obj = self._objects.get(key)
            if obj is None or obj.state is not ObjectState.READY or obj.doomed:
                break
            n += 1
        return n

    def acquire_read(
        self,
        keys: Sequence[ObjectKey],
        owner: ClientId,
        session: str = "",
        ttl_s: float | None = None,
        toucher: Toucher = Toucher.CLIENT,
    ) -> ReadLock:
        """Read-lock the leading READY keys under one lease; they cannot be evicted until released."""
        get, ready = self._objects.get, ObjectState.READY  # (locals: an engine's lookup runs this per chunk)
        with self._lock:
            found: list[L1Object] = []
            for key in keys:
                obj = get(key)
                if obj is None or obj.state is not ready or obj.doomed:
                    break
                found.append(obj)
            if not found:
                return ReadLock(NO_LEASE, [])
            lease_id = LeaseId(next(self._ids))
            self._add_readers_locked(found)
            locked = list(keys[: len(found)])
            self._policy.on_access_run(locked)
            self._add_lease_locked(Lease(lease_id, LeaseKind.READ, owner, locked, self._deadline(ttl_s), session, toucher))
            return ReadLock(lease_id, [o.offset for o in found], found[0].size)

    def acquire_read_each(
        self, keys: Sequence[ObjectKey], owner: ClientId, ttl_s: float | None = None, toucher: Toucher = Toucher.SERVER
    ) -> tuple[LeaseId, list[tuple[ObjectKey, int, int]]]:
        """Read-lock every READY key (not only a leading run) under one lease; returns the lease and
        (key, offset, size) of each locked object. For background readers such as the L2 store path."""
        with self._lock:
            found = [o for o in (self._objects.get(k) for k in keys) if o is not None and o.state is ObjectState.READY and not o.doomed]
            if not found:
                return NO_LEASE, []
            lease_id = LeaseId(next(self._ids))
            self._add_readers_locked(found)
            self._add_lease_locked(
                Lease(lease_id, LeaseKind.READ, owner, [o.key for o in found], self._deadline(ttl_s), toucher=toucher)
            )
            return lease_id, [(o.key, o.offset, o.size) for o in found]

    def discard(self, keys: Sequence[ObjectKey]) -> int:
        """Remove READY objects that nobody reads (L2-only placement); returns how many went. Never one
        awaiting its own L2 push: the key was stored again after the pushed object went (that object was
        removed or doomed meanwhile), and this one has reached no tier yet."""
        with self._locked():
            n = 0
            for key in keys:
                obj = self._objects.get(key)
                if (
                    obj is not None
                    and obj.state is ObjectState.READY
                    and obj.readers == 0
                    and not obj.awaiting_l2
                    and not self._protected(key)
                ):
                    self._remove_locked(obj, RemovedBecause.DISCARDED)
                    n += 1
            return n

    def read_lease_offsets(
        self, lease_id: LeaseId, owner: ClientId, start: int = 0, toucher: Toucher | None = None
    ) -> list[int]:
        """Offsets of a read lease's objects from ``keys[start]`` up to the first released one (so a
        retrieve can reuse the locks its lookup took). ``toucher``: who is now told the offsets."""
        with self._lock:
            lease = self._get_lease_locked(lease_id, owner, LeaseKind.READ)
            out = []
            for key in lease.keys[start:]:
                if key is None:
                    break
                out.append(self._objects[key].offset)
            if toucher is not None and toucher is not Toucher.NOBODY:
                lease.toucher = toucher
            return out

    def release_read(self, lease_id: LeaseId, owner: ClientId, start: int = 0, end: int | None = None, by_client: bool = False) -> int:
        """Release the read locks on ``keys[start:end]`` of a lease (all by default); returns how many.

        The lease ends when none of its locks is left. A quarantined read lease is released whole: its
        pins were kept, so what its holder read was never changed under it.
        """
        if lease_id == NO_LEASE:
            return 0
        with self._locked():
            held = self._quarantine.get(lease_id)
            if held is not None and held.owner == owner and held.kind is LeaseKind.READ:
                self._check_finisher(held, by_client)
                return self._let_go_locked(held)
            lease = self._get_lease_locked(lease_id, owner, LeaseKind.READ)
            self._check_finisher(lease, by_client)
            keys = lease.keys
            start = max(0, start)
            stop = len(keys) if end is None or end < 0 else min(end, len(keys))
            released = self._unlock_reads_locked(keys[start:stop])
            keys[start:stop] = [None] * max(0, stop - start)
            if keys.count(None) == len(keys):  # one C pass, not a generator per key
                self._forget_lease_locked(lease)
            return released

    # --- lease life ------------------------------------------------------------------------------

    def renew(self, owner: ClientId, lease_ids: Sequence[LeaseId] = (), sessions: Sequence[str] = (), ttl_s: float | None = None) -> int:
        """Push the deadline of the owner's named leases, and of every lease of the named sessions, to
        now + TTL; returns how many were renewed. Unknown or ended ones are skipped (not an error: the
        renewal raced with their end)."""
        wanted_sessions = set(sessions)
        with self._lock:
            deadline = self._deadline(ttl_s)
            renewed = 0
            mine = self._by_owner.get(owner, ())
            for lease_id in lease_ids:
                lease = self._leases.get(lease_id)
                if lease is not None and lease.owner == owner:
                    lease.expires_at = max(lease.expires_at, deadline)
                    renewed += 1
            if wanted_sessions:
                for lease_id in mine:
                    lease = self._leases[lease_id]
                    if lease.session and lease.session in wanted_sessions:
                        lease.expires_at = max(lease.expires_at, deadline)
                        renewed += 1
            return renewed

    def expire(self, now: float | None = None) -> int:
        """End every lease whose TTL has passed; returns how many ended (quarantined ones included)."""
        now = self._clock() if now is None else now
        with self._locked():
            due = [lease.id for lease in self._leases.values() if lease.expires_at <= now]
            if not due:
                return 0
            owners = {self._leases[i].owner for i in due}
        alive = {o for o in owners if self._holder_alive(o)}  # outside the lock: it may make syscalls
        ended = 0
        with self._locked():
            ttl = f"TTL {self._ttl:g} s"
            for lease_id in due:
                lease = self._leases.get(lease_id)
                if lease is None or lease.expires_at > now:
                    continue  # finished or renewed meanwhile
                self._end_lease_locked(lease, Ending(ttl, time.time()), lease.owner in alive)
                ended += 1
            self._counters.expired += ended
            return ended

    def release_owner(self, owner: ClientId, why: str = "client gone", revoked: bool = True) -> int:
        """The client is gone (or declared so): end all its leases. Those it may still touch, if its
        process may still run, are quarantined; the others end at once."""
        alive = self._holder_alive(owner)
        with self._locked():
            ids = list(self._by_owner.get(owner, ()))
            ending = Ending(why, time.time(), revoked)
            for lease_id in ids:
                self._end_lease_locked(self._leases[lease_id], ending, alive)
            return len(ids)

    def recheck_quarantine(self) -> int:
        """Let go of quarantined leases whose toucher can no longer run; returns how many went."""
        with self._locked():
            owners = {lease.owner for lease in self._quarantine.values() if lease.toucher is Toucher.CLIENT}
        gone = {o for o in owners if not self._holder_alive(o)}
        if not gone:
            return 0
        with self._locked():
            victims = [lease for lease in self._quarantine.values() if lease.toucher is Toucher.CLIENT and lease.owner in gone]
            for lease in victims:
                self._let_go_locked(lease)
            return len(victims)

    def lease_active(self, lease_id: LeaseId) -> bool:
        """Does this lease still hold what it took (not ended, expired, released or quarantined)?"""
        with self._lock:
            return lease_id in self._leases

    def leases_of(self, owner: ClientId) -> int:
        """The owner's leases, active or quarantined: while any is left, its process must stay watched
        (a quarantine ends when the process is gone, which only a watched process can show)."""
        with self._lock:
            quarantined = sum(1 for lease in self._quarantine.values() if lease.owner == owner)
            return len(self._by_owner.get(owner, ())) + quarantined

    def quarantine(self) -> list[QuarantineEntry]:
        """Quarantined leases per owner: what is held back from reuse, and why."""
        with self._lock:
            per: dict[ClientId, list[Lease]] = {}
            for lease in self._quarantine.values():
                per.setdefault(lease.owner, []).append(lease)
            out = []
            for owner, leases in per.items():
                oldest = min(leases, key=lambda le: le.ending.at if le.ending else 0.0)
                out.append(
                    QuarantineEntry(
                        owner,
                        len(leases),
                        sum(size for le in leases if le.kind is LeaseKind.WRITE for _, size in le.held) + self._pinned_bytes_locked(leases),
                        oldest.ending.at if oldest.ending else 0.0,
                        oldest.ending.why if oldest.ending else "",
                    )
                )
            return out

    # --- capacity --------------------------------------------------------------------------------

    def evict_to(self, target_used_bytes: int) -> int:
        """Evict unlocked READY objects in policy order until usage is at most the target. Never an
        object awaiting its L2 push: this eviction only makes room ahead of need."""
        with self._locked():
            return self._evict_locked(lambda: self._alloc.stats().used <= target_used_bytes, last_resort=False)

    def used_bytes(self) -> int:
        """O(1), for the eviction controller's frequent check (``stats`` walks every object)."""
        with self._lock:
            return self._alloc.stats().used

    def enforce_quotas(self) -> int:
        """Evict what the policy says is over a per-salt quota (unlocked READY objects only). An agent
        session's protection does not outweigh its tenant's quota (a pin does: pins are refused past it)."""
        with self._locked():
            victims = []
            for key in self._policy.quota_excess(lambda key: self._evictable_locked(key, protected=self._pinned)):
                victims.append(self._objects[key])
            for obj in victims:
                self._remove_locked(obj, RemovedBecause.OVER_QUOTA)
            self._counters.evicted += len(victims)
            return len(victims)

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def clear(self, also: Callable[[], object] | None = None) -> int:
        """Remove every object. Locked or half-written ones are doomed: they go when their lease ends.
        ``also`` runs under the lock once they are (the pins letting go of them): it must not call the table."""
        with self._locked():
            if also is not None:
                also()
            removed = 0
            for obj in list(self._objects.values()):
                if obj.state is ObjectState.READY and obj.readers == 0:
                    self._remove_locked(obj, RemovedBecause.CLEARED)
                    removed += 1
                else:
                    obj.doomed = True
            return removed

    def with_ready_prefix(self, keys: Sequence[ObjectKey], act: Callable[[list[tuple[ObjectKey, int, str]]], T]) -> T:
        """Call ``act`` with (key, size, salt) of the leading READY keys while the lock is held, so none
        of them can be evicted before ``act`` protects them (a pin). ``act`` must not call the table."""
        with self._lock:
            found: list[tuple[ObjectKey, int, str]] = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.state is not ObjectState.READY or obj.doomed:
                    break
                found.append((key, obj.size, obj.salt))
            return act(found)

    def remove(self, keys: Sequence[ObjectKey], also: Callable[[], object] | None = None) -> tuple[int, int]:
        """Delete these objects (an operator's DELETE of a prefix, pinned or not): READY unlocked ones go
        now; locked or half-written ones are doomed, as a clear dooms them (they go when their last lease
        does, invisible meanwhile, so a reader is never changed under it). Returns (removed, doomed).
        ``also`` runs under the lock (the pins letting go of them): it must not call the table."""
        removed = doomed = 0
        with self._locked():
            if also is not None:
                also()
            for key in keys:
                obj = self._objects.get(key)
                if obj is None or obj.doomed:
                    continue
                if obj.state is ObjectState.READY and obj.readers == 0:
                    self._remove_locked(obj, RemovedBecause.DELETED)
                    removed += 1
                else:
                    obj.doomed, obj.doomed_by = True, RemovedBecause.DELETED
                    doomed += 1
        return removed, doomed

    def stats(self) -> L1Stats:
        with self._lock:
            a = self._alloc.stats()
            ready, locked = self._counters.ready, self._counters.read_locked
            return L1Stats(
                capacity_bytes=a.capacity,
                used_bytes=a.used,
                objects=len(self._objects),
                ready=ready,
                writing=len(self._objects) - ready,
                read_locked=locked,
                leases=len(self._leases),
                fragmentation=a.fragmentation,
                largest_free_bytes=a.largest_free,
                evicted_objects=self._counters.evicted,
                expired_leases=self._counters.expired,
                quarantined_leases=len(self._quarantine),
                quarantined_bytes=self._counters.quarantined_bytes + self._pinned_bytes_locked(self._quarantine.values()),
                quota_refused=self._counters.quota_refused,
                awaiting_l2=self._counters.awaiting_l2,
                evicted_awaiting_l2=self._counters.evicted_awaiting_l2,
            )

    def ready_objects(self) -> list[ObjectEvent]:
        """Every READY object now, as the STORED event that announced it (a subscriber that lost events
        starts over from it)."""
        with self._lock:
            return [
                ObjectEvent(EventKind.STORED, o.key, o.generation, o.size, o.salt)
                for o in self._objects.values()
                if o.state is ObjectState.READY
            ]

    def get(self, key: ObjectKey) -> L1Object | None:
        """A snapshot of one object (for tests and introspection)."""
        with self._lock:
            obj = self._objects.get(key)
            return None if obj is None else L1Object(**{f: getattr(obj, f) for f in L1Object.__slots__})

    def check_invariants(self) -> None:
        """For tests: leases, reader counts and allocations agree with each other."""
        with self._lock:
            readers: dict[ObjectKey, int] = {}
            held_extents = 0
            for lease in [*self._leases.values(), *self._quarantine.values()]:
                if lease.state is LeaseState.QUARANTINED:
                    assert lease.id not in self._leases and lease.ending is not None
                    if lease.kind is LeaseKind.WRITE:
                        held_extents += len(lease.held)
                        assert all(k is None for k in lease.keys), "a quarantined write owns no object"
                for key in lease.keys:
                    if key is None:
                        continue
                    obj = self._objects[key]
                    if lease.kind is LeaseKind.READ:
                        assert obj.state is ObjectState.READY
                        readers[key] = readers.get(key, 0) + 1
                    else:
                        assert obj.state is ObjectState.WRITING and obj.writer == lease.id
            for key, obj in self._objects.items():
                assert obj.readers == readers.get(key, 0), f"reader count of {key.hex()} is off"
                assert self._alloc.size_of(obj.offset) >= obj.size
                if obj.state is ObjectState.WRITING:
                    assert obj.writer in self._leases
            assert self._alloc.stats().allocations == len(self._objects) + held_extents
            assert self._counters.quarantined_bytes == sum(
                size for le in self._quarantine.values() for _, size in le.held
            )
            assert self._counters.ready == sum(1 for o in self._objects.values() if o.state is ObjectState.READY)
            assert self._counters.read_locked == sum(1 for o in self._objects.values() if o.readers)
            assert self._counters.awaiting_l2 == sum(1 for o in self._objects.values() if o.awaiting_l2)
            writing: dict[str, int] = {}
            for o in self._objects.values():
                if o.state is ObjectState.WRITING:
                    writing[o.salt] = writing.get(o.salt, 0) + o.size
            assert self._writing_bytes == writing, f"bytes being written per salt: {self._writing_bytes} != {writing}"
            self._alloc.check_invariants()

    # --- internals (lock held) -------------------------------------------------------------------

    def _deadline(self, ttl_s: float | None) -> float:
        return self._clock() + (self._ttl if ttl_s is None else ttl_s)

    def _allocate_locked(self, size: int, keep: set[ObjectKey] = frozenset(), batch_eviction: _BatchEviction | None = None) -> int | None:
        if self._alloc.round_up(size) > self._alloc.capacity:
            return None  # can never fit: do not flush the cache trying
        offset = self._alloc.allocate(size)
        if offset is None:
            self._evict_locked(lambda: self._alloc.can_allocate(size), keep, True, batch_eviction)
            offset = self._alloc.allocate(size)
        return offset

    def _evict_locked(
        self, enough: Callable[[], bool], keep: set[ObjectKey] = frozenset(), last_resort: bool = True, batch_eviction: _BatchEviction | None = None
    ) -> int:
        """Evict in policy order until ``enough()``. Objects awaiting their L2 push go last, and only
        with ``last_resort`` (an allocation that cannot wait). ``batch_eviction``: shared by the allocations of
        one locked batch, so that only the first of them looks for an unheld victim in vain."""
        evicted = 0
        take_held = batch_eviction is not None and batch_eviction.take_held
        while not enough():
            # Collect a batch first (the policy must not change while we iterate it), then remove.
            batch: list[L1Object] = []
            protected: list[ObjectKey] = []
            for key in self._policy.candidates():
                if key in keep or not self._evictable_locked(key, take_held):
                    if self._protected(key):
                        protected.append(key)
                    continue
                batch.append(self._objects[key])
                if len(batch) >= 32:
                    break
            # Pinned prefixes sit at the old end of the order (nobody needs to read them to keep them):
            # move them to the recent end, so later scans do not walk them again and again.
            for key in protected:
                self._policy.on_access(key)
            if not batch:
                if take_held or not last_resort or not self._counters.awaiting_l2:
                    break
                take_held = True
                if batch_eviction is not None:
                    batch_eviction.take_held = True
                continue
            for obj in batch:
                if enough():
                    break
                if obj.awaiting_l2:
                    self._counters.evicted_awaiting_l2 += 1
                self._remove_locked(obj)
                evicted += 1
        self._counters.evicted += evicted
        return evicted

    def _evictable_locked(self, key: ObjectKey, take_held: bool = False, protected: Protected | None = None) -> bool:
        """READY, unlocked, not ``protected`` (default: neither pinned nor held by an agent session; the
        quota trim passes ``_pinned``: a tenant's agent sessions keep its objects within its quota, not
        beyond it), and not awaiting its L2 push (unless ``take_held``: the last resort)."""
        obj = self._objects.get(key)
        return (
            obj is not None
            and obj.state is ObjectState.READY
            and not obj.readers
            and not obj.doomed
            and (take_held or not obj.awaiting_l2)
            and not (protected or self._protected)(key)
        )

    def _room_in_quota_locked(self, salt: str, extra: int, keep: set[ObjectKey]) -> bool:
        """Can ``extra`` more bytes of ``salt`` fit its quota, evicting its own oldest objects (never
        ``keep``, the batch's prefix) if needed? True when the salt has no quota."""
        excess = self._policy.over_quota_by(salt, extra)
        if excess <= 0:
            return True
        victims, freed = [], 0
        for key in self._policy.oldest_of(salt):
            if key in keep or not self._evictable_locked(key):
                continue
            obj = self._objects[key]
            victims.append(obj)
            freed += obj.size
            if freed >= excess:
                break
        if freed < excess:
            return False
        for obj in victims:
            self._remove_locked(obj, RemovedBecause.OVER_QUOTA)
        self._counters.evicted += len(victims)
        return True

    def _written_locked(self, obj: L1Object) -> None:
        """``obj`` leaves WRITING (made READY, dropped or quarantined): its tenant no longer writes it."""
        left = self._writing_bytes[obj.salt] - obj.size
        if left:
            self._writing_bytes[obj.salt] = left
        else:
            del self._writing_bytes[obj.salt]

    def _remove_locked(self, obj: L1Object, because: RemovedBecause = RemovedBecause.EVICTED) -> None:
        del self._objects[obj.key]
        if obj.state is ObjectState.WRITING:
            self._written_locked(obj)
        self._alloc.free(obj.offset)
        self._policy.on_remove(obj.key)
        if obj.awaiting_l2:  # cleared, expired or corrupt: the push will count it as gone
            self._counters.awaiting_l2 -= 1
        if obj.state is ObjectState.READY:
            self._counters.ready -= 1
            if obj.doomed:
                because = obj.doomed_by
            self._pending.append(ObjectEvent(EventKind.REMOVED, obj.key, obj.generation, obj.size, obj.salt, because=because))

    def _tell_ready_locked(self, keys: list[ObjectKey]) -> None:
        for key in reversed(keys):  # head most recent: the tail goes first
            obj = self._objects[key]
            self._policy.on_ready(key, obj.salt, obj.size)

    def _add_readers_locked(self, objects: list[L1Object]) -> None:
        """One more read lock on each object (one call per request: a lookup locks every chunk)."""
        newly_read = 0
        for obj in objects:
            obj.readers += 1
            newly_read += obj.readers == 1
        self._counters.read_locked += newly_read

    def _unlock_reads_locked(self, keys: list[ObjectKey | None]) -> int:
        """Drop one read lock on each key that is not None (released already); an object that was
        cleared while read goes once its last reader lets go. Returns how many locks were dropped."""
        objects, released, unread, doomed = self._objects, 0, 0, []
        for key in keys:
            if key is None:
                continue
            obj = objects[key]
            obj.readers -= 1
            released += 1
            if obj.readers == 0:
                unread += 1
                if obj.doomed:
                    doomed.append(obj)
        self._counters.read_locked -= unread
        for obj in doomed:
            self._remove_locked(obj)
        return released

    def _add_lease_locked(self, lease: Lease) -> None:
        self._leases[lease.id] = lease
        self._by_owner.setdefault(lease.owner, set()).add(lease.id)

    def _forget_lease_locked(self, lease: Lease) -> None:
        del self._leases[lease.id]
        owned = self._by_owner.get(lease.owner)
        if owned is not None:
            owned.discard(lease.id)
            if not owned:
                del self._by_owner[lease.owner]

    def _get_lease_locked(self, lease_id: LeaseId, owner: ClientId, kind: LeaseKind) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            ending = self._ended.get(lease_id)
            if ending is not None:
                raise (LeaseRevoked if ending.revoked else LeaseExpired)(ending.describe(lease_id))
            raise UnknownLease(f"no lease {lease_id}")
        if lease.owner != owner:
            raise UnknownLease(f"lease {lease_id} belongs to another client")
        if lease.kind is not kind:
            raise IllegalTransition(f"lease {lease_id} is a {lease.kind.value} lease, not {kind.value}")
        return lease

    @staticmethod
    def _check_finisher(lease: Lease, by_client: bool) -> None:
        """A lease the server itself touches (an inline copy, a send, a GPU copy in flight) ends when the
        server's copy is over, never because its owner named it in a COMMIT or a release: lease ids are
        a counter, so a client could otherwise free space the server is still writing or reading."""
        if by_client and lease.toucher is Toucher.SERVER:
            raise IllegalTransition(f"lease {lease.id} is the server's own copy in progress: only the server ends it")

    def _take_lease_locked(self, lease_id: LeaseId, owner: ClientId, kind: LeaseKind, by_client: bool = False) -> Lease:
        held = self._quarantine.get(lease_id)
        if held is not None and held.owner == owner and held.kind is kind:
            self._check_finisher(held, by_client)
            # The late finisher of a quarantined write: its block is over, so its space can go back.
            # Nothing it wrote was kept (the objects went when the lease ended).
            self._let_go_locked(held)
        lease = self._get_lease_locked(lease_id, owner, kind)
        self._check_finisher(lease, by_client)
        self._forget_lease_locked(lease)
        return lease

    def _drop_write_locked(self, lease: Lease) -> int:
        dropped = 0
        for key in lease.keys:
            obj = self._objects.get(key) if key is not None else None
            if obj is not None and obj.writer == lease.id:
                self._remove_locked(obj)
                dropped += 1
        return dropped

    def _end_lease_locked(self, lease: Lease, ending: Ending, toucher_alive: bool) -> None:
        """Forced end (TTL, or owner gone). Remembered, so a late finisher gets the reason."""
        self._forget_lease_locked(lease)
        lease.ending = ending
        self._ended[lease.id] = ending
        while len(self._ended) > 65536:
            self._ended.popitem(last=False)
        quarantine = lease.toucher is Toucher.SERVER or (lease.toucher is Toucher.CLIENT and toucher_alive)
        if not quarantine:
            if lease.kind is LeaseKind.WRITE:
                self._drop_write_locked(lease)
            else:
                self._unlock_reads_locked(lease.keys)
            return
        lease.state = LeaseState.QUARANTINED
        self._quarantine[lease.id] = lease
        if lease.kind is LeaseKind.WRITE:
            # The objects go (the key is free for another writer, and nothing of this writer can ever
            # become visible); the extents stay allocated until the toucher lets go.
            for i, key in enumerate(lease.keys):
                obj = self._objects.get(key) if key is not None else None
                lease.keys[i] = None
                if obj is None or obj.writer != lease.id:
                    continue
                del self._objects[obj.key]
                self._written_locked(obj)
                lease.held.append((obj.offset, obj.size))
                self._counters.quarantined_bytes += obj.size
        # A read keeps its pins: the objects stay READY for everyone, just not evictable yet.

    def _let_go_locked(self, lease: Lease) -> int:
        """End a quarantine: free its extents (write) or drop its pins (read). Returns the pins dropped."""
        del self._quarantine[lease.id]
        released = 0
        if lease.kind is LeaseKind.WRITE:
            for offset, size in lease.held:
                self._alloc.free(offset)
                self._counters.quarantined_bytes -= size
            lease.held.clear()
        else:
            released = self._unlock_reads_locked(lease.keys)
            lease.keys[:] = [None] * len(lease.keys)
        return released

    def _pinned_bytes_locked(self, leases: Iterable[Lease]) -> int:
        """Bytes of the objects these quarantined read leases pin, each object once: paused readers of a
        shared prefix hold several leases on the same objects, and its bytes are held back once."""
        keys = {k for le in leases if le.kind is LeaseKind.READ for k in le.keys if k is not None}
        return sum(self._objects[k].size for k in keys)
