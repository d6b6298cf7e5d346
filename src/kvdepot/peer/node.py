"""A peer node: the pool, its shard of the directory, discovery and the data plane, put together.

One node per process (a standalone ``kvdepot peer``, a ``PeerStore`` inside an engine, or the ``peer``
tier of a kvdepot server). Its control port serves discovery and its directory shard (typed messages
over the project's RPC layer, CurveZMQ when the cluster has a secret); its data port serves pool pages
(``dataplane.py``).

Life cycle::

    NEW ──start──► RUNNING ──close──► CLOSED

``start`` binds both ports, joins (waits up to ``join_timeout_s`` for a master's answer) and starts the
heartbeat. Every membership change rebuilds the ring, drops the records of nodes that left, and
re-publishes this node's pages to their owners under the new ring (so the directory re-shards); a
settling master's table (``discovery.py``) only adds members, so no one leaves on its word. A
publish some owner missed (stalled, timed out, suspected) is owed and sent again on the next
heartbeat (``owed.py``), and so is an unpublish.

Reads: resolve every key at its owner (a failed or empty answer falls back to the next replica; a node
that failed a call, or did not answer within the full ``control_timeout_s``, is skipped for
``SUSPECT_S``), then pull the pages, grouped by the node that holds
them, straight into the caller's buffers; a page held here is one memcpy. Every failure is a miss. A
read remembers where it found pages (``locations.py``) for ``location_cache_s``: reading one again
skips the directory; a remembered location that went stale is one miss on the data plane, then a
fresh lookup.
"""

from __future__ import annotations

import enum
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import msgspec
import zmq

from kvdepot.config import flag_of, tcp_endpoint
from kvdepot.errors import ConfigError, ErrorCode, KVDepotError, KVDepotTimeout
from kvdepot.observability.metrics import PeerMetrics
from kvdepot.peer.addresses import hint_target, listen_family, node_id
from kvdepot.peer.config import PeerConfig
from kvdepot.peer.dataplane import PageOutcome, PageRead, ReadProgress, TcpTransport
from kvdepot.peer.directory import LEGACY_RUN, DirectoryShard, from_an_earlier_run
from kvdepot.peer.discovery import MemberTable, is_table, masters_of, merged, ordered
from kvdepot.peer.locations import LocationCache
from kvdepot.peer.owed import OwedRecords, OwedUnpublishes
from kvdepot.peer.planner import PullPlanner
from kvdepot.peer.pool import PoolEntry, PublishedPool
from kvdepot.peer.ring import HashRing
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.messages import PeerLocation, PeerMembershipReply, PeerNodeInfo, RequestType
from kvdepot.rpc.channel import Heartbeat, PendingCall, RpcChannel
from kvdepot.rpc.dispatch import Call, HandlerMode, HandlerSpec, Reply
from kvdepot.rpc.security import CurveSecurity
from kvdepot.rpc.server import RpcServer
from kvdepot.storage.l2.envelope import copy_digest

log = logging.getLogger(__name__)
T = TypeVar("T")

SUSPECT_S = 2.0  # a node whose call failed is not asked again for this long
CHANNELS_KEPT_PER_NODE = 8  # idle control channels kept per node (more are made when threads need them)
# A control channel whose call timed out is kept (its connection may still be coming up: on a long link a
# new CurveZMQ connection takes several round trips, more than one call's timeout), until this many of
# its requests in a row went unanswered; then it is closed, with what it still queues (a dead node).
UNANSWERED_KEPT = 3
# A node that answers with one of these is up and refuses what this version sends (a node of another
# kvdepot version in a rolling upgrade: its messages lack a field ours carry): never suspected for it (its
# pages read as misses meanwhile), and what it refused is not owed (it would refuse it on every heartbeat).
REFUSALS = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_REQUEST_TYPE})
MAX_KEY_BYTES = 1024
PROMOTE_SLICE = 8  # pages promoted from disk, then read, at a time
RTT_SLACK_S = 0.002  # a directory reply collected after waiting this long on other owners' is no round-trip sample
# The body one publish or unpublish request aims for: a re-publish of every page goes to each owner in
# slices of this, well under the codec's limit (one request per owner was refused past ~40k pages, for
# good), and each a few milliseconds of the owner's loop, where its shard handles them.
DIRECTORY_BODY_BYTES = 1 << 20


class NodeState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    CLOSED = "closed"


def _new_incarnation() -> int:
    """A run's incarnation: the wall clock at start, in ns. A clock that stepped back across a restart
    gives a run older than its predecessor; the cluster then tells it so, and it takes a later one
    (``PeerNode._apply``)."""
    return time.time_ns()


def _free_port(host: str) -> int:
    with socket.socket(listen_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _control_endpoint(node: str) -> str:
    """A node's control endpoint from its id (ids bracket IPv6 already: ``tcp://[::1]:31995``)."""
    return f"tcp://{node}"


class PeerNode:
    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        secret = config.cluster_secret
        self.secured = bool(secret)
        try:
            self.pool = PublishedPool(config.pool_size_mb << 20)
        except OSError as exc:  # more than this host can map: the mmap's ENOMEM named nothing
            raise ConfigError(f"{flag_of(type(config), 'pool_size_mb')} {config.pool_size_mb}: cannot reserve the published pool ({exc})") from None
        self.shard = DirectoryShard()
        self._security = CurveSecurity(secret) if secret else None
        self._client_security = CurveSecurity(secret) if secret else None
        self._transport = TcpTransport(secret.encode(), config.max_channels_per_peer)
        self._data_server = None
        self._rpc: RpcServer | None = None
        self._zctx = zmq.Context()
        self._channels: dict[str, list[RpcChannel]] = {}  # idle control channels per node
        self._channels_lock = threading.Lock()
        self._suspects: dict[str, float] = {}
        self._legacy_nodes: set[str] = set()  # nodes seen publishing records without an incarnation (warned once)
        self._refusing: set[tuple[str, type]] = set()  # (node, request) it refused as this version sends it (warned once)
        self._heard_self = False  # a heartbeat of this node's own came in (it reached itself by an address)
        self._view_lock = threading.Lock()
        self._members: dict[str, PeerNodeInfo] = {}
        self._masters: list[str] = []
        self._ring = HashRing((), config.vnodes, config.directory_replicas)
        self._joined = threading.Event()
        self._heartbeat = Heartbeat(config.heartbeat_interval_s, self._safe_tick, name="kvdepot-peer-heartbeat")
        self.state = NodeState.NEW
        self.info: PeerNodeInfo | None = None
        self.head = ""
        self._table: MemberTable | None = None
        self.republished = 0
        self.owed = OwedRecords()  # keys whose record some owner missed: sent again on the heartbeat
        self.repaid = 0
        self.unpublish_owed = OwedUnpublishes()  # (owner, key, generation) some owner missed: sent again on the heartbeat
        self.disk = None  # DiskTier, when disk_path is set and usable
        self._disk_only: set[bytes] = set()  # pages on disk and not in the pool (published non-resident)
        self._disk_lock = threading.Lock()
        self._warmer = None  # a one-thread executor promoting pages that exists() found on disk
        self._cut_off = False  # no master answered the last heartbeat round
        self._silent_masters: dict[str, int] = {}  # masters found gone (their runs), until a master's table answers
        self._last_heard = 0.0  # when a master last answered this node's heartbeat (monotonic)
        self._last_answered_sent = 0.0  # when the last heartbeat a master answered was sent (monotonic)
        self.metrics = PeerMetrics(self._metrics_state)
        self._metrics_server = None
        self.planner = PullPlanner()
        self.located = LocationCache(config.location_cache_s)

    def __repr__(self) -> str:
        return f"PeerNode({self.info.id if self.info else '?'}, {self.state.value}, {len(self._members)} members)"

    # --- life cycle ----------------------------------------------------------------------------------

    def start(self) -> PeerNode:
        if self.state is not NodeState.NEW:
            raise RuntimeError(f"a {self.state.value} node cannot start")
        from kvdepot.peer.dataplane import DataServer

        cfg = self.config
        self._data_server = DataServer(self.pool, cfg.cluster_secret.encode(), cfg.host, cfg.data_port)
        port = cfg.port or _free_port(cfg.host)
        self.info = PeerNodeInfo(id=node_id(cfg.host, port), host=cfg.host, control_port=port, data_port=self._data_server.port,
                                 incarnation=_new_incarnation())  # fmt: skip
        self.head = (cfg.bootstrap or [self.info.id])[0]
        self._table = MemberTable(self.head, cfg.max_masters, cfg.member_ttl_s)
        self._table.heard(self.info)
        self._apply(PeerMembershipReply(members=[self.info], masters=[self.info.id], head=self.head))
        if cfg.disk_path:
            from concurrent.futures import ThreadPoolExecutor

            from kvdepot.peer.disk import open_disk

            self.disk, on_disk = open_disk(cfg.disk_path, int(cfg.disk_size_gb * (1 << 30)), self.pool, self._disk_dropped)
            self._disk_only = set(on_disk)
            self._warmer = ThreadPoolExecutor(1, thread_name_prefix="kvdepot-peer-warm")
        self._rpc = RpcServer([tcp_endpoint(cfg.host, port)], self._handlers(), workers=4, security=self._security)
        try:
            self._rpc.start()
        except BaseException:  # the control port is taken: give back what was opened
            self._data_server.close()
            if self._warmer is not None:
                self._warmer.shutdown(wait=False)
            if self.disk is not None:
                self.disk.close()
            raise
        self._data_server.start()
        self.state = NodeState.RUNNING
        self._last_heard = self._last_answered_sent = time.monotonic()
        self._tick()
        if self.head != self.info.id and not self._join_within(cfg.join_timeout_s):
            log.warning("peer %s: no master answered in %.1f s (is %s up, and is the secret right?); serving own pages, still trying",
                        self.info.id, cfg.join_timeout_s, self.head)  # fmt: skip
        if cfg.metrics_port:
            from kvdepot.peer.monitor import MetricsServer

            self._metrics_server = MetricsServer(self.metrics, cfg.host, cfg.metrics_port, cfg.metrics_dashboard, self.info.id)
            self._metrics_server.start()
        if self._disk_only:
            self._republish()  # what a previous run left on disk: readable (promoted on a read)
        self._heartbeat.start()
        log.info("peer node %s up (data port %d, head %s, %s)", self.info.id, self.info.data_port, self.head,
                 "secret set" if self.secured else "open cluster: no secret")  # fmt: skip
        return self

    def _join_within(self, timeout_s: float) -> bool:
        """Heartbeat rounds until a master answers or ``timeout_s`` passes (the heartbeat thread is not
        running yet: a head that comes up a moment after this node is joined a round later, not when the
        whole timeout has passed)."""
        deadline = time.monotonic() + timeout_s
        while not self._joined.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or self._joined.wait(min(self.config.heartbeat_interval_s, left)):
                break
            self._safe_tick()
        return self._joined.is_set()

    def close(self) -> None:
        if self.state is NodeState.CLOSED:
            return
        self.state = NodeState.CLOSED
        self._heartbeat.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
        if self._rpc is not None:
            self._rpc.close(drain_s=0.5)
        if self._data_server is not None:
            self._data_server.close()
        self._transport.close()
        if self._warmer is not None:
            self._warmer.shutdown(wait=True, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
        with self._channels_lock:
            for idle in self._channels.values():
                for ch in idle:
                    ch.close()
            self._channels.clear()
        if self._client_security is not None:
            self._client_security.close()
        self._zctx.destroy(linger=0)
        self.pool.close()

    @property
    def joined(self) -> bool:
        return self._joined.is_set()

    @property
    def cut_off(self) -> bool:
        """No master answered the last heartbeat round: serving with the membership it knew."""
        return self._cut_off

    def members(self) -> list[PeerNodeInfo]:
        with self._view_lock:
            return ordered(self._members.values(), self.head)

    def masters(self) -> list[str]:
        with self._view_lock:
            return list(self._masters)

    # --- writes --------------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, object]]) -> list[bool]:
        """Copy each page into the pool and publish where it is. Per page: True only where the page is
        still held when the call ends (in the pool, or on the disk it was evicted to); False where the
        pool could not take it, or a later page of the same call evicted it again (a batch larger than
        the pool keeps its last pages, as an LRU would) and no disk kept it."""
        t0 = time.perf_counter()
        entries: list[PoolEntry | None] = []
        evicted: list[PoolEntry] = []
        for key, _ in items:  # every key before any page goes in: a bad one refuses the whole batch
            _check_key(key)
        self.located.forget(key for key, _ in items)  # a copy here now: read that, not a remote one
        try:
            for key, data in items:
                entry, gone = self.pool.put(key, data)
                evicted += gone
                if entry is None and self.disk is not None:
                    entry = self._put_after_disk_catches_up(key, data, evicted)
                entries.append(entry)
                if entry is not None:
                    self._write_through(entry)
        finally:  # a page that raised (empty, not a buffer) still leaves the directory as the pool is
            if evicted:
                self._evicted(evicted)
            # A page a later page of this batch evicted again is not announced (its record would be stale).
            self._publish([e for e in entries if e is not None and e.published])
        newest = {e.key: e for e in entries if e is not None}  # a key given twice: its last page counts
        out = [e is not None and self._held(newest[e.key]) for e in entries]
        taken = [e for e in entries if e is not None]  # the write metrics count copies into the pool
        self.metrics.write_done(time.perf_counter() - t0, len(taken), len(out) - len(taken), sum(e.length for e in taken))
        return out

    def _held(self, entry: PoolEntry) -> bool:
        """Is ``entry``'s page still held: in the pool, or on the disk it was evicted to?"""
        if entry.published:
            return True
        with self._disk_lock:
            return entry.key in self._disk_only

    def _put_after_disk_catches_up(self, key: bytes, data, evicted: list[PoolEntry]) -> PoolEntry | None:
        """The pool is full of pages still queued for the disk (pinned until written): wait for the
        writer, within ``timeout_s``, rather than refuse the page."""
        assert self.disk is not None
        deadline = time.monotonic() + self.config.timeout_s
        while self.disk.pending() and time.monotonic() < deadline:
            time.sleep(0.002)
            entry, gone = self.pool.put(key, data)
            evicted += gone
            if entry is not None:
                return entry
        return None

    def _write_through(self, entry: PoolEntry) -> None:
        if self.disk is None:
            return
        with self._disk_lock:
            self._disk_only.discard(entry.key)
        pinned = self.pool.acquire(entry.key, entry.generation)  # held until the disk has it
        if pinned is not None:
            self.disk.put(pinned)

    def _evicted(self, entries: Sequence[PoolEntry], deadline: float | None = None) -> None:
        """Pages the pool let go: non-resident where the disk has them, else gone from the directory."""
        with self._disk_lock:  # one step with _disk_dropped's check: a page the disk drops meanwhile is not kept
            kept = {e.key for e in entries if self.disk is not None and self.disk.has(e.key)}
            self._disk_only.update(kept)
        on_disk = [e for e in entries if e.key in kept]
        gone = [e for e in entries if e.key not in kept]
        if on_disk:
            self._publish_non_resident([self._record(e, resident=False) for e in on_disk], deadline)
        if gone:
            self._unpublish(gone, deadline)

    def _publish_non_resident(self, records: Sequence[PeerLocation], deadline: float | None = None) -> None:
        """Publish the records of pages kept on disk only; one the disk dropped while its record was on
        the way (``_disk_dropped``'s unpublish may have landed first) is unpublished again."""
        self._publish_records(records, deadline)
        with self._disk_lock:
            late = [r for r in records if r.key not in self._disk_only and self.pool.peek(r.key) is None]
        if late:
            self._unpublish([PoolEntry(r.key, 0, 0, r.generation, b"", published=False) for r in late], deadline)

    def _disk_dropped(self, keys: Sequence[bytes], deadline: float | None = None) -> None:
        """The disk let pages go on its own (its size bound, a corrupt object): each that is in neither
        the pool nor the disk now is forgotten and unpublished. The unpublish names a generation taken
        before the check, so a page put since (newer) is never unpublished, and one put before it is
        in the pool, so not taken for gone."""
        if self.disk is None:
            return
        bound = self.pool.fresh_generation()
        with self._disk_lock:
            gone = [key for key in dict.fromkeys(keys) if self.pool.peek(key) is None and not self.disk.has(key)]
            self._disk_only.difference_update(gone)
        if gone:
            self.located.forget(gone)
            self._unpublish([PoolEntry(key, 0, 0, bound, b"", published=False) for key in gone], deadline)

    def delete(self, key: bytes) -> bool:
        # A page only on disk was published under a generation older than this; a page of the key put
        # while we delete gets a newer one, so the unpublish below never takes its record away.
        bound = self.pool.fresh_generation()
        self.located.forget([key])
        entry = self.pool.remove(key)
        found = entry is not None
        if self.disk is not None:
            on_disk = self.disk.has(key)
            self.disk.delete(key)  # even when not there yet: a queued or running write of it is undone
            with self._disk_lock:
                self._disk_only.discard(key)
            # A promote that read the page from disk before the delete put it into the pool meanwhile
            # (the delete waited for it): that copy goes too.
            promoted = self.pool.remove(key)
            if promoted is not None:
                found = True
                self._unpublish([promoted])
            if on_disk:
                found = True
                entry = entry or PoolEntry(key, 0, 0, bound, b"", published=False)
        if entry is not None:
            self._unpublish([entry])
        return found

    def clear(self) -> int:
        bound = self.pool.fresh_generation()  # as in delete
        self.located.clear()
        gone = self.pool.clear()
        n = len(gone)
        if self.disk is not None:
            with self._disk_lock:
                disk_only, self._disk_only = self._disk_only, set()
            for e in gone:
                self.disk.delete(e.key)
            for key in disk_only:
                self.disk.delete(key)
            # Pages a promote read from disk before those deletes, and put into the pool meanwhile: those
            # that were on disk only, and those the pool's clear had just taken (their disk copy was left).
            promoted = [e for key in {*disk_only, *(e.key for e in gone)} if (e := self.pool.remove(key)) is not None]
            gone += [PoolEntry(key, 0, 0, bound, b"", published=False) for key in disk_only] + promoted
            n += len(disk_only)
        self._unpublish(gone)
        return n

    def _record(self, e: PoolEntry, resident: bool = True) -> PeerLocation:
        assert self.info is not None
        return PeerLocation(key=e.key, node=self.info.id, offset=e.offset, length=e.length, generation=e.generation, checksum=e.checksum,
                            resident=resident, incarnation=self.info.incarnation)  # fmt: skip

    def _publish(self, entries: Sequence[PoolEntry], deadline: float | None = None) -> None:
        self._publish_records([self._record(e) for e in entries], deadline)
        # Another writer's put may have evicted some of them while their records were on the way, and
        # that eviction's unpublish (or non-resident record) may have landed first: a record of freed
        # space would stay, counted by every existence check. Said again, after ours has landed.
        late = [e for e in entries if not e.published]
        if late:
            self._evicted(late, deadline)

    def _publish_records(self, records: Sequence[PeerLocation], deadline: float | None = None) -> None:
        by_owner: dict[str, list[PeerLocation]] = {}
        ring = self._ring
        for rec in records:
            for owner in ring.owners(rec.key, self.config.directory_replicas):
                by_owner.setdefault(owner, []).append(rec)
        parts = {owner: [m.PeerPublishRequest(records=part) for part in _slices(group, _record_bytes)] for owner, group in by_owner.items()}
        later = 0
        for owner, req, reply in self._call_shards(parts, deadline):
            if reply is None:
                if (owner, m.PeerPublishRequest) not in self._refusing:
                    self.owed.owe(rec.key for rec in req.records)
            else:
                later = max(later, reply.later_run)
        if later > self.info.incarnation:
            # The owner knows a later run of this node than this one (the clock stepped back across a
            # restart) and refused these records: no master's table says so to the only master. The new
            # run publishes every page again.
            self._run_after(later)

    def _unpublish(self, entries: Sequence[PoolEntry], deadline: float | None = None) -> None:
        """Remove these pages' records at their owners; an owner that fails or is skipped (suspect) is
        owed the unpublish, sent again on the heartbeat (``_repay``). What is owed names a generation,
        never "any": a bound taken now stands for it, so a page of the key written later is spared."""
        assert self.info is not None
        bound = self.pool.fresh_generation()
        by_owner: dict[str, list[PoolEntry]] = {}
        for e in entries:
            for owner in self._ring.owners(e.key, self.config.directory_replicas):
                by_owner.setdefault(owner, []).append(e)
        parts = {owner: [m.PeerUnpublishRequest(keys=[e.key for e in part], node=self.info.id, generations=[e.generation for e in part])
                         for part in _slices(group, lambda e: len(e.key) + _UNPUBLISH_ITEM_BYTES)] for owner, group in by_owner.items()}  # fmt: skip
        for owner, req, reply in self._call_shards(parts, deadline):
            if reply is None:
                self.unpublish_owed.owe(owner, ((k, min(g, bound)) for k, g in zip(req.keys, req.generations, strict=True)))

    def _call_shards(self, requests: dict[str, list], deadline: float | None) -> list[tuple[str, object, object | None]]:
        """Each owner's directory requests (publishes, unpublishes), in rounds of one request to every owner
        at once: an owner that does not answer (gone, not yet out of the ring) costs one control timeout
        for the whole round, not one per such owner in turn. Called on the heartbeat thread at every
        membership change (the re-publish), where several owners that left together (a scale-down)
        held up the heartbeat for longer than the TTL: the node took itself for one that had been away,
        or the masters expired it. Returns (owner, request, reply or None: failed or skipped) for each."""
        assert self.info is not None
        out: list[tuple[str, object, object | None]] = []
        rounds = max((len(bodies) for bodies in requests.values()), default=0)
        for r in range(rounds):
            started: list[tuple[str, object, RpcChannel, PendingCall, float, float]] = []
            try:
                for owner, bodies in requests.items():
                    if r >= len(bodies):
                        continue
                    body = bodies[r]
                    if owner == self.info.id:
                        out.append((owner, body, self._call_shard(owner, body, deadline)))  # in process
                        continue
                    begun = self._begin(owner, body, math.inf if deadline is None else deadline)
                    if begun is None:
                        out.append((owner, body, None))
                    else:
                        started.append((owner, body, *begun))
                collecting = time.perf_counter()
                while started:
                    owner, body, ch, pending, t0, timeout = started.pop(0)
                    sample = time.perf_counter() - collecting <= RTT_SLACK_S  # as in _ask_many
                    reply = self._collect(owner, ch, pending, t0, timeout, sample)
                    if reply is not None:
                        self._refusing.discard((owner, type(body)))  # it takes them now, as in _call_shard
                    out.append((owner, body, reply))
            finally:
                for owner, _, ch, pending, _, _ in started:  # only on an exception: their replies are never read
                    pending.abandon()
                    self._return_channel(owner, ch, False)
        return out

    # --- reads ---------------------------------------------------------------------------------------

    def resolve(self, keys: Sequence[bytes], deadline: float, hint: str = "", *, remembered: bool = True,
                failed: dict[int, PeerLocation] | None = None) -> list[PeerLocation | None]:  # fmt: skip
        """Where each key's page can be read from (None: nowhere known). ``remembered``: a location
        this node read or looked up within ``location_cache_s`` is taken as it is (a read checks it
        anyway); False asks the directory for every key (an existence check, a stale location). What
        is found is remembered either way. ``hint`` (a router's ``host[:port]`` of where the KV lives)
        is asked first, for its own pages; what it does not hold is looked up in the directory as
        usual (this node's own shard first: a record held here costs no round trip; a wrong hint costs
        one, never an error). ``failed``: per index, a location
        just read in vain (its owner no longer has that generation): a shard that still names it is
        passed over for the next replica, whose record may be newer (a publish that did not reach the
        first one)."""
        _check_keys(keys)
        ring = self._ring
        now = time.monotonic()
        with self._view_lock:
            usable = {nid: n.incarnation for nid, n in self._members.items() if self._suspects.get(nid, 0.0) <= now}
        found = self.located.get_many(keys, usable) if remembered else [None] * len(keys)
        pending = [i for i, loc in enumerate(found) if loc is None]
        if len(pending) < len(keys):
            self.metrics.remembered(len(keys) - len(pending))
        asked = pending
        if hint and pending:
            pending = self._ask_hinted(hint, keys, found, usable, deadline, pending)
        replicas = self.config.directory_replicas
        owners: list[tuple[str, ...]] = [()] * len(keys)
        for i, key_owners in zip(pending, ring.owners_many([keys[i] for i in pending], replicas), strict=True):
            owners[i] = key_owners
        # Then this node's own shard, where it is one of a key's owners (every key in a cluster of
        # `directory_replicas` nodes): a record held here costs no round trip. A stale one (a publish or
        # unpublish that did not reach this replica yet) is caught by the read's generation check and
        # passed over through ``failed``; what is not here is asked of the other owners as before.
        assert self.info is not None
        me = self.info.id
        here = [i for i in pending if me in owners[i]]
        if here:
            body = m.PeerResolveRequest(keys=[keys[i] for i in here])
            not_here = self._fill(here, self._serve_shard(body), found, usable, failed)
            self.metrics.directory_local(len(here) - len(not_here))
            pending = [i for i in pending if found[i] is None]
        asked_here = set(here)
        for replica in range(replicas):
            by_owner: dict[str, list[int]] = {}
            for i in pending:
                key_owners = owners[i]
                if replica < len(key_owners):
                    node = key_owners[replica]
                    if node != me or i not in asked_here:
                        by_owner.setdefault(node, []).append(i)
            if not by_owner:
                continue
            # Each round gets its share of what is left: an owner that does not answer (dead, not yet
            # out of the ring) must leave the next replica time to, whatever the caller's budget.
            now = time.monotonic()
            round_deadline = now + (deadline - now) / (replicas - replica)
            pending = self._ask_many(by_owner, keys, found, usable, round_deadline, failed=failed)
            if not pending or time.monotonic() >= deadline:
                break
        located = [found[i] for i in asked]
        hit = len(located) - located.count(None)
        self.metrics.looked_up(hit, len(asked) - hit)
        self.located.put_many(located)
        return found

    def _ask_hinted(self, hint: str, keys: Sequence[bytes], found: list[PeerLocation | None], usable: dict[str, int], deadline: float,
                    pending: list[int]) -> list[int]:  # fmt: skip
        """Fill ``found[i]`` for ``i`` in ``pending`` from the hinted node(s)' own pages; returns the
        indices still to look up."""
        named, host = hint_target(hint)  # "[::1]:31995" names a node, "[::1]" a host (both canonical, as members' are)
        with self._view_lock:
            members = list(self._members.values())
        nodes = [n.id for n in members if named and n.id == named] or [n.id for n in members if n.host == host]
        asked = len(pending)
        # The hint gets half of what is left: a hinted node that does not answer (dead, not yet out of
        # the ring) must leave the directory time to, or a budget under control_timeout_s went to it whole.
        hint_deadline = deadline - (deadline - time.monotonic()) / 2
        for node in nodes:
            if node not in usable or not pending:
                continue
            pending = self._ask_many({node: pending}, keys, found, usable, hint_deadline, own_pages=True)
        self.metrics.hinted(asked - len(pending), len(pending))
        return pending

    def _ask_many(self, by_owner: dict[str, list[int]], keys: Sequence[bytes], found: list[PeerLocation | None], usable: dict[str, int],
                  deadline: float, own_pages: bool = False, failed: dict[int, PeerLocation] | None = None) -> list[int]:  # fmt: skip
        """One resolve at each owner for ``keys[i]`` of its indices (its shard, or with ``own_pages`` its
        own pages), all in flight at once: the remote ones are sent first and this node's own shard is
        served while they answer, so a lookup across N owners costs one round trip, not N. Fills
        ``found`` with the best usable location of each; returns the indices still unknown, in order."""
        assert self.info is not None
        still: list[int] = []
        local: list[int] | None = None
        started: list[tuple[str, list[int], RpcChannel, PendingCall, float, float]] = []
        try:
            for owner, idx in by_owner.items():
                if owner == self.info.id:
                    local = idx
                    continue
                begun = self._begin(owner, m.PeerResolveRequest(keys=[keys[i] for i in idx], own_pages=own_pages), deadline)
                if begun is None:
                    still += idx
                else:
                    started.append((owner, idx, *begun))
            if local is not None:
                body = m.PeerResolveRequest(keys=[keys[i] for i in local], own_pages=own_pages)
                still += self._fill(local, self._serve_shard(body), found, usable, failed)
            collecting = time.perf_counter()
            while started:
                owner, idx, ch, pending, t0, timeout = started.pop(0)
                # Replies are collected one after another: one that came while an earlier owner was still
                # awaited was timed to its collection, the slower owner's delay (up to control_timeout_s)
                # taken for its round trip. Only a reply awaited from (about) the start is a sample.
                sample = time.perf_counter() - collecting <= RTT_SLACK_S
                still += self._fill(idx, self._collect(owner, ch, pending, t0, timeout, sample), found, usable, failed)
        finally:
            for owner, _, ch, pending, _, _ in started:  # only on an exception: their replies are never read
                pending.abandon()
                self._return_channel(owner, ch, False)
        still.sort()
        return still

    def _fill(self, idx: list[int], reply: m.PeerResolveReply | None, found: list[PeerLocation | None], usable: dict[str, int],
              failed: dict[int, PeerLocation] | None = None) -> list[int]:  # fmt: skip
        """``found[i]`` from one resolve reply (None: that owner failed); returns the indices it did not
        place. A record the same as ``failed[i]`` (read in vain just now) is not placed."""
        locations = reply.locations if reply is not None else ()
        still = []
        n = len(locations)
        for j, i in enumerate(idx):
            candidates = locations[j] if j < n else ()
            bad = failed.get(i) if failed else None
            if bad is not None:
                candidates = [c for c in candidates if (c.node, c.generation, c.resident) != (bad.node, bad.generation, bad.resident)]
            if len(candidates) == 1:  # the usual answer: one record, placed without _best's loop (a lookup's keys are many)
                loc = None if from_an_earlier_run(candidates[0], usable) else candidates[0]
            else:
                loc = self._best(candidates, usable) if candidates else None
            if loc is None:
                still.append(i)
            else:
                found[i] = loc
        return still

    def _begin(self, owner: str, body, deadline: float) -> tuple[RpcChannel, PendingCall, float, float] | None:
        """A directory request sent to ``owner`` on a leased channel, its reply not yet read, when it
        was sent and the timeout it has (None: the owner is suspect, the deadline has passed, or the
        send failed)."""
        now = time.monotonic()
        if self._suspects.get(owner, 0.0) > now:
            return None
        timeout = min(self.config.control_timeout_s, deadline - now)
        if timeout <= 0:
            return None
        ch = self._lease_channel(owner)
        try:
            return ch, ch.begin(body, timeout), time.perf_counter(), timeout
        except KVDepotError as exc:
            self._return_channel(owner, ch, False)
            self._suspect(owner, body, exc, timeout)
            return None
        except BaseException:
            self._return_channel(owner, ch, False)  # closed, never leaked
            raise

    def _collect(self, owner: str, ch: RpcChannel, pending: PendingCall, t0: float, timeout_s: float, sample: bool = True):
        """The reply to a request ``_begin`` sent with ``timeout_s`` (None when it failed or timed out);
        the channel goes back. ``sample``: its time since ``t0`` is the owner's round trip (for the planner)."""
        ok = timed_out = False
        try:
            reply = pending.result()
            if sample:
                self.planner.call_measured(owner, time.perf_counter() - t0)  # may include our local work meanwhile: tens of µs
            ok = True
            return reply
        except KVDepotError as exc:
            timed_out = isinstance(exc, KVDepotTimeout)
            self._suspect(owner, pending.body, exc, timeout_s)
            return None
        finally:
            self._return_channel(owner, ch, ok, timed_out)

    def _suspect(self, owner: str, what, exc: Exception, timeout_s: float) -> None:
        """Skip ``owner`` for ``SUSPECT_S`` after a call to it failed: a transport failure, or no reply
        within the full ``control_timeout_s``. A timeout the caller's own deadline cut shorter says
        nothing of the owner (SGLang passes a share of its budget), and suspecting it would make every
        page it holds or indexes a miss for the whole process meanwhile; nor does a promote's timeout
        (it waits on the owner's disk, not on its directory). Nor does a refusal (``REFUSALS``): the
        owner answered."""
        assert self.info is not None
        if isinstance(exc, KVDepotError) and exc.code in REFUSALS:
            if (owner, type(what)) not in self._refusing:
                self._refusing.add((owner, type(what)))
                log.warning("peer %s: node %s refuses this version's %s (%s): a node of another kvdepot version? Its pages are "
                            "read, and what it refused is not owed to it", self.info.id, owner, type(what).__name__, exc)  # fmt: skip
            return
        if isinstance(exc, KVDepotTimeout) and (timeout_s < self.config.control_timeout_s or isinstance(what, m.PeerPromoteRequest)):
            log.debug("peer %s: %s to %s timed out after %.3g s: not held against it", self.info.id, type(what).__name__, owner, timeout_s)
            return
        self._suspects[owner] = time.monotonic() + SUSPECT_S
        log.info("peer %s: %s to %s failed (%s): its replica is asked instead", self.info.id, type(what).__name__, owner, exc)

    def own_records(self, keys: Sequence[bytes]) -> list[list[PeerLocation]]:
        """This node's own pages of ``keys`` (in its pool, or non-resident on its disk)."""
        out: list[list[PeerLocation]] = []
        for key in keys:
            entry = self.pool.peek(key)
            if entry is not None:
                out.append([self._record(entry)])
            elif self.disk is not None and (rec := self._disk_record(key)) is not None:
                out.append([rec])
            else:
                out.append([])
        return out

    def _best(self, locations: Sequence[PeerLocation], usable: dict[str, int]) -> PeerLocation | None:
        """This node's own copy first, then one in a live member's pool, then one on a live member's disk
        (to be promoted before it is read); never one on a node that has just failed us, nor one from a
        run of its node before the run ``usable`` knows (a shard that has not yet dropped it)."""
        assert self.info is not None
        best = on_disk = None
        for loc in locations:
            if from_an_earlier_run(loc, usable):
                continue
            if not loc.resident:
                on_disk = on_disk or loc
            elif loc.node == self.info.id:
                return loc
            else:
                best = best or loc
        return best or on_disk

    def fetch(self, keys: Sequence[bytes], dests: Sequence[memoryview], deadline: float,
              located: Sequence[PeerLocation | None] | None = None, *, hint: str = "",
              recompute_s: float | None = None) -> tuple[list[PageOutcome], list[PeerLocation | None]]:  # fmt: skip
        """Resolve (unless ``located`` says where) and read each key's page into its destination (a
        contiguous buffer; one of another size than the page is a miss). A page that was evicted or
        rewritten between the lookup and the read (its owner no longer has that generation) is looked
        up once more and read again: within one batch, promoting pages from a disk can evict others of
        the same batch. ``recompute_s``: what computing these pages again would take; other nodes'
        pages are then pulled only if the estimate says pulling is faster (``planner.py``), else they
        are misses. Returns the outcomes and the locations they were read from."""
        locations = list(located) if located is not None else self.resolve(keys, deadline, hint)
        locations = self.worth_pulling(locations, recompute_s)
        t0 = time.perf_counter()
        sized = [loc if loc is not None and loc.length == memoryview(d).nbytes else None for loc, d in zip(locations, dests, strict=True)]
        out = self.read_into(sized, dests, deadline)
        again = [i for i, (o, loc) in enumerate(zip(out, sized, strict=True)) if o is PageOutcome.MISS and loc is not None]
        self.located.forget(keys[i] for i, o in enumerate(out) if o is PageOutcome.CORRUPT)
        if again and time.monotonic() < deadline:
            self.metrics.stale(len(again))
            self.located.forget(keys[i] for i in again)
            fresh = self.resolve([keys[i] for i in again], deadline, remembered=False, failed={k: sized[i] for k, i in enumerate(again)})  # type: ignore[misc]
            retry = [(i, loc) for i, loc in zip(again, fresh, strict=True)
                     if loc is not None and loc.length == memoryview(dests[i]).nbytes
                     and (loc.node, loc.generation, loc.resident) != (sized[i].node, sized[i].generation, sized[i].resident)]  # type: ignore[union-attr]  # fmt: skip
            if retry:
                got = self.read_into([loc for _, loc in retry], [dests[i] for i, _ in retry], deadline)
                for (i, loc), outcome in zip(retry, got, strict=True):
                    out[i], sized[i] = outcome, loc
        hits = [i for i, o in enumerate(out) if o is PageOutcome.HIT]
        corrupt = sum(o is PageOutcome.CORRUPT for o in out)
        self.metrics.read_done(time.perf_counter() - t0, len(hits), len(out) - len(hits) - corrupt, corrupt,
                               sum(sized[i].length for i in hits))  # type: ignore[union-attr]  # fmt: skip
        return out, sized

    def worth_pulling(self, locations: list[PeerLocation | None], recompute_s: float | None) -> list[PeerLocation | None]:
        """``locations`` with other nodes' pages dropped (None) when pulling them is estimated slower
        than ``recompute_s`` (``planner.py``); the decision is counted. No ``recompute_s``: nothing to
        weigh (the caller does not know its cost), nothing decided."""
        assert self.info is not None
        if recompute_s is None or math.isnan(recompute_s):  # NaN: as unknown (no estimate is ever "faster" than it)
            return locations
        remote: dict[str, int] = {}
        for loc in locations:
            if loc is not None and loc.node != self.info.id:
                remote[loc.node] = remote.get(loc.node, 0) + loc.length
        if not remote:
            return locations
        decision = self.planner.decide(remote, recompute_s)
        self.metrics.decided(decision.pull, decision.reason.value)
        if decision.pull:
            return locations
        log.info("peer %s: recomputing rather than pulling %d bytes (estimated %.1f ms > %.1f ms to recompute)",
                 self.info.id, sum(remote.values()), decision.pull_s * 1e3, decision.recompute_s * 1e3)  # fmt: skip
        return [loc if loc is None or loc.node == self.info.id else None for loc in locations]

    def read_into(self, locations: Sequence[PeerLocation | None], dests: Sequence[memoryview], deadline: float) -> list[PageOutcome]:
        """Pull each located page into its destination (a buffer of exactly the page's size)."""
        assert self.info is not None
        if any(loc is not None and not loc.resident for loc in locations):
            # Pages on a disk: promoted and read a few at a time, so that a batch larger than an owner's
            # pool does not evict its own first pages before they are read.
            out: list[PageOutcome] = []
            for i in range(0, len(locations), PROMOTE_SLICE):
                if time.monotonic() >= deadline:  # what is not promoted by now is a miss
                    return out + [PageOutcome.MISS] * (len(locations) - i)
                part = self._promoted(locations[i : i + PROMOTE_SLICE], deadline)
                out += self._read_resident(part, dests[i : i + PROMOTE_SLICE], deadline)
            return out
        return self._read_resident(locations, dests, deadline)

    def _read_resident(self, locations: Sequence[PeerLocation | None], dests: Sequence[memoryview], deadline: float) -> list[PageOutcome]:
        assert self.info is not None
        out = [PageOutcome.MISS] * len(locations)
        by_node: dict[str, list[int]] = {}
        for i, loc in enumerate(locations):
            if loc is not None:
                by_node.setdefault(loc.node, []).append(i)
        for node, idx in by_node.items():
            if node == self.info.id:
                for i in idx:
                    out[i] = self._read_local(locations[i], dests[i])
                continue
            with self._view_lock:
                peer = self._members.get(node)
            if peer is None:
                continue
            pages = [PageRead(loc.key, loc.generation, loc.offset, loc.length, loc.checksum, memoryview(dests[i]).cast("B"))
                     for i in idx if (loc := locations[i]) is not None]  # fmt: skip
            t0 = time.perf_counter()
            progress = ReadProgress()
            got = self._transport.read(peer.host, peer.data_port, pages, deadline, progress)
            if all(o is PageOutcome.HIT for o in got):  # one cut short (its deadline, a failure) measured the wait, not the link
                self.planner.read_measured(node, sum(p.length for p in pages), time.perf_counter() - t0)
            elif progress.cut_mid_page:
                # Cut short while a page was still arriving: the link itself is the bottleneck (a page
                # too large for it within the deadline), and what arrived until then measures it. Else
                # a link on which no read ever completes gave no sample, and every pull was let through
                # (no estimate) to lose the whole deadline, for good.
                self.planner.read_measured(node, progress.bytes, progress.last_byte_at - t0)
            for i, ok in zip(idx, got, strict=True):
                out[i] = ok
        return out

    def _promoted(self, locations: Sequence[PeerLocation | None], deadline: float) -> list[PeerLocation | None]:
        """Ask each owner to bring its non-resident pages back into its pool; their fresh records."""
        out = list(locations)
        by_node: dict[str, list[int]] = {}
        for i, loc in enumerate(locations):
            if loc is not None and not loc.resident:
                by_node.setdefault(loc.node, []).append(i)
        for node, idx in by_node.items():
            keys = [out[i].key for i in idx]  # type: ignore[union-attr]
            reply = self._call_shard(node, m.PeerPromoteRequest(keys=keys), deadline)
            for j, i in enumerate(idx):
                fresh = reply.locations[j] if reply is not None and j < len(reply.locations) else []
                out[i] = fresh[0] if fresh else None
        return out

    def promote(self, keys: Sequence[bytes], deadline: float = math.inf) -> list[list[PeerLocation]]:
        """Owner side: each page back in the pool (from disk where it left it) and published resident,
        until ``deadline`` (the caller's): a page not loaded by then stays on disk, a miss this time,
        and the publishes wait no longer than it either (one that misses an owner is owed)."""
        out: list[list[PeerLocation]] = []
        for key in keys:
            entry = self.pool.peek(key)
            if entry is not None:  # already back (a concurrent promote, or a write)
                out.append([self._record(entry)])
                continue
            if self.disk is None or time.monotonic() >= deadline:
                out.append([])
                continue
            result = self.disk.load(key, lambda buf, key=key: self.pool.put(key, buf))
            if result is None:
                self._disk_dropped([key], deadline)  # gone from disk too
                out.append([])
                continue
            entry, evicted = result
            if evicted:
                self._evicted(evicted, deadline)
            if entry is None:
                out.append([])
                continue
            with self._disk_lock:
                self._disk_only.discard(key)
            self._publish([entry], deadline)
            out.append([self._record(entry)])
        return out

    def warm(self, locations: Sequence[PeerLocation | None]) -> None:
        """Best effort, in the background: promote the pages a lookup found only on disk, so the read
        that usually follows finds them in a pool."""
        cold = [loc for loc in locations if loc is not None and not loc.resident]
        if cold and self._warmer is not None:
            try:
                self._warmer.submit(self._promoted, cold, time.monotonic() + self.config.timeout_s)
            except RuntimeError:
                pass  # closing

    def _read_local(self, loc: PeerLocation | None, dest: memoryview) -> PageOutcome:
        if loc is None:
            return PageOutcome.MISS
        entry = self.pool.acquire(loc.key, loc.generation)
        if entry is None:
            return PageOutcome.MISS
        try:
            dst = memoryview(dest).cast("B")
            if dst.nbytes != entry.length:
                return PageOutcome.MISS
            digest = copy_digest(self.pool.view(entry), dst)  # one pass: the copy and its check
        finally:
            self.pool.release(entry)
        # Checked here too: the pool is plain memory that a stray write could have hit.
        return PageOutcome.HIT if digest == loc.checksum else PageOutcome.CORRUPT

    def _metrics_state(self) -> dict[str, float]:
        s = self.pool.stats()
        disk_used, _, disk_pages = self.disk.usage() if self.disk is not None else (0, 0, 0)
        data = self._data_server
        return {
            "pool_used_bytes": s.used_bytes, "pool_capacity_bytes": s.capacity_bytes, "pool_pages": s.keys,
            "disk_used_bytes": disk_used, "disk_pages": disk_pages, "members": len(self._members),
            "directory_records": len(self.shard), "evictions": s.evictions, "promotes": self.disk.promoted if self.disk else 0,
            "served_pages": data.served_pages if data else 0, "served_bytes": data.served_bytes if data else 0,
            "refused": data.refused if data else 0, "dropped": self._transport.dropped,
            "publish_owed": len(self.owed), "publish_repaid": self.repaid,
            "unpublish_owed": len(self.unpublish_owed), "unpublish_dropped": self.unpublish_owed.dropped,
        }  # fmt: skip

    # --- the control plane, client side --------------------------------------------------------------

    def _lease_channel(self, node: str) -> RpcChannel:
        """An idle control channel to ``node`` (a new one if none is idle): calls to one node from
        several threads run side by side instead of queueing on one socket."""
        with self._channels_lock:
            idle = self._channels.setdefault(node, [])
            if idle:
                return idle.pop()
        return RpcChannel(_control_endpoint(node), self._zctx, security=self._client_security).open()

    def _return_channel(self, node: str, ch: RpcChannel, healthy: bool, timed_out: bool = False) -> None:
        """Back to the idle list after a clean call; closed (never reused) after a failed one, and when
        the node left meanwhile. A call that only timed out keeps its channel, up to UNANSWERED_KEPT in a
        row: on a long link the connection a new channel starts (TCP, then CurveZMQ's handshake: several
        round trips) may take longer than one call's timeout, and closing it threw that away, so that
        no call ever got through (a late reply is recognised by its request id and dropped)."""
        ch.unanswered = unanswered = 0 if healthy else ch.unanswered + 1
        with self._channels_lock:
            idle = self._channels.get(node)
            keep = healthy or (timed_out and unanswered < UNANSWERED_KEPT)
            if keep and idle is not None and len(idle) < CHANNELS_KEPT_PER_NODE and self.state is NodeState.RUNNING:
                idle.append(ch)
                return
        ch.close()

    def _drop_channels(self, node: str) -> None:
        with self._channels_lock:
            idle = self._channels.pop(node, [])
        for ch in idle:
            ch.close()

    def _call(self, node: str, body, timeout_s: float):
        ch = self._lease_channel(node)
        ok = timed_out = False
        try:
            t0 = time.perf_counter()
            reply = ch.call(body, timeout_s=timeout_s)
            self.planner.call_measured(node, time.perf_counter() - t0)
            ok = True
            return reply
        except KVDepotTimeout:
            timed_out = True
            raise
        finally:
            self._return_channel(node, ch, ok, timed_out)

    def _call_shard(self, owner: str, body, deadline: float | None):
        """A directory call to ``owner`` (this node: in process). None when it failed or timed out."""
        assert self.info is not None
        if owner == self.info.id:
            if isinstance(body, m.PeerPromoteRequest):  # to this node itself, within the caller's deadline
                return m.PeerResolveReply(locations=self.promote(body.keys, math.inf if deadline is None else deadline))
            return self._serve_shard(body)
        now = time.monotonic()
        if self._suspects.get(owner, 0.0) > now:
            return None
        timeout = self.config.control_timeout_s if deadline is None else min(self.config.control_timeout_s, deadline - now)
        if timeout <= 0:
            return None
        try:
            reply = self._call(owner, body, timeout)
        except KVDepotError as exc:
            self._suspect(owner, body, exc, timeout)
            return None
        self._refusing.discard((owner, type(body)))  # it takes them now (upgraded, under the same id)
        return reply

    # --- the control plane, server side --------------------------------------------------------------

    def _handlers(self) -> list[HandlerSpec]:
        sync = HandlerMode.SYNC
        return [
            HandlerSpec(RequestType.PING, lambda c: Reply(m.PingReply(ok=True)), sync),
            HandlerSpec(RequestType.PEER_JOIN, self._on_hello, sync),
            HandlerSpec(RequestType.PEER_HEARTBEAT, self._on_hello, sync),
            HandlerSpec(RequestType.PEER_PUBLISH, lambda c: Reply(self._serve_shard(c.body)), sync),
            HandlerSpec(RequestType.PEER_UNPUBLISH, lambda c: Reply(self._serve_shard(c.body)), sync),
            HandlerSpec(RequestType.PEER_RESOLVE, lambda c: Reply(self._serve_shard(c.body)), sync),
            HandlerSpec(RequestType.PEER_STATUS, self._on_status, sync),
            HandlerSpec(RequestType.PEER_PROMOTE, lambda c: Reply(m.PeerResolveReply(locations=self.promote(c.body.keys, c.deadline))),
                        HandlerMode.BLOCKING),  # fmt: skip
        ]

    def _serve_shard(self, body):
        if isinstance(body, m.PeerPublishRequest):
            for rec in body.records:
                _check_key(rec.key)
            self._note_legacy(body.records)
            kept = self.shard.publish(body.records)
            # Records refused as an earlier run's: say which run this shard knows, so that a node no
            # master's table tells (the only master, restarted) learns that its run is behind (_run_after).
            return m.PeerCountReply(count=kept, later_run=self.shard.later_run(body.records) if kept < len(body.records) else 0)
        if isinstance(body, m.PeerUnpublishRequest):
            return m.PeerCountReply(count=self.shard.unpublish(body.keys, body.node, body.generations))
        if isinstance(body, m.PeerResolveRequest):
            if body.own_pages:
                return m.PeerResolveReply(locations=self.own_records(body.keys))
            return m.PeerResolveReply(locations=self.shard.resolve(body.keys))
        raise TypeError(f"not a directory request: {type(body).__name__}")

    def _note_legacy(self, records: Sequence[PeerLocation]) -> None:
        """Say once per node that it runs a version from before directory records carried an incarnation
        (its records are served, but it refuses the records this version sends: see ``directory.py``)."""
        for rec in records:
            if rec.incarnation == LEGACY_RUN and rec.node not in self._legacy_nodes:
                self._legacy_nodes.add(rec.node)
                log.warning("peer %s: node %s runs a kvdepot from before 2026-11-27 (its directory records carry no incarnation): "
                            "its pages are served, but it cannot decode this version's directory records (it refuses the field "
                            "'incarnation'), so it finds no page of a newer node; upgrade it", self.info.id if self.info else "?", rec.node)  # fmt: skip

    def _on_hello(self, call: Call) -> Reply:
        assert self._table is not None
        if self.info is not None and call.body.node.id == self.info.id:
            self._heard_self = True  # see _tick: the configured head's address is this node's own
        if self._table.heard(call.body.node):
            self._heartbeat.kick()  # a newcomer: take the new membership now, not a heartbeat later
        if self._is_master():
            return Reply(self._table.view())
        return Reply(self._cached_view())

    def _on_status(self, call: Call) -> Reply:
        assert self.info is not None
        s = self.pool.stats()
        return Reply(m.PeerStatusReply(node=self.info, members=self.members(), masters=self.masters(), pool_used_bytes=s.used_bytes,
                                       pool_capacity_bytes=s.capacity_bytes, pool_keys=s.keys, directory_records=len(self.shard)))  # fmt: skip

    # --- discovery -----------------------------------------------------------------------------------

    def _is_master(self) -> bool:
        assert self.info is not None
        with self._view_lock:
            return self.info.id in self._masters or self.info.id == self.head

    def _cached_view(self) -> PeerMembershipReply:
        with self._view_lock:
            return PeerMembershipReply(members=ordered(self._members.values(), self.head), masters=list(self._masters), head=self.head)

    def _safe_tick(self) -> None:
        try:
            self._tick()
        except Exception:  # the next tick tries again; say why this one failed
            log.exception("peer %s: heartbeat round failed", self.info.id if self.info else "?")

    def _tick(self) -> None:
        """One heartbeat round: tell every master we are here, and take the membership they know."""
        assert self.info is not None and self._table is not None
        if self.state is not NodeState.RUNNING:
            return
        self._table.heard(self.info)
        gone = self._table.expire()
        if gone:
            log.info("peer %s: %s silent past the TTL", self.info.id, ", ".join(gone))
        targets = [t for t in dict.fromkeys(self.masters() + self.config.bootstrap) if t != self.info.id]
        configured_head = (self.config.bootstrap or [""])[0]
        body = m.PeerHeartbeatRequest(node=self.info)
        views: list[PeerMembershipReply] = []
        answered_sent = None  # when the first heartbeat a master answered this round was sent
        if not targets:
            self._last_answered_sent = time.monotonic()  # the only master it knows is itself: never away from one
        elif self._is_master() and len(self._table.view().members) > 1:
            # A master that other nodes heartbeated within the TTL (its table, just expired, still holds
            # them) was not away, whether or not another master answers it (all of those may be dead).
            answered_sent = time.monotonic()
        for target in targets:
            sent = time.monotonic()
            self._heard_self = False
            try:
                view = self._call(target, body, min(self.config.control_timeout_s, self.config.heartbeat_interval_s))
            except KVDepotError:
                continue
            if target == configured_head and self._heard_self and self.head != self.info.id:
                # The head's address, given by a name ("the head itself with its own"), is this node:
                # it is the head, and its answers name it by its id (which the others then adopt).
                self._adopt_head(self.info.id)
            elif target == configured_head and view.head and view.head != self.head:
                self._adopt_head(view.head)  # the head by another name, or moved (a new address behind that name)
            views.append(view)
            if answered_sent is None:
                answered_sent = sent
        # No master can have heard this node for longer than this between two answered heartbeats:
        # past the TTL, some may have expired it (a round slowed by a dead target never gets here).
        # Before its first answer no master had heard it at all, so none can have expired it.
        if answered_sent is not None:
            if self._joined.is_set() and answered_sent - self._last_answered_sent > self.config.member_ttl_s:
                self._renew_run()
            self._last_answered_sent = answered_sent
        # A node that has not joined yet is a master only by its own first view (itself alone), unless it
        # is the head: a bootstrap node that is no master answers with its cached view, not a table, which
        # a master ignores, and the newcomer kept its own table (itself) for good. It takes that view.
        joining = not self._joined.is_set() and self.head != self.info.id and bool(views) and not any(is_table(v) for v in views)
        if self._is_master() and not joining:
            for other in views:
                self._table.adopt(other)
            view = self._table.view()  # settling: this node's own table, too, may lack live members
        elif views:
            tables = [v for v in views if is_table(v)]
            if tables:
                self._silent_masters.clear()  # masters answer: their tables say who is alive
                view = merged(tables, self.head, self.config.max_masters)
            else:
                view = views[0]
                if self._silent_masters:
                    # The nodes that are masters now to this node have not all found the old masters
                    # gone yet (each does within a TTL) and answer with their cached views, which name
                    # them: taken as they are, those dead masters came back, to be dropped a TTL later.
                    kept = [n for n in view.members if self._silent_masters.get(n.id, -1) < n.incarnation]
                    view = msgspec.structs.replace(view, members=kept)
        else:
            if targets and self._replace_silent_masters(body):
                return
            if targets and not self._cut_off:
                log.warning("peer %s: no master answers; serving with the membership it knew", self.info.id)
                self._cut_off = True
            return  # keep the cached membership
        rejoined = False
        if views:
            self._joined.set()
            # Back from a partition (no master answered), or from a stall this node could not see itself
            # (SIGSTOP, a VM freeze, a long pause: no round ran at all): the masters may have expired it
            # and the others dropped its records, although its own view may not have changed at all.
            # Publish everything again. A master last heard us a reply's flight before we last heard it,
            # so a silence one interval short of the TTL already counts.
            heard = time.monotonic()
            rejoined = self._cut_off or heard - self._last_heard > self.config.member_ttl_s - self.config.heartbeat_interval_s
            self._last_heard = heard
        self._cut_off = False
        self._apply(view, republish=rejoined)
        self._repay()

    def _replace_silent_masters(self, body: m.PeerHeartbeatRequest) -> bool:
        """No master has answered this node for a TTL: either it is cut off (keep the membership it knew),
        or the masters are gone. They go one after another in a scale-down or a rolling restart, each
        before the others expired the one before: then no live master is left to expire them and promote
        the next nodes, and every node kept the dead masters, their records and their share of every
        key's owners for good. So every other member is asked at once; if one answers, this node is not
        cut off and the masters are gone: they leave its membership, and the next nodes in the order
        are the masters (each live node comes to the same conclusion within a TTL, and a node promoted
        so starts settling: ``_apply``). True when they were replaced."""
        assert self.info is not None
        now = time.monotonic()
        if now - self._last_heard <= self.config.member_ttl_s:
            return False
        with self._view_lock:
            silent = [nid for nid in self._masters if nid != self.info.id]
            others = [nid for nid in self._members if nid != self.info.id and nid not in self._masters]
        if not silent or not others:
            return False
        deadline = now + min(self.config.control_timeout_s, self.config.heartbeat_interval_s)
        started = []
        try:
            for nid in others:
                begun = self._begin(nid, body, deadline)
                if begun is not None:
                    started.append((nid, *begun))
            answered = False
            while started:
                nid, ch, pending, t0, timeout = started.pop(0)
                answered = self._collect(nid, ch, pending, t0, timeout, sample=False) is not None or answered
        finally:
            for nid, ch, pending, _, _ in started:  # only on an exception: their replies are never read
                pending.abandon()
                self._return_channel(nid, ch, False)
        if not answered:
            return False
        log.warning("peer %s: no master (%s) answered for %.1f s while other members do: they are gone, the next nodes are the masters",
                    self.info.id, ", ".join(silent), now - self._last_heard)  # fmt: skip
        # Not away: other members answer, and no master was left to expire this node.
        self._last_heard = self._last_answered_sent = time.monotonic()
        self._cut_off = False
        with self._view_lock:
            members = [n for nid, n in self._members.items() if nid not in silent]
            self._silent_masters.update((nid, self._members[nid].incarnation) for nid in silent)
        self._apply(PeerMembershipReply(members=members, masters=[], head=self.head))
        return True

    def _adopt_head(self, head: str) -> None:
        """The head was configured by another name than its node id (a host name, a Service's address),
        or moved behind that name: the node that answers there names the head, and that id is the head
        from now on (the configured address is still heartbeated, so a head that moves is followed).
        Else this node ordered the members with a head that is none of them, and chose other masters
        than the nodes that knew the head's id."""
        assert self._table is not None
        log.info("peer %s: the head, configured as %s, is node %s", self.info.id if self.info else "?", self.head, head)
        with self._view_lock:
            self.head = self._table.head = head

    def _apply(self, view: PeerMembershipReply, republish: bool = False) -> None:
        """Take a membership view; on a change, rebuild the ring and re-shard the directory. A settling
        view only adds: members it lacks stay (as their newest run), and no node's records go."""
        assert self.info is not None and self._table is not None
        members = {n.id: n for n in view.members}
        mine = members.get(self.info.id)
        if mine is not None and mine.incarnation > self.info.incarnation:
            self._run_after(mine.incarnation)
        members[self.info.id] = self.info  # whatever a stale master says, this node is alive
        with self._view_lock:
            before = dict(self._members)
            if view.settling:
                for nid, known in before.items():
                    if nid not in members or members[nid].incarnation < known.incarnation:
                        members[nid] = known
            masters = masters_of(members.values(), self.head, self.config.max_masters)
            was_master = self.info.id in self._masters
            self._members = members
            self._masters = masters
        if self.info.id in masters and not was_master:
            if is_table(view):
                self._table.adopt(view)  # promoted: start from what the masters knew
            else:
                # Promoted on no master's word (the masters went silent, or none has answered yet): this
                # table holds only who happened to heartbeat this node. Settling, it adds members and
                # drops none, until every live node has had a TTL to heartbeat it.
                self._table.resettle()
        if {nid: n.incarnation for nid, n in members.items()} == {nid: n.incarnation for nid, n in before.items()}:
            if republish:
                self._republish()
            return
        self._ring = HashRing(members, self.config.vnodes, self.config.directory_replicas)
        if not view.settling:  # (settling, no one left: what keep_nodes would drop is a node not yet heard of)
            self.shard.keep_nodes(set(members))
        for nid, old in before.items():
            if nid not in members or members[nid].incarnation != old.incarnation:  # left, or restarted
                self._suspects.pop(nid, None)
                self._drop_channels(nid)
                self._transport.forget(old.host, old.data_port)
                if nid not in members:
                    self.planner.forget(nid)
                if nid in members:
                    # Restarted within the TTL (same id): its earlier run's records name pages its new
                    # pool never held, which nothing would ever unpublish; what it still has (its disk)
                    # it publishes again, under its new incarnation, and those stay.
                    self.shard.drop_incarnations_before(nid, members[nid].incarnation)
        if before:
            log.info("peer %s: membership now %s", self.info.id, sorted(members))
        self._republish()
        me = self.info.id
        self.shard.keep_keys(lambda key: me in self._ring.owners(key, self.config.directory_replicas))

    def _run_after(self, earlier: int) -> None:
        """The cluster knows a run of this node's id newer than this one: the wall clock stepped back
        across a restart. Every shard refuses records of a run older than one it knows of (they would
        name pages of a dead pool), so this run's records were refused, and would be for good. Take a
        later incarnation; the membership change that follows publishes every page again under it."""
        assert self.info is not None and self._table is not None
        log.warning("peer %s: the cluster knows a later run of this node (the clock stepped back %.1f s across a restart?): "
                    "taking a run after it and publishing again", self.info.id, (earlier - self.info.incarnation) / 1e9)  # fmt: skip
        self.info = msgspec.structs.replace(self.info, incarnation=earlier + 1)
        self._table.heard(self.info)

    def _renew_run(self) -> None:
        """Back after about a TTL with no master's answer (a partition, a stall): the others have likely
        expired this node and dropped it from their rings, so the unpublishes of pages they let go
        meanwhile never came here, and nothing would ever remove those records from this shard (its own
        view may not have changed at all). Drop every other node's record and go on as a new run of this
        node, announced from the next heartbeat on: every node that sees the new run publishes all its
        pages again (``_apply``), after this drop, so this shard ends up with what they hold, and a node
        that had not expired this one is no exception."""
        assert self.info is not None and self._table is not None
        self.info = msgspec.structs.replace(self.info, incarnation=max(_new_incarnation(), self.info.incarnation + 1))
        self._table.heard(self.info)
        dropped = self.shard.drop_other_nodes(self.info.id)
        self._heartbeat.kick()  # say so now, not a heartbeat later
        log.warning("peer %s: back after no master answered for about a TTL: a new run; %d records of other nodes dropped "
                    "(they publish again)", self.info.id, dropped)  # fmt: skip

    def _republish(self) -> None:
        """Publish every page this node holds to its owners under the current ring (those only on its
        disk as non-resident)."""
        entries = self.pool.entries()
        if entries:
            self._publish(entries)
            self.republished += len(entries)
        if self.disk is not None:
            with self._disk_lock:
                disk_only = list(self._disk_only)
            records = [self._disk_record(key) for key in disk_only]
            self._publish_non_resident([r for r in records if r is not None])

    def _repay(self) -> None:
        """Send again what some owner missed (``owed.py``): the unpublishes, then each owed key's record
        as the page is now, to its owners under the current ring; a key gone meanwhile is dropped, one
        that fails again is owed again. Each bounded by one heartbeat interval, so a dead owner cannot
        hold up the heartbeat."""
        self._repay_unpublishes(time.monotonic() + self.config.heartbeat_interval_s)
        everything, keys = self.owed.take()
        if everything:
            self._republish()
            return
        if not keys:
            return
        records = [rec for found in self.own_records(list(keys)) for rec in found]
        self._publish_records(records, time.monotonic() + self.config.heartbeat_interval_s)
        self.repaid += len(records)

    def _repay_unpublishes(self, deadline: float) -> None:
        """Each owed unpublish to the owner that missed it (the stale record is there, and only there:
        other owners got records only of pages held); an owner that left took its shard along."""
        assert self.info is not None
        owed = self.unpublish_owed.take()
        with self._view_lock:
            live = set(self._members)
        parts = {owner: [m.PeerUnpublishRequest(keys=[k for k, _ in part], node=self.info.id, generations=[g for _, g in part])
                         for part in _slices(items, lambda item: len(item[0]) + _UNPUBLISH_ITEM_BYTES)]
                 for owner, items in owed.items() if owner in live}  # fmt: skip
        for owner, req, reply in self._call_shards(parts, deadline):
            if reply is None:
                self.unpublish_owed.owe(owner, list(zip(req.keys, req.generations, strict=True)))

    def _disk_record(self, key: bytes) -> PeerLocation | None:
        assert self.info is not None and self.disk is not None
        size = self.disk.size_of(key)
        if size is None:
            return None
        # A fresh generation, never 0: a node that restarts within the member TTL keeps its id, and the
        # owners still hold its earlier incarnation's records of these keys, which a lower one would not replace.
        return PeerLocation(key=key, node=self.info.id, offset=0, length=size, generation=self.pool.fresh_generation(), checksum=b"",
                            resident=False, incarnation=self.info.incarnation)  # fmt: skip


_RECORD_BYTES = 128  # a PeerLocation's encoding besides its key, node and checksum (field names, integers), at most
_UNPUBLISH_ITEM_BYTES = 16  # an unpublished key's encoding besides the key (its length, its generation), at most


def _record_bytes(rec: PeerLocation) -> int:
    return len(rec.key) + len(rec.node) + len(rec.checksum) + _RECORD_BYTES


def _slices(items: Sequence[T], size_of: Callable[[T], int]) -> Iterator[Sequence[T]]:
    """``items`` in runs whose request body stays within DIRECTORY_BODY_BYTES (and half the codec's
    limit), each run at least one item."""
    budget = min(DIRECTORY_BODY_BYTES, codec.MAX_BODY_BYTES // 2)
    start = used = 0
    for i, item in enumerate(items):
        size = size_of(item)
        if used + size > budget and i > start:
            yield items[start:i]
            start, used = i, 0
        used += size
    if start < len(items):
        yield items[start:]


def _check_keys(keys: Sequence[bytes]) -> None:
    """Each key is 1 to ``MAX_KEY_BYTES`` bytes; one loop, no call per key (a lookup checks every key it asks)."""
    for key in keys:
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a page key is 1 to {MAX_KEY_BYTES} bytes")


def _check_key(key: bytes) -> None:
    _check_keys((key,))
