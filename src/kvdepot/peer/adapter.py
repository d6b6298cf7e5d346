"""The ``peer`` L2 tier: a kvdepot server's objects readable by every other server of the cluster.

``--l2 'peer:discovery=HEAD:PORT,host=10.0.0.2,secret=...'`` (the keys are ``PeerConfig``'s; on IPv6,
``discovery=[fd00::1]:31995,host=fd00::2``: a discovery address brackets an IPv6 host). The store
controller pushes each object L1 holds into this node's published pool (its one copy) and publishes its
location; a LOOKUP on another server resolves its chunks in the directory and its prefetch pulls them
from here into that server's L1, where its engine retrieves them as local hits.

The pool is the tier's own host memory, not the server's L1 arena: L1 reuses its space under its own
leases and eviction, and a remote read may be in flight at any moment on the data plane's threads; a
separate pool keeps the rule "a range a reader may still be sending is never reused" inside one small
module (``pool.py``) at the cost of one copy per object, made on the store controller's thread, off the
request path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvdepot.peer.config import PeerConfig
from kvdepot.peer.dataplane import PageOutcome
from kvdepot.peer.node import PeerNode
from kvdepot.storage.l2.backend import BackendAdapter
from kvdepot.storage.l2.contract import AdapterType, LookupHints, TierServices
from kvdepot.storage.l2.envelope import RejectedObject
from kvdepot.types import ObjectKey, leading_run

log = logging.getLogger(__name__)

class PeerAdapter(BackendAdapter):
    kind = "peer"

    def __init__(self, name: str, config: PeerConfig, services: TierServices | None = None) -> None:
        super().__init__(name, workers=config.workers, services=services)
        self.config = config
        self.node = PeerNode(config)

    def start(self) -> None:
        self.node.start()
        super().start()

    def _put(self, key: ObjectKey, payload: memoryview) -> None:
        if not self.node.put_many([(bytes(key), payload)])[0]:
            raise RejectedObject(f"the peer pool ({self.config.pool_size_mb} MiB) cannot take an object of {memoryview(payload).nbytes} bytes now")

    def _get_into(self, key: ObjectKey, dest: memoryview) -> bool:
        return self._load_all([(key, dest)])[0]

    def _load_all(self, pairs: list[tuple[ObjectKey, memoryview]]) -> list[bool]:
        """One directory round and one data-plane request per holding node for the whole batch."""
        deadline = time.monotonic() + self.config.timeout_s
        views = [memoryview(d).cast("B") for _, d in pairs]
        keys = [bytes(k) for k, _ in pairs]
        # Where the lookup just found them (the node remembers): no second directory round.
        outcomes, located = self.node.fetch(keys, views, deadline)
        for (key, _), loc, outcome in zip(pairs, located, outcomes, strict=True):
            if outcome is PageOutcome.CORRUPT:
                self._count("corrupt")
                log.warning("L2 %s: object %s from %s failed its checksum: a miss", self.name, bytes(key).hex()[:16], loc.node if loc else "?")
                if loc is not None and self.node.info is not None and loc.node == self.node.info.id:
                    self.node.delete(bytes(key))  # ours: never served again
        got = [o is PageOutcome.HIT for o in outcomes]
        self._count("loaded", sum(got))
        return got

    def corrupt_for_test(self, key: ObjectKey, offset: int) -> None:
        """Flip one byte of this node's copy (tests prove a corrupt page is a miss, never bad KV).
        ``offset`` counts as in the other tiers' envelopes (header and key first); the pool holds the
        payload alone, so it is taken modulo the page's length."""
        entry = self.node.pool.acquire(bytes(key))
        assert entry is not None, "no such page here"
        try:
            view = self.node.pool.view(entry)
            view[offset % entry.length] ^= 0xFF
        finally:
            self.node.pool.release(entry)

    def _contains(self, keys: list[ObjectKey]) -> list[bool]:
        return self._contains_hinted(keys, None)

    def _contains_hinted(self, keys: list[ObjectKey], hints: LookupHints | None) -> list[bool]:
        """Where each object is: the router's hinted node first, then the directory. With the engine's
        prefill rate, a leading run that lives on other nodes is counted only if pulling it is
        estimated faster than recomputing it (else: a miss, and the decision is counted)."""
        deadline = time.monotonic() + self.config.timeout_s
        raw = [bytes(k) for k in keys]
        locations = self.node.resolve(raw, deadline, hints.source if hints is not None else "", remembered=False)
        n = leading_run(loc is not None for loc in locations)
        recompute_s = hints.recompute_s(n) if hints is not None else None
        worth = self.node.worth_pulling(locations[:n], recompute_s)
        return [loc is not None for loc in worth + locations[n:]]

    def _delete(self, key: ObjectKey) -> None:
        self.node.delete(bytes(key))

    def _clear(self) -> int:
        return self.node.clear()

    def _usage(self) -> tuple[int, int, int]:
        s = self.node.pool.stats()
        return s.used_bytes, s.capacity_bytes, s.keys

    def _close_backend(self) -> None:
        self.node.close()

    def _degraded(self) -> str:
        """A node no master answers (a head not there, another secret) shares its pages with nobody
        and reads nobody's: the tier is down for the cluster although its own tasks succeed."""
        node = self.node
        if node.info is None or node.head == node.info.id or (node.joined and not node.cut_off):
            return ""
        return f"no master of the peer cluster answers (discovery head {node.head}: is it up, and is the secret the same?)"

    def _details(self) -> dict[str, Any] | None:
        summary = self.node.metrics.summary()
        return {
            "node": self.node.info.id if self.node.info else "",
            "members": len(self.node.members()),
            "pull_decisions": summary["pull_decisions"],
            "hints": summary["hints"],
            "publish": {"owed": len(self.node.owed), "repaid": self.node.repaid, "unpublish_owed": len(self.node.unpublish_owed),
                        "unpublish_dropped": self.node.unpublish_owed.dropped},
            "peers": self.node.planner.snapshot(),
        }


ADAPTER = AdapterType("peer", PeerConfig, PeerAdapter, help="other kvdepot servers' objects, through a peer cluster (no master)")
