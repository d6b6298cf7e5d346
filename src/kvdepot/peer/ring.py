"""The consistent-hash ring: which nodes own a key's directory record.

Each node stands on the ring at ``vnodes`` points (xxh3_64 of ``node id #i``); a key's owners are the
first ``n`` distinct nodes met walking clockwise from the key's own point. Every node builds the same
ring from the same membership, so writers and readers agree on a record's home without asking anyone,
and a node joining or leaving moves only the keys next to its points (about 1/N of them).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import xxhash

DEFAULT_VNODES = 160
_WHERE_CACHED = 1 << 16  # keys whose ring position is remembered (~10 MB at most)


def _point(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class HashRing:
    def __init__(self, nodes: Iterable[str] = (), vnodes: int = DEFAULT_VNODES, replicas: int = 2) -> None:
        """``replicas``: the ``n`` most asked for; owner lists up to it are precomputed per point, so
        ``owners`` is one hash and one bisection (the directory asks for every key of every read)."""
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        self.vnodes = vnodes
        self.nodes: frozenset[str] = frozenset(nodes)
        points = sorted((_point(f"{node}#{i}".encode()), node) for node in self.nodes for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._replicas = replicas
        self._successors = [tuple(self._walk(i, replicas)) for i in range(len(self._points))]
        self._where: dict[bytes, int] = {}  # key -> its point's index: a lookup asks for the same keys again and again

    def __repr__(self) -> str:
        return f"HashRing({len(self.nodes)} nodes x {self.vnodes} vnodes)"

    def __len__(self) -> int:
        return len(self.nodes)

    def owners(self, key: bytes, n: int = 1) -> list[str]:
        """The first ``n`` distinct nodes clockwise from ``key`` (fewer if the ring has fewer)."""
        return list(self.owners_many((key,), n)[0])

    def owners_many(self, keys: Sequence[bytes], n: int = 1) -> list[tuple[str, ...]]:
        """``owners(key, n)`` of each key, as tuples (shared with the ring: read-only), in one call: a
        directory lookup asks it for every key of a batch."""
        if not self._points:
            return [() for _ in keys]
        where, points, successors = self._where, self._points, self._successors
        size = len(points)
        out: list[tuple[str, ...]] = []
        for key in keys:
            i = where.get(key)
            if i is None:
                i = bisect.bisect(points, _point(key)) % size
                if len(where) >= _WHERE_CACHED:
                    where.clear()  # bounded; a ring is rebuilt (and this emptied) at every membership change anyway
                where[key] = i
            if n == self._replicas:
                out.append(successors[i])
            else:
                out.append(successors[i][:n] if n < self._replicas else tuple(self._walk(i, n)))
        return out

    def _walk(self, i: int, n: int) -> list[str]:
        """The first ``n`` distinct nodes from point ``i`` on, clockwise."""
        want = min(n, len(self.nodes))
        out: list[str] = []
        for step in range(len(self._points)):
            node = self._owners[(i + step) % len(self._points)]
            if node not in out:
                out.append(node)
                if len(out) == want:
                    break
        return out

    def shares(self) -> dict[str, float]:
        """Each node's fraction of the key space (as the first owner): how even the ring is."""
        if not self._points:
            return {}
        span = 1 << 64
        out = dict.fromkeys(self.nodes, 0.0)
        for i, point in enumerate(self._points):
            prev = self._points[i - 1] if i else self._points[-1] - span
            out[self._owners[i]] += (point - prev) / span
        return out
