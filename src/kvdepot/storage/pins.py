"""Lifecycle protection: pins and agent-session leases, the L1 objects eviction must skip.

A protected key is never chosen by the eviction controller's watermarks, by a reservation's synchronous
make-room eviction, by quota enforcement nor by L2-only placement; its bytes still count against its
``cache_salt``'s quota (the table accounts them like any object). An explicit removal (``/cache/clear``,
``DELETE /cache/prefix``) is not eviction: it removes protected objects too,
and every pin lets go of what was removed (``let_go``).

Pins (an operator's "keep this prefix"), by id. The id is the pin's capability: whoever holds it may
unpin or extend it (the client that pinned, another process of the same application, the operator), so
a pin outlives its client; ids are random 53-bit numbers, not a counter, so no other client can guess
one::

    pin(present keys, ttl=None) ──► HARD ──unpin──► RELEASED
    pin(present keys, ttl=t)    ──► SOFT ──unpin──► RELEASED
                                      │ ──extend(t')──► SOFT (a later deadline)
                                      └──deadline passed (expire)──► EXPIRED

A pin protects the keys that were READY in L1 when it was made (the caller passes them under the
object table's lock, so none can be evicted in between); the pinned bytes of a salt may never exceed its
quota (the pin is refused). A HARD pin is never extended (it has no deadline).

Agent sessions (a conversation, by (cache_salt, name)), whose prefix survives tool-call gaps::

    touch(keys) ──► OPEN ──touch(keys)──► OPEN (deadline renewed, protection moved to the new prefix)
                     │ ──renew──► OPEN (deadline renewed)
                     │ ──close──► CLOSED
                     └──deadline passed (expire)──► EXPIRED

A touch of a name that is not OPEN opens a new session. The protection is by key, per namespace (a
tensor-parallel engine's ranks, or several models, each keep their own prefix under one session name):
an object stored later under a protected key is protected from the moment it is READY.

RELEASED, EXPIRED and CLOSED are final: a transition out of them raises IllegalTransition and changes
nothing (a recently ended pin or session is remembered so the error can say what happened to it).
Every method holds this module's lock only; it never calls out, so the object table may consult it under
its own lock (lock order: table, then protections).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvdepot.errors import ErrorCode, IllegalTransition, KVDepotError
from kvdepot.types import NAMESPACE_BYTES, ObjectKey

MAX_SESSIONS = 65536  # open agent sessions; beyond it a new one is refused (names can be per request)
MAX_PINS = 65536  # live pins; beyond it a new one is refused (any client may pin)
REMEMBER_ENDED = 4096  # ended pins / sessions kept for their error message


class PinState(Enum):
    HARD = "hard"
    SOFT = "soft"
    RELEASED = "released"
    EXPIRED = "expired"


class SessionState(Enum):
    OPEN = "open"
    CLOSED = "closed"
    EXPIRED = "expired"


class PinRefused(KVDepotError):
    """A pin that would put its salt's pinned bytes over the salt's quota."""

    code = ErrorCode.NO_SPACE


class UnknownPin(KVDepotError):
    code = ErrorCode.UNKNOWN_LEASE  # a pin is a lease an operator holds


class UnknownAgentSession(KVDepotError):
    code = ErrorCode.UNKNOWN_SESSION


@dataclass(frozen=True, slots=True)
class PinInfo:
    id: int
    cache_salt: str
    state: PinState
    pinned: int  # objects it protects
    bytes: int
    expires_in_s: float | None  # None: HARD or ended


@dataclass(frozen=True, slots=True)
class SessionInfo:
    cache_salt: str
    name: str
    state: SessionState
    keys: int  # keys protected, all namespaces together
    ttl_s: float
    expires_in_s: float | None  # None: ended


@dataclass(slots=True)
class _Pin:
    id: int
    salt: str
    sizes: dict[ObjectKey, int]
    state: PinState
    deadline: float | None


@dataclass(slots=True)
class _Session:
    salt: str
    name: str
    ttl_s: float
    deadline: float
    state: SessionState = SessionState.OPEN
    keys: dict[bytes, tuple[ObjectKey, ...]] = field(default_factory=dict)  # namespace -> its latest prefix


class Protections:
    def __init__(
        self,
        session_ttl_s: float = 300.0,
        quota_of: Callable[[str], int | None] = lambda salt: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._session_ttl = session_ttl_s
        self._quota_of = quota_of
        self._clock = clock
        self._lock = threading.Lock()
        self._count: dict[ObjectKey, int] = {}  # key -> how many pins and sessions protect it
        self._pins: dict[int, _Pin] = {}  # HARD or SOFT
        self._pinned: dict[ObjectKey, int] = {}  # key -> how many pins hold it
        self._pinned_bytes: dict[str, int] = {}  # salt -> bytes of the distinct keys its pins hold
        self._sessions: dict[tuple[str, str], _Session] = {}  # OPEN
        self._ended_pins: OrderedDict[int, PinState] = OrderedDict()
        self._ended_sessions: OrderedDict[tuple[str, str], SessionState] = OrderedDict()

    def __repr__(self) -> str:
        return f"Protections(pins={len(self._pins)}, sessions={len(self._sessions)}, keys={len(self._count)})"

    @property
    def session_ttl_s(self) -> float:
        return self._session_ttl

    def is_pinned(self, key: ObjectKey) -> bool:
        """Held by a pin (not only by an agent session); like ``is_protected``, lock-free."""
        return self._pinned.get(key, 0) > 0

    def is_protected(self, key: ObjectKey) -> bool:
        """Called for every eviction candidate under the object table's lock: a dict membership test,
        atomic under the GIL, so it takes no lock of its own."""
        return key in self._count

    # --- pins ----------------------------------------------------------------------------------------

    def pin(self, salt: str, present: Sequence[tuple[ObjectKey, int]], ttl_s: float | None = None) -> PinInfo:
        """Protect ``present`` ((key, size) of objects READY in L1: the caller holds the table's lock).
        ``ttl_s``: a SOFT pin ending then; None: HARD. Refused when the salt's pinned bytes would exceed
        its quota. A pin of nothing is made (and says it pins 0): its id can still be unpinned."""
        if ttl_s is not None and not ttl_s > 0:
            raise IllegalTransition(f"a soft pin needs a positive ttl_s, got {ttl_s}")
        with self._lock:
            if len(self._pins) >= MAX_PINS:
                raise KVDepotError(f"{MAX_PINS} pins are held; unpin some first", ErrorCode.NO_SPACE)
            sizes = dict(present)
            quota = self._quota_of(salt)
            if quota is not None:
                new = sum(size for key, size in sizes.items() if key not in self._pinned)
                have = self._pinned_bytes.get(salt, 0)
                if have + new > quota:
                    raise PinRefused(
                        f"pinning {new} more bytes of cache_salt {salt!r} would exceed its quota ({have} bytes pinned "
                        f"already, quota {quota}): pinned bytes count against the quota"
                    )
            pin = _Pin(self._new_id_locked(), salt, sizes, PinState.HARD if ttl_s is None else PinState.SOFT,
                       None if ttl_s is None else self._clock() + ttl_s)  # fmt: skip
            self._pins[pin.id] = pin
            for key, size in sizes.items():
                if self._pinned.get(key, 0) == 0:
                    self._pinned_bytes[salt] = self._pinned_bytes.get(salt, 0) + size
                self._pinned[key] = self._pinned.get(key, 0) + 1
                self._protect_locked(key)
            return self._pin_info_locked(pin)

    def unpin(self, pin_id: int) -> PinInfo:
        """HARD or SOFT -> RELEASED."""
        with self._lock:
            pin = self._live_pin_locked(pin_id, "unpin")
            self._end_pin_locked(pin, PinState.RELEASED)
            return self._pin_info_locked(pin)

    def extend(self, pin_id: int, ttl_s: float) -> PinInfo:
        """SOFT -> SOFT with the deadline now + ``ttl_s`` (never earlier than it was)."""
        if not ttl_s > 0:
            raise IllegalTransition(f"extend needs a positive ttl_s, got {ttl_s}")
        with self._lock:
            pin = self._live_pin_locked(pin_id, "extend")
            if pin.state is PinState.HARD:
                raise IllegalTransition(f"pin {pin_id} is hard (held until unpinned): it has no deadline to extend")
            assert pin.deadline is not None
            pin.deadline = max(pin.deadline, self._clock() + ttl_s)
            return self._pin_info_locked(pin)

    def let_go(self, keys: Iterable[ObjectKey] | None) -> int:
        """These objects were removed on purpose (``DELETE /cache/prefix``; None: a clear of L1): every
        pin lets go of them, so a deleted prefix's bytes no longer count against its salt's quota, and
        the prefix, stored again later, is not pinned again by a pin made of the objects that were
        deleted. The pins stay (their ids still unpin them), holding what is left. Agent sessions keep
        their keys: they protect the conversation's next turn, not objects. Returns the keys let go."""
        wanted = None if keys is None else set(keys)
        released = 0
        with self._lock:
            for pin in self._pins.values():
                gone = [key for key in pin.sizes if wanted is None or key in wanted]
                for key in gone:
                    self._unpin_key_locked(pin.salt, key, pin.sizes.pop(key))
                released += len(gone)
        return released

    def pins(self) -> list[PinInfo]:
        with self._lock:
            return [self._pin_info_locked(p) for p in self._pins.values()]

    def pinned_bytes(self, salt: str) -> int:
        with self._lock:
            return self._pinned_bytes.get(salt, 0)

    # --- agent sessions ------------------------------------------------------------------------------

    def touch(self, salt: str, name: str, keys: Sequence[ObjectKey], ttl_s: float | None = None) -> SessionInfo:
        """A turn of the conversation (a LOOKUP or STORE naming it, or an HTTP open): open the session
        if it is not OPEN, renew its deadline, and move its protection in each namespace of ``keys`` to
        ``keys`` (unless they are a strict prefix of what it protects there: a lookup of part of the
        prefix must not shrink it)."""
        if not name:
            raise IllegalTransition("an agent session needs a name")
        if ttl_s is not None and not ttl_s > 0:
            raise IllegalTransition(f"an agent session needs a positive ttl_s, got {ttl_s}")
        with self._lock:
            session = self._sessions.get((salt, name))
            if session is None:
                if len(self._sessions) >= MAX_SESSIONS:
                    raise KVDepotError(f"{MAX_SESSIONS} agent sessions are open; close some first", ErrorCode.NO_SPACE)
                session = _Session(salt, name, self._session_ttl, 0.0)
                self._sessions[(salt, name)] = session
                self._ended_sessions.pop((salt, name), None)
            if ttl_s is not None:
                session.ttl_s = ttl_s
            session.deadline = self._clock() + session.ttl_s
            for ns, run in _by_namespace(keys).items():
                old = session.keys.get(ns, ())
                if len(run) < len(old) and old[: len(run)] == run:
                    continue
                for key in run:
                    self._protect_locked(key)
                for key in old:
                    self._unprotect_locked(key)
                session.keys[ns] = run
            return self._session_info_locked(session)

    def renew(self, salt: str, name: str, ttl_s: float | None = None) -> SessionInfo:
        """OPEN -> OPEN with its deadline now + its TTL (``ttl_s`` replaces the TTL)."""
        if ttl_s is not None and not ttl_s > 0:
            raise IllegalTransition(f"an agent session needs a positive ttl_s, got {ttl_s}")
        with self._lock:
            session = self._open_session_locked(salt, name, "renew")
            if ttl_s is not None:
                session.ttl_s = ttl_s
            session.deadline = self._clock() + session.ttl_s
            return self._session_info_locked(session)

    def close(self, salt: str, name: str) -> SessionInfo:
        """OPEN -> CLOSED: its prefix is evicted normally from now on."""
        with self._lock:
            session = self._open_session_locked(salt, name, "close")
            self._end_session_locked(session, SessionState.CLOSED)
            return self._session_info_locked(session)

    def sessions(self) -> list[SessionInfo]:
        with self._lock:
            return [self._session_info_locked(s) for s in self._sessions.values()]

    def session_state(self, salt: str, name: str) -> SessionState | None:
        """OPEN, the final state of a recently ended one, or None (never seen, or long forgotten)."""
        with self._lock:
            if (salt, name) in self._sessions:
                return SessionState.OPEN
            return self._ended_sessions.get((salt, name))

    # --- time ----------------------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """End SOFT pins and OPEN sessions whose deadline has passed; returns (pins, sessions) ended."""
        now = self._clock() if now is None else now
        with self._lock:
            pins = [p for p in self._pins.values() if p.deadline is not None and p.deadline <= now]
            for pin in pins:
                self._end_pin_locked(pin, PinState.EXPIRED)
            sessions = [s for s in self._sessions.values() if s.deadline <= now]
            for session in sessions:
                self._end_session_locked(session, SessionState.EXPIRED)
            return len(pins), len(sessions)

    # --- internals (lock held) -----------------------------------------------------------------------

    def _protect_locked(self, key: ObjectKey) -> None:
        self._count[key] = self._count.get(key, 0) + 1

    def _unprotect_locked(self, key: ObjectKey) -> None:
        n = self._count[key] - 1
        if n:
            self._count[key] = n
        else:
            del self._count[key]

    def _new_id_locked(self) -> int:
        # Random, not a counter: an UNPIN needs no owner check when nobody can guess another's pin id.
        # Below 2**53, so a pin id is exact in JSON read by a browser.
        while True:
            pin_id = secrets.randbits(53)
            if pin_id and pin_id not in self._pins and pin_id not in self._ended_pins:
                return pin_id

    def _live_pin_locked(self, pin_id: int, verb: str) -> _Pin:
        pin = self._pins.get(pin_id)
        if pin is not None:
            return pin
        ended = self._ended_pins.get(pin_id)
        if ended is not None:
            raise IllegalTransition(f"cannot {verb} pin {pin_id}: it is {ended.value} already")
        raise UnknownPin(f"no pin {pin_id}")

    def _end_pin_locked(self, pin: _Pin, state: PinState) -> None:
        del self._pins[pin.id]
        pin.state = state
        for key, size in pin.sizes.items():
            self._unpin_key_locked(pin.salt, key, size)
        _remember(self._ended_pins, pin.id, state)

    def _unpin_key_locked(self, salt: str, key: ObjectKey, size: int) -> None:
        """One pin of ``salt`` no longer holds ``key`` (of ``size`` bytes)."""
        self._unprotect_locked(key)
        left = self._pinned[key] - 1
        if left:
            self._pinned[key] = left
            return
        del self._pinned[key]
        remaining = self._pinned_bytes[salt] - size
        if remaining:
            self._pinned_bytes[salt] = remaining
        else:
            del self._pinned_bytes[salt]

    def _open_session_locked(self, salt: str, name: str, verb: str) -> _Session:
        session = self._sessions.get((salt, name))
        if session is not None:
            return session
        ended = self._ended_sessions.get((salt, name))
        if ended is not None:
            raise IllegalTransition(f"cannot {verb} agent session {name!r} of cache_salt {salt!r}: it is {ended.value}")
        raise UnknownAgentSession(f"no agent session {name!r} for cache_salt {salt!r}")

    def _end_session_locked(self, session: _Session, state: SessionState) -> None:
        del self._sessions[(session.salt, session.name)]
        session.state = state
        for run in session.keys.values():
            for key in run:
                self._unprotect_locked(key)
        _remember(self._ended_sessions, (session.salt, session.name), state)

    def _pin_info_locked(self, pin: _Pin) -> PinInfo:
        live = pin.state is PinState.SOFT and pin.deadline is not None
        left = max(0.0, pin.deadline - self._clock()) if live and pin.deadline is not None else None
        return PinInfo(pin.id, pin.salt, pin.state, len(pin.sizes), sum(pin.sizes.values()), left)

    def _session_info_locked(self, s: _Session) -> SessionInfo:
        left = max(0.0, s.deadline - self._clock()) if s.state is SessionState.OPEN else None
        return SessionInfo(s.salt, s.name, s.state, sum(len(r) for r in s.keys.values()), s.ttl_s, left)


def _by_namespace(keys: Iterable[ObjectKey]) -> dict[bytes, tuple[ObjectKey, ...]]:
    out: dict[bytes, list[ObjectKey]] = {}
    for key in keys:
        out.setdefault(bytes(key[:NAMESPACE_BYTES]), []).append(key)
    return {ns: tuple(run) for ns, run in out.items()}


def _remember(ended: OrderedDict, key, state) -> None:
    ended[key] = state
    ended.move_to_end(key)
    while len(ended) > REMEMBER_ENDED:
        ended.popitem(last=False)
