"""Eviction policies: which READY, unlocked objects go first when L1 needs room.

A policy only orders keys; the object table decides what may actually be evicted (never a locked or
half-written object) and calls the policy under its own lock, so policies need no locking.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from kvdepot.config import EvictionPolicyName
from kvdepot.types import ObjectKey


def _any(key: ObjectKey) -> bool:
    return True


class EvictionPolicy(Protocol):
    name: EvictionPolicyName

    def on_ready(self, key: ObjectKey, salt: str, size: int) -> None:
        """``key`` (of ``cache_salt`` ``salt``, ``size`` bytes) became READY: it is now a candidate."""

    def on_access(self, key: ObjectKey) -> None:
        """``key`` was looked up or read."""

    def on_access_run(self, keys: Sequence[ObjectKey]) -> None:
        """A prompt's leading ``keys`` were looked up or read together: the head ends most recent (its
        tail goes first). One call per request, not per chunk: a 32k-token lookup touches 128 keys."""

    def on_remove(self, key: ObjectKey) -> None:
        """``key`` left L1 (evicted, cleared, or expired)."""

    def candidates(self) -> Iterator[ObjectKey]:
        """Keys in eviction order, first victim first. The table skips the ones it cannot evict, and
        must not call the other hooks while it iterates (it collects victims first, then removes)."""

    def quota_excess(self, evictable: Callable[[ObjectKey], bool] = _any) -> Iterator[ObjectKey]:
        """Keys to evict now, regardless of free space, to bring salts back under their quotas. Keys
        ``evictable`` refuses (locked, pinned) are skipped and still count as used: the salt's other
        objects go instead."""

    def refuses(self, salt: str, size: int) -> bool:
        """Can an object of ``size`` bytes of ``salt`` never be kept? (then it is refused, not stored
        and evicted at once)"""

    def over_quota_by(self, salt: str, extra: int) -> int:
        """Bytes by which ``salt``'s READY objects plus ``extra`` more would exceed its quota (0 or less:
        they fit, or it has none)."""

    def oldest_of(self, salt: str) -> Iterator[ObjectKey]:
        """``salt``'s keys, first victim first (the table makes room in a tenant's own quota with them)."""


class LRUPolicy:
    name = EvictionPolicyName.LRU

    def __init__(self) -> None:
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()

    def __repr__(self) -> str:
        return f"LRUPolicy(tracked={len(self._order)})"

    def on_ready(self, key: ObjectKey, salt: str = "", size: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: ObjectKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_access_run(self, keys: Sequence[ObjectKey]) -> None:
        move = self._order.move_to_end
        for key in reversed(keys):
            try:
                move(key)
            except KeyError:
                pass  # not tracked (not READY yet): nothing to order

    def on_remove(self, key: ObjectKey) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[ObjectKey]:
        return iter(self._order)

    def quota_excess(self, evictable: Callable[[ObjectKey], bool] = _any) -> Iterator[ObjectKey]:
        return iter(())

    def refuses(self, salt: str, size: int) -> bool:
        return False

    def over_quota_by(self, salt: str, extra: int) -> int:
        return 0

    def oldest_of(self, salt: str) -> Iterator[ObjectKey]:
        return iter(())


class NoopPolicy:
    """Never evicts: a full L1 refuses new stores instead."""

    name = EvictionPolicyName.NOOP

    def on_ready(self, key: ObjectKey, salt: str = "", size: int = 0) -> None:
        pass

    def on_access(self, key: ObjectKey) -> None:
        pass

    def on_access_run(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_remove(self, key: ObjectKey) -> None:
        pass

    def candidates(self) -> Iterator[ObjectKey]:
        return iter(())

    def quota_excess(self, evictable: Callable[[ObjectKey], bool] = _any) -> Iterator[ObjectKey]:
        return iter(())

    def refuses(self, salt: str, size: int) -> bool:
        return False

    def over_quota_by(self, salt: str, extra: int) -> int:
        return 0

    def oldest_of(self, salt: str) -> Iterator[ObjectKey]:
        return iter(())


class IsolatedLRUPolicy(LRUPolicy):
    """LRU with a byte quota per ``cache_salt`` (tenant). A salt over its quota is evicted first and
    brought back under it by the eviction controller; salts without a quota share what is left.
    Quotas are set at run time (HTTP ``/quota/{cache_salt}``); the hooks run under the table's lock,
    quota changes under the policy's own."""

    name = EvictionPolicyName.ISOLATED_LRU

    def __init__(self) -> None:
        super().__init__()
        self._salt: dict[ObjectKey, str] = {}
        self._size: dict[ObjectKey, int] = {}
        # Each salt's keys in LRU order too: making room in a tenant's quota, and trimming it, walk that
        # tenant's own keys, not every key in L1 (under the table's lock: at a quota, each chunk of a
        # store walked the whole order past the other tenants' older keys, ~45 ms per chunk at 300k).
        self._by_salt: dict[str, OrderedDict[ObjectKey, None]] = {}
        self._used: defaultdict[str, int] = defaultdict(int)
        self._quotas: dict[str, int] = {}
        self._quota_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"IsolatedLRUPolicy(tracked={len(self._order)}, quotas={len(self._quotas)})"

    def set_quota(self, salt: str, quota_bytes: int | None) -> None:
        with self._quota_lock:
            if quota_bytes is None:
                self._quotas.pop(salt, None)
            else:
                self._quotas[salt] = quota_bytes

    def quota(self, salt: str) -> int | None:
        with self._quota_lock:
            return self._quotas.get(salt)

    def used(self, salt: str) -> int:
        return self._used.get(salt, 0)

    def refuses(self, salt: str, size: int) -> bool:
        quota = self.quota(salt)
        return quota is not None and size > quota

    def quotas(self) -> dict[str, int]:
        with self._quota_lock:
            return dict(self._quotas)

    def over_quota_by(self, salt: str, extra: int) -> int:
        quota = self.quota(salt)
        return 0 if quota is None else self._used.get(salt, 0) + extra - quota

    def oldest_of(self, salt: str) -> Iterator[ObjectKey]:
        return iter(self._by_salt.get(salt, ()))

    def on_ready(self, key: ObjectKey, salt: str = "", size: int = 0) -> None:
        super().on_ready(key)
        if key not in self._salt:
            self._salt[key] = salt
            self._size[key] = size
            self._used[salt] += size
        own = self._by_salt.setdefault(self._salt[key], OrderedDict())
        own[key] = None
        own.move_to_end(key)

    def on_access(self, key: ObjectKey) -> None:
        super().on_access(key)
        salt = self._salt.get(key)
        if salt is not None:
            self._by_salt[salt].move_to_end(key)

    def on_access_run(self, keys: Sequence[ObjectKey]) -> None:
        super().on_access_run(keys)
        salt_of, by_salt = self._salt.get, self._by_salt
        for key in reversed(keys):
            salt = salt_of(key)
            if salt is not None:
                by_salt[salt].move_to_end(key)

    def on_remove(self, key: ObjectKey) -> None:
        super().on_remove(key)
        salt = self._salt.pop(key, None)
        if salt is not None:
            self._used[salt] -= self._size.pop(key)
            if not self._used[salt]:
                del self._used[salt]
            own = self._by_salt[salt]
            del own[key]
            if not own:
                del self._by_salt[salt]

    def _excess(self) -> dict[str, int]:
        with self._quota_lock:
            return {s: self._used.get(s, 0) - q for s, q in self._quotas.items() if self._used.get(s, 0) > q}

    def candidates(self) -> Iterator[ObjectKey]:
        over = self._excess()
        if not over:
            yield from self._order
            return
        if len(over) == 1:
            yield from self._by_salt.get(next(iter(over)), ())
        else:  # several salts over: theirs first, still oldest first among them
            yield from (k for k in self._order if self._salt.get(k) in over)
        yield from (k for k in self._order if self._salt.get(k) not in over)

    def quota_excess(self, evictable: Callable[[ObjectKey], bool] = _any) -> Iterator[ObjectKey]:
        """Only the salts over their quota are walked, each from its oldest key and only as far as its
        excess (the eviction controller runs this on every store: it walked every key in L1)."""
        for salt, excess in self._excess().items():
            for key in self._by_salt.get(salt, ()):
                if excess <= 0:
                    break
                if evictable(key):
                    excess -= self._size[key]
                    yield key


POLICIES: dict[EvictionPolicyName, type[EvictionPolicy]] = {p.name: p for p in (LRUPolicy, IsolatedLRUPolicy, NoopPolicy)}
if set(POLICIES) != set(EvictionPolicyName):  # a new name in the config needs its class here
    raise RuntimeError(f"eviction policies without a class: {set(EvictionPolicyName) - set(POLICIES)}")


def make_policy(name: EvictionPolicyName | str) -> EvictionPolicy:
    return POLICIES[EvictionPolicyName(name)]()
