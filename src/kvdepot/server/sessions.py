"""Sessions: one engine request's lookup, its locks and its prefetch, between LOOKUP and END_SESSION.

::

    (none) ──LOOKUP, lock──────────────────────► LOCKED ──a retrieve takes its lease──► HANDED
      │      (a lock-free LOOKUP keeps no session)   ▲
      └──LOOKUP, L2 holds more──► PREFETCHING ──prefetched, lock──┘
                                       └──prefetched, no lock──► KNOWN ──answered──► (ended)

    any state ──END_SESSION, a new LOOKUP under the same id, or its context gone──► (ended)

- PREFETCHING: the final hit count is not known yet (QUERY_PREFETCH_STATUS answers None); the L1 part
  may already be locked under a first lease.
- LOCKED: the hit count is known and a lease holds the locks on the leading ``hits`` chunks (some may
  have been freed since with FREE_LOOKUP_LOCKS).
- KNOWN: the count is known, nothing is locked; the session ends once the count was answered.
- HANDED: a retrieve took the lease over (it releases it when done); the session stays only for END.

Every read and every transition happens under the table's lock, through its methods; a transition
from the wrong state raises IllegalTransition and changes nothing. The object table is a separate
lock: the session lock may be held while a lease is taken (never the other way round).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvdepot.errors import IllegalTransition
from kvdepot.types import ContextId, LeaseId, ObjectKey

NO_LEASE = LeaseId(0)


class SessionState(enum.Enum):
    PREFETCHING = "prefetching"
    LOCKED = "locked"
    KNOWN = "known"
    HANDED = "handed"


@dataclass(slots=True)
class Session:
    state: SessionState
    lease_id: LeaseId
    keys: list[ObjectKey]  # the keys ``lease_id`` locks, from chunk 0
    hits: int | None  # None while PREFETCHING
    lock: bool  # the lookup asked for locks
    all_keys: list[ObjectKey] | None = None  # the whole prompt's keys, while PREFETCHING

    def __repr__(self) -> str:
        return f"Session({self.state.value}, hits={self.hits}, lease={self.lease_id}, locked={len(self.keys)})"


@dataclass(frozen=True, slots=True)
class PrefetchAnswer:
    hits: int | None
    locked: bool


Key = tuple[ContextId, str]
LockPrefix = Callable[[list[ObjectKey]], tuple[LeaseId, int]]  # keys -> (lease, how many it locked)


class SessionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[Key, Session] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __repr__(self) -> str:
        return f"SessionTable({len(self)} sessions)"

    # --- transitions ---------------------------------------------------------------------------------

    def open(
        self, key: Key, lease: LeaseId, keys: list[ObjectKey], hits: int, lock: bool, prefetch_keys: list[ObjectKey] | None
    ) -> tuple[Session, LeaseId]:
        """A LOOKUP: the new session (PREFETCHING when ``prefetch_keys`` is given, else LOCKED), and the
        lease of the session it replaced (the caller releases it; NO_LEASE if none)."""
        if prefetch_keys is not None:
            session = Session(SessionState.PREFETCHING, lease, keys, None, lock, prefetch_keys)
        else:
            session = Session(SessionState.LOCKED, lease, keys, hits, lock)
        with self._lock:
            old = self._sessions.get(key)
            self._sessions[key] = session
        return session, _lease_of(old)

    def prefetched(self, key: Key, session: Session, total: int, lock_prefix: LockPrefix) -> LeaseId | None:
        """The prefetch ended with ``total`` leading chunks in L1. A locking session locks that whole
        prefix afresh (``lock_prefix``) and becomes LOCKED; the lease of its first lock is returned for
        the caller to release. None when the session ended or was replaced meanwhile (nothing to do)."""
        with self._lock:
            if self._sessions.get(key) is not session:
                return None
            _require(session, SessionState.PREFETCHING)
            keys = session.all_keys or session.keys
            session.all_keys = None
            if not session.lock:
                session.state, session.hits = SessionState.KNOWN, total
                return NO_LEASE
            lease, locked = lock_prefix(keys[:total])
            old, session.lease_id = session.lease_id, lease
            session.keys, session.hits, session.state = keys[:locked], locked, SessionState.LOCKED
            return old

    def answer(self, key: Key) -> PrefetchAnswer | None:
        """QUERY_PREFETCH_STATUS: the hit count (None while PREFETCHING); a KNOWN session ends once it
        has been answered. None when there is no such session."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None:
                return None
            if session.state is SessionState.KNOWN:
                del self._sessions[key]
            return PrefetchAnswer(session.hits, session.lease_id != NO_LEASE)

    def hand_over(self, key: Key, keys: list[ObjectKey], start: int) -> LeaseId:
        """A retrieve of ``keys[start:]`` takes over the session's lease when it locks those very
        chunks (LOCKED -> HANDED); NO_LEASE otherwise (the retrieve locks afresh)."""
        with self._lock:
            session = self._sessions.get(key)
            if session is None or session.state is not SessionState.LOCKED or not session.lease_id:
                return NO_LEASE
            n = min(len(session.keys), len(keys))
            if n <= start or session.keys[start:n] != keys[start:n]:
                return NO_LEASE
            lease, session.lease_id, session.state = session.lease_id, NO_LEASE, SessionState.HANDED
            return lease

    def lease(self, key: Key) -> LeaseId:
        """The lease holding a LOCKED session's locks (for FREE_LOOKUP_LOCKS); NO_LEASE otherwise."""
        with self._lock:
            session = self._sessions.get(key)
            return session.lease_id if session is not None and session.state is SessionState.LOCKED else NO_LEASE

    def end(self, key: Key) -> LeaseId:
        """END_SESSION: the session is gone; returns its lease for the caller to release."""
        with self._lock:
            return _lease_of(self._sessions.pop(key, None))

    def end_context(self, context_id: ContextId) -> list[LeaseId]:
        """The context is gone: end its sessions; returns their leases."""
        with self._lock:
            keys = [k for k in self._sessions if k[0] == context_id]
            return [lease for k in keys if (lease := _lease_of(self._sessions.pop(k)))]

    def state(self, key: Key) -> SessionState | None:
        with self._lock:
            session = self._sessions.get(key)
            return None if session is None else session.state


def _lease_of(session: Session | None) -> LeaseId:
    return NO_LEASE if session is None else session.lease_id


def _require(session: Session, state: SessionState) -> None:
    if session.state is not state:
        raise IllegalTransition(f"session is {session.state.value}, not {state.value}")
