"""Embedded, multi-master discovery: who is in the cluster, with no machine set aside for it.

Every node runs the discovery service on its control port. The active masters are the first
``max_masters`` live members in one fixed order: the head (the ``discovery`` address every node is
started with) first, then the rest by node id; so every node computes the same masters from the same
members, a dead non-head master is replaced by the next node in that order, and nothing has to be
elected. Each node heartbeats every master it knows; each master keeps a table of who it heard from
and expires a member silent for ``member_ttl_s``. A node keeps the last membership a master gave it,
so a master outage (the head's included) does not stop established reads and writes; a node that
cannot reach any master keeps its cached view and keeps trying (the head, the masters it knew, and
any other bootstrap address it was given). A node that is not a master takes what every master that
answered knows, together (``merged``): a master that has just restarted (the head, on its address)
knows only who has heartbeated it since, and its view alone would drop the others from the node's
ring and directory shard, records a master never publishes again, since its own view never changed.

A master that has just started is *settling* until it has either adopted a settled master's table or
been up for ``member_ttl_s`` (by then every live node has heartbeated it, or would have expired at any
master); its table says so. A settling table (and a merge of settling tables only) adds members and
newer runs but is never taken as word that a member left: a node applying one keeps every member it
knows and drops no one's records. So a head restarted with no other master up (``max_masters=1``, or
all the others down) cannot narrow anyone's membership, however the heartbeats fall.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from kvdepot.protocol.messages import PeerMembershipReply, PeerNodeInfo

DEFAULT_MAX_MASTERS = 3


def ordered(members: Iterable[PeerNodeInfo], head: str) -> list[PeerNodeInfo]:
    """The one order every node agrees on: the head first, then by id."""
    return sorted(members, key=lambda n: (n.id != head, n.id))


def masters_of(members: Iterable[PeerNodeInfo], head: str, max_masters: int) -> list[str]:
    return [n.id for n in ordered(members, head)[:max_masters]]


def is_table(view: PeerMembershipReply) -> bool:
    """A master's table (each member with the time since it was heard), not a node's cached view."""
    return len(view.silent_ms) == len(view.members)


def merged(tables: Sequence[PeerMembershipReply], head: str, max_masters: int) -> PeerMembershipReply:
    """Every member any of these masters' tables names, each as its newest run, with the shortest silence
    heard of that run (so a node promoted to master starts from it, as from one master's table). Only
    masters' tables: two nodes' cached views, each the other's bootstrap, would keep a dead node for ever.
    Settling when every table is: one settled table names every live member."""
    newest: dict[str, tuple[PeerNodeInfo, int]] = {}
    for table in tables:
        for node, silent in zip(table.members, table.silent_ms, strict=True):
            old = newest.get(node.id)
            if old is None or old[0].incarnation < node.incarnation or (old[0].incarnation == node.incarnation and silent < old[1]):
                newest[node.id] = (node, silent)
    members = ordered((node for node, _ in newest.values()), head)
    return PeerMembershipReply(members=members, masters=masters_of(members, head, max_masters), head=head,
                               silent_ms=[newest[n.id][1] for n in members], settling=all(t.settling for t in tables))  # fmt: skip


class MemberTable:
    """A master's record of who it heard from and when. Thread-safe (the RPC loop writes it, the
    node's heartbeat thread expires it). Settling (it may lack live members) from its creation, at the
    node's start, until it adopts a settled table or ``ttl_s`` has passed."""

    def __init__(self, head: str, max_masters: int, ttl_s: float, now: float | None = None) -> None:
        self.head = head
        self.max_masters = max_masters
        self.ttl_s = ttl_s
        self._seen: dict[str, tuple[PeerNodeInfo, float]] = {}
        self._lock = threading.Lock()
        self._settles_at = (time.monotonic() if now is None else now) + ttl_s

    def settling(self, now: float | None = None) -> bool:
        """Could a live member be missing? Until every live node has had a full TTL to heartbeat this
        table (a node silent that long is gone at any master), unless a settled table was adopted."""
        return (time.monotonic() if now is None else now) < self._settles_at

    def resettle(self, now: float | None = None) -> None:
        """Settling again, for a TTL from now (a node promoted to master with no master's table to adopt)."""
        with self._lock:
            self._settles_at = max(self._settles_at, (time.monotonic() if now is None else now) + self.ttl_s)

    def heard(self, node: PeerNodeInfo, now: float | None = None) -> bool:
        """Record a heartbeat; True when it is news (a new member, or a member restarted). A heartbeat of
        a run older than the one this table holds is not taken: a late one of a dead run, or a restart
        whose clock stepped back, which learns of the later run from this table's answer and takes a
        run after it (``PeerNode._run_after``)."""
        with self._lock:
            old = self._seen.get(node.id)
            if old is not None and node.incarnation < old[0].incarnation:
                return False
            self._seen[node.id] = (node, time.monotonic() if now is None else now)
            return old is None or old[0].incarnation != node.incarnation

    def adopt(self, view: PeerMembershipReply) -> None:
        """Take what another master (or this node's cache, on promotion) knows: each member as last
        heard by whoever heard it last. Masters thus agree within a heartbeat, and a member that is
        really gone expires everywhere one TTL after anyone last heard it (an adopted time is never
        newer than a real heartbeat, so two masters cannot keep a dead node alive between them)."""
        if not is_table(view):
            return  # not a master's table (a node's cached view says nothing of when anyone was heard)
        now = time.monotonic()
        with self._lock:
            if not view.settling:
                self._settles_at = min(self._settles_at, now)  # it names every live member: so does this table now
            for node, ms in zip(view.members, view.silent_ms, strict=True):
                if ms / 1000 >= self.ttl_s:
                    continue
                heard = now - ms / 1000
                mine = self._seen.get(node.id)
                if mine is None or (mine[0].incarnation == node.incarnation and mine[1] < heard) or mine[0].incarnation < node.incarnation:
                    self._seen[node.id] = (node, heard)

    def expire(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [nid for nid, (_, seen) in self._seen.items() if now - seen > self.ttl_s]
            for nid in gone:
                del self._seen[nid]
            return gone

    def view(self) -> PeerMembershipReply:
        now = time.monotonic()
        with self._lock:
            heard = {n.id: seen for n, seen in self._seen.values()}
            members = ordered((n for n, _ in self._seen.values()), self.head)
        return PeerMembershipReply(members=members, masters=masters_of(members, self.head, self.max_masters), head=self.head,
                                   silent_ms=[int((now - heard[n.id]) * 1000) for n in members], settling=self.settling(now))  # fmt: skip
