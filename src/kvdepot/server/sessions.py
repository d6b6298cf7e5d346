"""Sessions: one engine request's lookup, its locks and its prefetch, between LOOKUP and END_SESSION.

::

    (none) ──open, locking LOOKUP──────────────────────► LOCKED ──hand_over: a retrieve takes its lease──► ENDED
      │      (a lock-free LOOKUP without a prefetch          ▲
      │       keeps no session)                              │
      └──open, L2 holds more──► PREFETCHING ──lock_prefetched┘
                                    └──know (no lock)──► KNOWN ──answered──► ENDED

    PREFETCHING, LOCKED or KNOWN ──end: END_SESSION, a new LOOKUP under the same id, its context gone──► ENDED
                                 ──expire: nobody ended it (see ``SessionTable.expire``)───────────────► ENDED

- PREFETCHING: the final hit count is not known yet (QUERY_PREFETCH_STATUS answers None); the L1 part
  may already be locked under a first lease.
- LOCKED: the hit count is known and a lease holds the locks on the leading ``hits`` chunks (some may
  have been freed since with FREE_LOOKUP_LOCKS).
- KNOWN: the count is known, nothing is locked; the session ends once the count was answered.
- ENDED: the session is out of the table; its lease went to whoever ended it (the caller releases it,
  or a retrieve owns it from then on). Nothing moves an ended session.

A LOCKED session whose client freed every one of its locks (FREE_LOOKUP_LOCKS) ends then: the client
let go of it, and its END_SESSION, which may come much later, finds nothing to do.

A session nobody ends (an engine that gave up on the LOOKUP's reply, a client that forgot it) expires:
a LOCKED one as soon as its lease is gone (expired unrenewed), a KNOWN one after an
idle TTL, a PREFETCHING one once its prefetch has had its own bound on top. Without that, each would stay
in the table for the client's lifetime, and a later retrieve under its id would take over a dead lease.

``Session`` owns the transitions: each checks the state it leaves and raises IllegalTransition, changing
nothing, from any other. ``SessionTable`` keeps the sessions by (context, session id); every read and
every transition happens under its lock. The object table is a separate lock: the session lock may be
held while a lease is taken (never the other way round).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvdepot.errors import IllegalTransition
from kvdepot.types import NO_LEASE, ContextId, LeaseId, ObjectKey


class SessionState(enum.Enum):
    PREFETCHING = "prefetching"
    LOCKED = "locked"
    KNOWN = "known"
    ENDED = "ended"


@dataclass(slots=True)
class Session:
    state: SessionState
    lease_id: LeaseId
    keys: list[ObjectKey]  # the keys ``lease_id`` locks, from chunk 0
    hits: int | None  # None while PREFETCHING
    lock: bool  # the lookup asked for locks
    all_keys: list[ObjectKey] | None = None  # the whole prompt's keys, while PREFETCHING
    in_l1: int = 0  # leading chunks that were in L1 at the lookup (the rest of ``hits`` came from L2)
    since: float = 0.0  # monotonic time of its last transition (for expiry)

    def __repr__(self) -> str:
        return f"Session({self.state.value}, hits={self.hits}, lease={self.lease_id}, locked={len(self.keys)})"

    # --- transitions ---------------------------------------------------------------------------------

    def lock_prefetched(self, lease: LeaseId, keys: list[ObjectKey]) -> LeaseId:
        """PREFETCHING -> LOCKED: the prefetch ended and ``lease`` locks ``keys`` (the leading chunks
        now in L1). Returns the lease of the lookup's first lock, for the caller to release."""
        self._require(SessionState.PREFETCHING, "lock_prefetched")
        old = self.lease_id
        self.state, self.lease_id, self.keys, self.hits, self.all_keys = SessionState.LOCKED, lease, keys, len(keys), None
        return old

    def know(self, hits: int) -> None:
        """PREFETCHING -> KNOWN: the prefetch ended with ``hits`` leading chunks; nothing is locked."""
        self._require(SessionState.PREFETCHING, "know")
        self.state, self.hits, self.all_keys = SessionState.KNOWN, hits, None

    def hand_over(self) -> LeaseId:
        """LOCKED -> ENDED: a retrieve takes the lease over (it releases it when done)."""
        self._require(SessionState.LOCKED, "hand_over")
        lease, self.lease_id, self.state = self.lease_id, NO_LEASE, SessionState.ENDED
        return lease

    def answered(self) -> None:
        """KNOWN -> ENDED: its count was told."""
        self._require(SessionState.KNOWN, "answered")
        self.state = SessionState.ENDED

    def end(self) -> LeaseId:
        """Any live state -> ENDED; returns the lease still held (NO_LEASE if none), for the caller."""
        if self.state is SessionState.ENDED:
            raise IllegalTransition("session has ended already")
        lease, self.lease_id, self.state = self.lease_id, NO_LEASE, SessionState.ENDED
        return lease

    def _require(self, state: SessionState, what: str) -> None:
        if self.state is not state:
            raise IllegalTransition(f"session is {self.state.value}, not {state.value}: cannot {what}")


@dataclass(frozen=True, slots=True)
class PrefetchAnswer:
    hits: int | None
    locked: bool
    in_l1: int


Key = tuple[ContextId, str]
LockPrefix = Callable[[list[ObjectKey]], tuple[LeaseId, int]]  # keys -> (lease, how many it locked)


class SessionTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._sessions: dict[Key, Session] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __repr__(self) -> str:
        return f"SessionTable({len(self)} sessions)"

    def open(
        self, key: Key, lease: LeaseId, keys: list[ObjectKey], hits: int, lock: bool, prefetch_keys: list[ObjectKey] | None
    ) -> tuple[Session, LeaseId]:
        """A LOOKUP: the new session (PREFETCHING when ``prefetch_keys`` is given, else LOCKED), and the
        lease of the session it replaced (ended: the caller releases it; NO_LEASE if none)."""
        if prefetch_keys is not None:
            session = Session(SessionState.PREFETCHING, lease, keys, None, lock, prefetch_keys, in_l1=hits)
        else:
            session = Session(SessionState.LOCKED, lease, keys, hits, lock, in_l1=hits)
        session.since = self._clock()
        with self._lock:
            old = self._sessions.get(key)
            self._sessions[key] = session
            return session, old.end() if old is not None else NO_LEASE

    def prefetched(self, key: Key, session: Session, total: int, lock_prefix: LockPrefix) -> LeaseId | None:
        """The prefetch ended with ``total`` leading chunks in L1. A locking session locks that whole
        prefix afresh (``lock_prefix``) and becomes LOCKED; the lease of its first lock is returned for
        the caller to release. A lock-free one becomes KNOWN (NO_LEASE). None when the session ended or
        was replaced meanwhile (nothing to do)."""
        with self._lock:
            if self._sessions.get(key) is not session:
                return None
            session.since = self._clock()
            if not session.lock:
                session.know(total)
                return NO_LEASE
            if session.state is not SessionState.PREFETCHING:
                raise IllegalTransition(f"session is {session.state.value}, not prefetching")
            keys = (session.all_keys or session.keys)[:total]
            lease, locked = lock_prefix(keys)
            return session.lock_prefetched(lease, keys[:locked])

    def prefetching(self, key: Key, session: Session) -> bool:
        """Is ``session`` still the one under ``key``, waiting for its prefetch? (False once it ended,
        expired or was replaced: nobody waits for that prefetch any more.)"""
        with self._lock:
            return self._sessions.get(key) is session and session.state is SessionState.PREFETCHING

    def answer(self, key: Key) -> PrefetchAnswer | None:
        """QUERY_PREFETCH_STATUS: the hit count (None while PREFETCHING); a KNOWN session ends once it
        has been answered. None when there is no such session."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            answer = PrefetchAnswer(session.hits, session.lease_id != NO_LEASE, session.in_l1)
            if session.state is SessionState.KNOWN:
                session.answered()
                del self._sessions[key]
            return answer

    def hand_over(self, key: Key, keys: list[ObjectKey], start: int) -> LeaseId:
        """A retrieve of ``keys[start:]`` takes over a LOCKED session's lease when it locks those very
        chunks (the session ends: its lease is the retrieve's now); NO_LEASE otherwise (the retrieve
        locks afresh, and the session stays as it was)."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None or session.state is not SessionState.LOCKED or not session.lease_id:
                return NO_LEASE
            n = min(len(session.keys), len(keys))
            if n <= start or session.keys[start:n] != keys[start:n]:
                return NO_LEASE
            del self._sessions[key]
            return session.hand_over()

    def lease(self, key: Key) -> LeaseId:
        """The lease holding a LOCKED session's locks (for FREE_LOOKUP_LOCKS); NO_LEASE otherwise."""
        with self._lock:
            session = self._sessions.get(key)
            return session.lease_id if session is not None and session.state is SessionState.LOCKED else NO_LEASE

    def freed(self, key: Key, lease: LeaseId) -> bool:
        """FREE_LOOKUP_LOCKS freed the last lock of ``lease``: the LOCKED session it held ends now (the
        client let go of all of it; it was not abandoned, so the sweep must not count it as expired).
        False when the session is another one by now (replaced, or a retrieve took it over)."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None or session.state is not SessionState.LOCKED or session.lease_id != lease:
                return False
            del self._sessions[key]
            session.end()
            return True

    def end(self, key: Key) -> LeaseId:
        """END_SESSION: the session is gone; returns its lease for the caller to release."""
        with self._lock:
            session = self._sessions.pop(key, None)
            return session.end() if session is not None else NO_LEASE

    def end_context(self, context_id: ContextId) -> list[LeaseId]:
        """The context is gone: end its sessions; returns their leases."""
        with self._lock:
            keys = [k for k in self._sessions if k[0] == context_id]
            return [lease for k in keys if (lease := self._sessions.pop(k).end())]

    def state(self, key: Key) -> SessionState | None:
        with self._lock:
            session = self._sessions.get(key)
            return None if session is None else session.state

    def expire(self, idle_s: float, prefetch_bound_s: float, lease_alive: Callable[[LeaseId], bool]) -> list[tuple[ContextId, LeaseId]]:
        """End the sessions nobody will end: LOCKED ones whose lease is gone (and lock-free LOCKED ones
        idle for ``idle_s``), KNOWN ones idle for ``idle_s``, PREFETCHING ones idle for ``prefetch_bound_s``
        + ``idle_s``. Returns (context, lease still recorded) for each, for the caller to release quietly
        (NO_LEASE where none). ``lease_alive`` asks the object table (its lock is taken under this one)."""
        now = self._clock()
        gone: list[tuple[ContextId, LeaseId]] = []
        with self._lock:
            for key, session in list(self._sessions.items()):
                idle = now - session.since
                if session.state is SessionState.PREFETCHING:
                    due = idle >= prefetch_bound_s + idle_s
                elif session.state is SessionState.LOCKED and session.lease_id:
                    due = not lease_alive(session.lease_id)
                else:
                    due = idle >= idle_s
                if due:
                    del self._sessions[key]
                    gone.append((key[0], session.end()))
        return gone
