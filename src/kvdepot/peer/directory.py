"""This node's shard of the directory: key -> where that page lives (one record per owning node).

The union of every node's shard is the directory; the ring (``ring.py``) says which shards hold a
key's record (its owner and the next ``directory_replicas - 1`` nodes), so there is no central store.
A record names a (node, generation): a newer generation of a key from the same node replaces an older
one, an unpublish removes only the generation it names (a late unpublish never removes a newer page),
and the records of a node that left the cluster go with it. A record also names its node's run (its
incarnation): once a shard knows of a newer run of a node (from membership, or from that run's first
publish), the earlier run's records go and any that arrive late are refused; they name pages the
restarted node never held.

A record whose incarnation is 0 (``LEGACY_RUN``) comes from a node of a version before records carried
one (before 2026-11-27): its run is unknown, so it is taken as its node's current run (as that version
takes every record) rather than refused as an earlier run's; it still goes when its node is seen to
restart. Refused, every page such a node published read as absent to every newer node, with no word
said, for the whole of a rolling upgrade.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence

from kvdepot.protocol.messages import PeerLocation

LEGACY_RUN = 0  # the incarnation of a record published by a node that predates incarnations


def from_an_earlier_run(rec: PeerLocation, usable: Mapping[str, int]) -> bool:
    """True unless ``rec``'s node is usable (``usable``: node -> its run now) and ``rec`` is of that run
    (or of an unknown one: a node that predates incarnations publishes ``LEGACY_RUN``)."""
    run = usable.get(rec.node)
    return run is None or (rec.incarnation != LEGACY_RUN and rec.incarnation < run)


class DirectoryShard:
    def __init__(self) -> None:
        self._records: dict[bytes, dict[str, PeerLocation]] = {}
        self._runs: dict[str, int] = {}  # node -> the newest incarnation of it this shard knows of
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(by_node) for by_node in self._records.values())

    def publish(self, records: Sequence[PeerLocation]) -> int:
        """Keep each record unless this shard already has a newer one of that (key, node), or knows of
        a newer run of its node."""
        kept = 0
        with self._lock:
            for rec in records:
                run = self._runs.get(rec.node, 0)
                if rec.incarnation != LEGACY_RUN and rec.incarnation < run:
                    continue  # sent by a run that has since restarted
                if rec.incarnation > run:
                    self._runs[rec.node] = rec.incarnation
                    if run:
                        self._drop_locked(lambda key, old, node=rec.node, new=rec.incarnation: old.node == node and old.incarnation < new)
                by_node = self._records.setdefault(rec.key, {})
                old = by_node.get(rec.node)
                if old is None or old.generation <= rec.generation:
                    by_node[rec.node] = rec
                    kept += 1
        return kept

    def later_run(self, records: Sequence[PeerLocation]) -> int:
        """The newest run this shard knows of a node that some of ``records`` name an earlier run of (0:
        none): the records ``publish`` refused as a restarted node's."""
        later = 0
        with self._lock:
            for rec in records:
                run = self._runs.get(rec.node, 0)
                if rec.incarnation != LEGACY_RUN and rec.incarnation < run:
                    later = max(later, run)
        return later

    def unpublish(self, keys: Sequence[bytes], node: str, generations: Sequence[int]) -> int:
        removed = 0
        with self._lock:
            for key, generation in zip(keys, generations, strict=True):
                by_node = self._records.get(key)
                if by_node is None:
                    continue
                old = by_node.get(node)
                if old is not None and old.generation <= generation:
                    del by_node[node]
                    removed += 1
                if not by_node:
                    del self._records[key]
        return removed

    def resolve(self, keys: Sequence[bytes]) -> list[list[PeerLocation]]:
        with self._lock:
            return [list(self._records.get(key, {}).values()) for key in keys]

    def drop_incarnations_before(self, node: str, incarnation: int) -> int:
        """Drop ``node``'s records from its runs before ``incarnation``, and refuse any that come later;
        returns how many went."""
        with self._lock:
            self._runs[node] = max(self._runs.get(node, 0), incarnation)
            return self._drop_locked(lambda key, rec: rec.node == node and rec.incarnation < incarnation)

    def keep_nodes(self, live: Collection[str]) -> int:
        """Drop every record of a node not in ``live``; returns how many went."""
        with self._lock:
            for node in [node for node in self._runs if node not in live]:
                del self._runs[node]
            return self._drop_locked(lambda key, rec: rec.node not in live)

    def drop_other_nodes(self, node: str) -> int:
        """Drop every record not of ``node`` (this node, back from an absence); returns how many went."""
        return self._drop(lambda key, rec: rec.node != node)

    def keep_keys(self, mine: Callable[[bytes], bool]) -> int:
        """Drop the records of keys this shard no longer owns (after the ring changed)."""
        return self._drop(lambda key, rec: not mine(key))

    def _drop(self, gone: Callable[[bytes, PeerLocation], bool]) -> int:
        with self._lock:
            return self._drop_locked(gone)

    def _drop_locked(self, gone: Callable[[bytes, PeerLocation], bool]) -> int:
        n = 0
        for key in list(self._records):
            by_node = self._records[key]
            for node in [node for node, rec in by_node.items() if gone(key, rec)]:
                del by_node[node]
                n += 1
            if not by_node:
                del self._records[key]
        return n
