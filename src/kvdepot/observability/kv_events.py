"""KV events for cache-aware routers, in vLLM's own wire format (``vllm/distributed/kv_events.py``).

A router that already reads vLLM's KV events (llm-d's indexer, Dynamo, SGLang's router) reads
kvdepot's the same way:

- PUB socket (``--kv-events-endpoint``, bound; or connected to a router that binds its SUB there, with
  ``--kv-events-connect``): multipart ``[topic, sequence (8 bytes, big-endian), payload]``,
  the payload a msgpack ``KVEventBatch`` ``[ts, [events...], data_parallel_rank]`` whose events are
  tagged maps: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
- ROUTER socket (``--kv-events-replay-endpoint``): a subscriber sends ``[b"", start_seq]`` (8 bytes,
  big-endian), or ``[b"", start_seq, topic]``, and gets the kept batches of one topic from that
  number as ``[b"", topic, seq, payload]``, then ``[b"", b"", -1, b""]``. The last
  ``--kv-events-buffer`` batches (of all topics) are kept. Each topic has its own sequence, so a
  replay is one topic's: the one named, or, for vLLM's request (no topic: a vLLM publisher has one),
  the one topic this server has published on. With several, kvdepot cannot tell which one the
  subscriber follows, and another model's blocks would be phantom hits in its index (chunk hashes do
  not name the model): it answers the end marker alone and logs a warning.

What kvdepot puts in them:

- The topic is ``--kv-events-topic`` made for the batch's model: a template of ``{model}`` and
  ``{node}`` (this server's ``HOST:PORT``), by default ``{model}``: the model name (a router
  subscribes to one model's prefix, or to ``b""`` for all). llm-d's indexer subscribes to ``kv@`` and
  reads ``kv@<pod>@<model>``: ``kv@{node}@{model}``, or the pod's IP in place of ``{node}``. A batch
  holds one model's events. Each topic has its own sequence, gapless, so a subscriber of one
  topic sees a gap only where it lost a batch; it never goes back: a topic's first batch is numbered
  one past the server's start time in microseconds (the start-up batch has that number, and is not
  kept for replay), so a restarted server never reuses a number.
- ``block_hashes`` are kvdepot's chunk hashes (the chain the client computed: sha256 by default, so
  equal to SGLang HiCache's page keys when a chunk is a page), ``block_size`` the chunk's tokens,
  ``parent_block_hash`` None. ``token_ids`` are the blocks' tokens when the client that stored them
  opted in to sending them (``ClientOptions.send_token_ids``; the vLLM connector's
  ``kv_events_token_ids``), else empty: the server needs only the hashes (clients hash).
  ``extra_keys`` carries the ``cache_salt`` as ``(salt,)`` per block when there is one.
- ``medium``: ``CPU`` for L1; each L2 tier by its kind in capitals (``FS``, ``VALKEY``, ``S3``,
  ``MEMORY``, ``PEER``), or by its name in capitals when two tiers share a kind.
- A store is sent once the object is really in place: committed in L1, acknowledged by the tier. A
  removal for every way kvdepot sees an object leave: L1 eviction, clear, quota, discard (skip_l1
  placement); a tier's own LRU (fs, memory), a tier's clear, a corrupt object found in a tier. A
  tier's clear is a ``BlockRemoved`` of every block announced in that medium (the publisher keeps
  what it announced per L2 medium, rank 0's only: about 190 bytes a block). What a tier's own server
  drops by itself (a Valkey TTL or maxmemory eviction, an S3 lifecycle rule, a peer pool's LRU) is
  not seen, so that set is bounded: past ``MAX_TIER_BLOCKS`` a medium's least recently announced
  block is withdrawn with a ``BlockRemoved``. A router then misses a block the tier may still hold
  (safe), and never keeps one for ever that the tier dropped unseen as long as kvdepot tracked it.
- Only rank 0's objects are sent: one block per tensor-parallel group, not one per rank.
- The stream is made from the event bus's records, and a full bus drops records: a lost removal
  would leave a router a block kvdepot no longer holds, for ever. So after a drop (the bus hands a
  ``Dropped`` behind every record published before it) every topic published on gets an
  ``AllBlocksCleared`` (``kvdepot_kv_event_resets``): a router then misses what kvdepot still holds
  until it is stored again (a miss is safe), never finds a block that is gone (a phantom hit is not).
- Each server starts with an ``AllBlocksCleared`` (its L1 is empty; what its tiers kept from an
  earlier run is announced again as it is loaded back), on the topic's part before ``{model}`` (the
  empty topic by default), so a subscriber of all this server's topics learns of the restart at once;
  and the first batch on each topic begins with one, so a subscriber of that topic alone (a model's
  prefix, a topic filter) drops what it kept from the server's earlier life too.
"""

from __future__ import annotations

import array
import itertools
import logging
import string
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zmq

from kvdepot.config import is_ipv6_endpoint
from kvdepot.events import ChunkTokens, EventKind, L1Changed, NamespaceSeen, ObjectEvent, TierCleared, TierRemoved, TierStored
from kvdepot.observability.bus import Dropped
from kvdepot.types import NAMESPACE_BYTES, ObjectKey

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
L1_MEDIUM = "CPU"
MAX_NAMESPACES = 65536  # namespaces known, the least recently used forgotten first
MAX_TOPICS = 65536  # topics whose sequence is kept; the least recently used is cleared and forgotten first
REPLAY_WARN_S = 60.0  # a replay request that names no topic, on a server of several, is logged this often
MAX_TOPIC_BYTES = 4096  # a replay request's topic frame
RESET_LOG_S = 60.0  # a reset is logged at most this often (an overloaded bus drops on every round)
MALFORMED_LOG_FIRST = 5  # malformed replay requests logged one by one; past them...
MALFORMED_LOG_EVERY_S = 60.0  # ...one line at most this often, with how many came since
# Blocks remembered as announced per L2 medium (for its clear; ~190 bytes each, so ~48 MiB a medium at
# most). Past it the least recently announced is withdrawn (BlockRemoved): tiers whose own drops kvdepot
# never hears of (Valkey TTL, S3 lifecycle, a peer's pool) would otherwise grow it for the server's life.
MAX_TIER_BLOCKS = 1 << 18
MAX_TOKEN_CHUNKS = 8192  # chunks whose token ids are kept for their BlockStored (1 KiB each at 256 tokens)
TOPIC_FIELDS = ("model", "node")
MAX_TOPICS_CACHED = 4096  # models whose topic is kept made; past it the cache starts again


# --- the wire format (vLLM's field names and order; our own structs) ---------------------------------


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# --- the publisher --------------------------------------------------------------------------------


def _enable_ipv6(sock: zmq.Socket, endpoint: str) -> None:
    """``tcp://[::1]:5557``: ZeroMQ refuses an IPv6 address ("No such device") unless ZMQ_IPV6 is set
    before bind or connect (only for an IPv6 endpoint: with it, ``*`` would bind ``::``, not ``0.0.0.0``)."""
    if is_ipv6_endpoint(endpoint):
        sock.setsockopt(zmq.IPV6, 1)


class _LogLimit:
    """A warning any peer can cause (the replay socket has no authentication), logged the first
    ``first`` times, then at most once every ``every_s`` as a count: one line per request let a
    misbehaving or hostile peer fill the log, and the dashboard's recent warnings, with nothing else."""

    def __init__(self, first: int, every_s: float, summary: str, clock: Callable[[], float] = time.monotonic) -> None:
        """``summary``: the count's line, formatted with (unlogged since the last line, all so far)."""
        self._first, self._every, self._summary, self._clock = first, every_s, summary, clock
        self.total = 0  # every occurrence, logged or not
        self._unlogged = 0  # since the last line
        self._next = 0.0  # when the next summary may be logged

    def hit(self, message: str, *args: object) -> None:
        """One occurrence: logged as it is while under ``first``, else counted for the next summary."""
        self.total += 1
        if self.total <= self._first:
            quiet = " (more are counted, and logged once every %.0f s)" if self.total == self._first else ""
            log.warning(message + quiet, *args, *((self._every,) if quiet else ()))
            self._next = self._clock() + self._every
            return
        self._unlogged += 1
        self.flush()

    def flush(self) -> None:
        """Log how many went unlogged, if any did and the interval has passed."""
        if not self._unlogged or self._clock() < self._next:
            return
        log.warning(self._summary, self._unlogged, self.total)
        self._unlogged = 0
        self._next = self._clock() + self._every


class _Generations:
    """Puts L1's batches back in order. Two threads' batches may reach the bus in either order (the
    object table hands them out after its lock), so an object's removal can arrive before its store;
    each event carries the object's generation, and an event older than what was seen for its key, or
    a store whose removal was seen already, is dropped. Removals are remembered (bounded) for that."""

    def __init__(self, removed_kept: int = 1 << 18) -> None:
        self._present: dict[bytes, int] = {}  # key -> generation of the object L1 holds under it
        self._removed: OrderedDict[tuple[bytes, int], None] = OrderedDict()
        self._removed_kept = removed_kept

    def forget_present(self) -> None:
        """After a drop: a key whose removal was lost would stay here for the server's life. What was
        announced is forgotten anyway (AllBlocksCleared); removals are kept, so a store that comes late
        for an object already removed is still passed over."""
        self._present.clear()

    def newest(self, o: ObjectEvent) -> bool:
        key = bytes(o.key)
        current = self._present.get(key)
        if o.kind is EventKind.STORED:
            if (current is not None and current > o.generation) or (key, o.generation) in self._removed:
                return False
            self._present[key] = o.generation
            return True
        if current is not None and current > o.generation:
            return False  # an older object's removal, after its successor's store
        self._present.pop(key, None)
        self._removed[(key, o.generation)] = None
        if len(self._removed) > self._removed_kept:
            self._removed.popitem(last=False)
        return True




def topic_template_problem(template: str) -> str:
    """Why ``template`` is no topic template, or "": its only placeholders are ``{model}`` and
    ``{node}``, bare (no format spec or conversion), and ``{{``/``}}`` are literal braces."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as exc:
        return str(exc)
    for name, spec, conv in fields:
        if name not in TOPIC_FIELDS:
            return f"unknown placeholder {{{name}}}: use {{model}} and {{node}}"
        if spec or conv:
            return f"{{{name}}} takes no format spec or conversion"
    return ""


def tier_media(tiers: Sequence[tuple[str, str]]) -> dict[str, str]:
    """Each tier's ``medium`` by tier name: its kind in capitals, or its name where kinds repeat."""
    kinds = [kind for _, kind in tiers]
    return {name: (kind if kinds.count(kind) == 1 else name).upper() for name, kind in tiers}


class KVEventsPublisher:
    """A bus subscriber (``handle`` runs on the drain thread, the only user of the PUB socket); replay
    requests are answered on a thread of their own."""

    def __init__(
        self, endpoint: str, replay_endpoint: str = "", buffer: int = 10000, metrics: Any = None, topic: str = "{model}", node: str = "",
        connect: bool = False,
    ) -> None:
        """``topic``: the template of each model's topic (``topic_template_problem`` says why one is
        refused: a ValueError); ``node``: what ``{node}`` stands for, this server's ``HOST:PORT``;
        ``connect``: the PUB socket connects to ``endpoint`` (a router's SUB binds there) instead of
        binding it."""
        problem = topic_template_problem(topic)
        if problem:
            raise ValueError(problem)
        self.endpoint = endpoint
        self.connect = connect
        self._topic_template = topic
        self._node = node
        self._topic_of: dict[str, bytes] = {}  # model -> its topic
        # topic -> its last sequence number, least recently used first: the topics published on (each
        # began with AllBlocksCleared); the replay thread reads it under _buffer_lock
        self._last_seq: OrderedDict[bytes, int] = OrderedDict()
        self._forgot_topic = False  # a topic was forgotten: one seen anew starts at the time, not the start
        self.replay_endpoint = replay_endpoint
        self._media: dict[str, str] = {}
        self._metrics = metrics
        self._namespaces: OrderedDict[bytes, NamespaceSeen] = OrderedDict()  # least recently used first
        self._l1 = _Generations()
        # key -> its topic: rank 0's blocks announced in L1 (bounded by what L1 holds), so that their removal
        # is told even once their namespace was forgotten (a skipped removal is a phantom block for ever)
        self._in_l1: dict[bytes, bytes] = {}
        # medium -> key -> its topic: rank 0's blocks announced there, least recently announced first
        self._in_tier: dict[str, OrderedDict[bytes, bytes]] = {}
        self._tokens: OrderedDict[bytes, bytes] = OrderedDict()  # key -> its chunk's token ids (uint32), newest last
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)
        self._buffer_lock = threading.Lock()
        self._start_seq = time.time_ns() // 1000
        self._replay_warned = 0.0
        self._malformed = _LogLimit(MALFORMED_LOG_FIRST, MALFORMED_LOG_EVERY_S, "ignored %d more malformed KV-events replay requests (%d in all)")
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._stop = threading.Event()
        self._replay_thread: threading.Thread | None = None
        self.unknown_namespace = 0  # events for objects whose namespace no context told us (skipped)
        self.resets = 0  # AllBlocksCleared on every topic, after the bus dropped records
        self._reset_logged = 0.0

    def bind(self) -> None:
        """Bind both sockets (the composition root binds every endpoint before it reserves memory); with
        ``connect``, the PUB socket connects instead: ZeroMQ retries in the background until the router
        is up, and again each time it restarts, so a router that is down delays nothing here."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            _enable_ipv6(self._pub, self.endpoint)
            if self.connect:
                self._pub.connect(self.endpoint)
            else:
                self._pub.bind(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what a subscriber's queue cannot take: room for a whole replay and its end
                # marker, or a subscriber busy when it starts gets a gappy replay and waits for an end for ever.
                self._replay.setsockopt(zmq.SNDHWM, (self._buffer.maxlen or 0) + 16)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_TOPIC_BYTES)  # a request is an empty frame, 8 bytes, a topic
                _enable_ipv6(self._replay, self.replay_endpoint)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(exc.errno, f"cannot {'connect to' if self.connect else 'bind'} {exc.strerror}") from None

    @property
    def bound_endpoints(self) -> tuple[str, str]:
        """(PUB, ROUTER) as bound (a port 0 resolved)."""
        pub = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if self._pub is not None else ""
        rep = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else ""
        return pub, rep

    def start(self) -> None:
        """Before the bus starts (this thread is the PUB socket's only user until then): the first batch,
        on the topics' common prefix so every subscriber of this server's topics gets it, says this
        server holds nothing yet."""
        if self._pub is not None:
            events = [AllBlocksCleared()]
            self._put(self._startup_topic(), self._start_seq, self._encode(KVEventBatch(time.time(), events)), events)
        if self._replay is not None:
            self._replay_thread = threading.Thread(target=self._serve_replays, name="kvdepot-kv-events-replay", daemon=True)
            self._replay_thread.start()

    def name_tiers(self, tiers: Sequence[tuple[str, str]]) -> None:
        """(name, kind) of the server's tiers, before the bus starts: each one's ``medium``."""
        self._media = tier_media(tiers)

    def close(self) -> None:
        """Idempotent: a server that fails while starting closes what it bound, then everything."""
        if self._ctx.closed:
            return
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    # --- the bus's events -----------------------------------------------------------------------------

    KINDS = (NamespaceSeen, ChunkTokens, L1Changed, TierStored, TierRemoved, TierCleared, Dropped)

    def handle(self, events: list) -> None:
        by_topic: dict[bytes, list] = {}
        for e in events:
            if isinstance(e, Dropped):
                self._flush(by_topic)  # what came before the drop goes first: the reset must follow it
                by_topic = {}
                self._reset(e)
            elif isinstance(e, NamespaceSeen):
                self._learn(e)
            elif isinstance(e, ChunkTokens):
                self._remember_tokens(e)
            elif isinstance(e, L1Changed):
                fresh = [o for o in e.events if self._l1.newest(o)]
                for stored, run in itertools.groupby(fresh, key=lambda o: o.kind is EventKind.STORED):
                    (self._l1_stored if stored else self._l1_removed)(by_topic, [o.key for o in run])
            elif isinstance(e, TierStored):
                self._tier_stored(by_topic, e.keys, self._medium(e.tier, e.kind))
            elif isinstance(e, TierRemoved):
                medium = self._medium(e.tier, e.kind)
                announced = self._in_tier.get(medium, {})
                withdrawn, others = [], []
                for key in e.keys:
                    topic = announced.pop(bytes(key), None)
                    if topic is None:
                        others.append(key)
                    else:
                        withdrawn.append((bytes(key), topic))
                self._withdraw(by_topic, withdrawn, medium)  # by the topic announced: its namespace may be forgotten
                self._removed(by_topic, others, medium)
            elif isinstance(e, TierCleared):
                medium = self._medium(e.tier, e.kind)
                self._withdraw(by_topic, self._in_tier.pop(medium, {}).items(), medium)
        self._flush(by_topic)

    def _medium(self, tier: str, kind: str) -> str:
        return self._media.get(tier, kind.upper())

    def _reset(self, dropped: Dropped) -> None:
        """The bus dropped records, maybe a removal: every topic published on is told to forget all
        (what kvdepot holds comes back as it is stored again), and nothing announced is remembered."""
        for topic in sorted(self._last_seq):
            self._send(topic, [AllBlocksCleared()])
        self._in_tier.clear()
        self._in_l1.clear()
        self._l1.forget_present()
        self.resets += 1
        if self._metrics is not None:
            self._metrics.kv_event_resets.inc()
        now = time.monotonic()
        if now - self._reset_logged >= RESET_LOG_S:
            self._reset_logged = now
            log.warning("the event bus dropped records (%d so far; --event-queue-size): KV events reset every topic with "
                        "AllBlocksCleared (%d resets so far)", dropped.total, self.resets)  # fmt: skip

    def _learn(self, seen: NamespaceSeen) -> None:
        """Known namespaces are a bounded LRU: one seen again, or named by an event, is the newest."""
        if seen.namespace in self._namespaces:
            self._namespaces.move_to_end(seen.namespace)
            return
        if len(self._namespaces) >= MAX_NAMESPACES:
            self._namespaces.popitem(last=False)
        self._namespaces[seen.namespace] = seen

    def _blocks(self, keys: Iterable[ObjectKey]) -> dict[bytes, tuple[NamespaceSeen, list[bytes]]]:
        """Rank-0 keys grouped by namespace, in order."""
        out: dict[bytes, tuple[NamespaceSeen, list[bytes]]] = {}
        other_ranks: set[bytes] = set()
        unknown = 0
        for key in keys:
            ns_digest = bytes(key[:NAMESPACE_BYTES])
            group = out.get(ns_digest)
            if group is None:
                if ns_digest in other_ranks:
                    continue
                ns = self._namespaces.get(ns_digest)
                if ns is None:
                    unknown += 1
                    continue
                self._namespaces.move_to_end(ns_digest)  # in use: the busiest is the last forgotten
                if ns.rank != 0:
                    other_ranks.add(ns_digest)
                    continue
                group = out[ns_digest] = (ns, [])
            group[1].append(bytes(key[NAMESPACE_BYTES:]))
        if unknown:
            self.unknown_namespace += unknown
            if self._metrics is not None:
                self._metrics.kv_event_unknown_namespace.inc(unknown)
        return out

    def _startup_topic(self) -> bytes:
        """The template made up to its ``{model}``: what every topic of this server begins with."""
        out = []
        for literal, name, _, _ in string.Formatter().parse(self._topic_template):
            out.append(literal)
            if name == "model":
                break
            if name == "node":
                out.append(self._node)
        return "".join(out).encode()

    def _topic(self, model: str) -> bytes:
        topic = self._topic_of.get(model)
        if topic is None:
            if len(self._topic_of) >= MAX_TOPICS_CACHED:
                self._topic_of.clear()
            topic = self._topic_of[model] = self._topic_template.format(model=model, node=self._node).encode()
        return topic

    def _remember_tokens(self, e: ChunkTokens) -> None:
        step = e.chunk_tokens * 4
        for i, key in enumerate(e.keys):
            self._tokens[bytes(key)] = e.token_ids[i * step : (i + 1) * step]
            self._tokens.move_to_end(bytes(key))
        while len(self._tokens) > MAX_TOKEN_CHUNKS:
            self._tokens.popitem(last=False)

    def _token_ids(self, ns_digest: bytes, hashes: list[bytes]) -> list[int]:
        """The blocks' tokens, in order, if every one of them is known; else none (all or nothing, as
        vLLM's ``token_ids`` cover every block of the event)."""
        parts = [self._tokens.get(ns_digest + h) for h in hashes]
        if not all(parts):
            return []
        return array.array("I", b"".join(parts)).tolist()

    def _tier_stored(self, by_topic: dict[bytes, list], keys: Iterable[ObjectKey], medium: str) -> None:
        """Announce a tier's stores and remember them (rank 0's: what was announced), newest last; past
        ``MAX_TIER_BLOCKS`` the medium's oldest are withdrawn, as kvdepot stops tracking them."""
        blocks = self._blocks(keys)
        self._stored_blocks(by_topic, blocks, medium)
        announced = self._in_tier.setdefault(medium, OrderedDict())
        for ns_digest, (ns, hashes) in blocks.items():
            topic = self._topic(ns.model)
            for h in hashes:
                key = ns_digest + h
                announced[key] = topic
                announced.move_to_end(key)
        excess = len(announced) - MAX_TIER_BLOCKS
        if excess > 0:
            self._withdraw(by_topic, [announced.popitem(last=False) for _ in range(excess)], medium)

    def _withdraw(self, by_topic: dict[bytes, list], announced: Iterable[tuple[bytes, bytes]], medium: str) -> None:
        """``BlockRemoved`` of (key, topic) pairs remembered as announced: their namespace need not be
        known any more."""
        hashes_by_topic: dict[bytes, list[bytes]] = {}
        for key, topic in announced:
            hashes_by_topic.setdefault(topic, []).append(key[NAMESPACE_BYTES:])
        for topic, hashes in hashes_by_topic.items():
            by_topic.setdefault(topic, []).append(BlockRemoved(hashes, medium))

    def _stored(self, by_topic: dict[bytes, list], keys: Iterable[ObjectKey], medium: str) -> None:
        self._stored_blocks(by_topic, self._blocks(keys), medium)

    def _l1_stored(self, by_topic: dict[bytes, list], keys: Iterable[ObjectKey]) -> None:
        """Announce L1's stores and remember each announced block's topic (until its removal)."""
        blocks = self._blocks(keys)
        self._stored_blocks(by_topic, blocks, L1_MEDIUM)
        for ns_digest, (ns, hashes) in blocks.items():
            topic = self._topic(ns.model)
            for h in hashes:
                self._in_l1[ns_digest + h] = topic

    def _l1_removed(self, by_topic: dict[bytes, list], keys: Iterable[ObjectKey]) -> None:
        """L1's removals: an announced block's by the topic it was announced on (its namespace may have
        been forgotten since), any other's as before."""
        withdrawn, others = [], []
        for key in keys:
            topic = self._in_l1.pop(bytes(key), None)
            if topic is None:
                others.append(key)
            else:
                withdrawn.append((bytes(key), topic))
        self._withdraw(by_topic, withdrawn, L1_MEDIUM)
        self._removed(by_topic, others, L1_MEDIUM)

    def _stored_blocks(self, by_topic: dict[bytes, list], blocks: dict[bytes, tuple[NamespaceSeen, list[bytes]]], medium: str) -> None:
        for ns_digest, (ns, hashes) in blocks.items():
            extra = [(ns.salt,)] * len(hashes) if ns.salt else None
            tokens = self._token_ids(ns_digest, hashes)
            by_topic.setdefault(self._topic(ns.model), []).append(BlockStored(hashes, None, tokens, ns.chunk_tokens, None, medium, None, extra))

    def _removed(self, by_topic: dict[bytes, list], keys: Iterable[ObjectKey], medium: str) -> None:
        for ns, hashes in self._blocks(keys).values():
            by_topic.setdefault(self._topic(ns.model), []).append(BlockRemoved(hashes, medium))

    def _flush(self, by_topic: dict[bytes, list]) -> None:
        """Send each topic's events; a topic's first batch of this server's life begins with
        ``AllBlocksCleared``: a subscriber of that topic alone never got the start-up one."""
        for topic, events in by_topic.items():
            if events:
                if topic not in self._last_seq:
                    if len(self._last_seq) >= MAX_TOPICS:
                        self._forget_topic()
                    events = [AllBlocksCleared(), *events]
                self._send(topic, events)

    def _forget_topic(self) -> None:
        """Forget the least recently used topic's sequence, after telling its subscribers to forget
        its blocks: a later batch on it begins anew (numbered from the time then: never going back)."""
        topic = next(iter(self._last_seq))
        self._send(topic, [AllBlocksCleared()])
        with self._buffer_lock:
            del self._last_seq[topic]
            self._forgot_topic = True

    def _next_seq(self, topic: bytes) -> int:
        """The topic's next number (under ``_buffer_lock``): one past its last, or past the start."""
        last = self._last_seq.pop(topic, None)
        if last is None:
            last = max(self._start_seq, time.time_ns() // 1000 if self._forgot_topic else 0)
        self._last_seq[topic] = last + 1  # and the most recently used
        return last + 1

    def _send(self, topic: bytes, events: list) -> None:
        """One batch under the topic's next number, kept for replay."""
        if self._pub is None:
            return
        payload = self._encode(KVEventBatch(time.time(), events))
        with self._buffer_lock:
            seq = self._next_seq(topic)
            self._buffer.append((seq, topic, payload))
        self._put(topic, seq, payload, events)

    def _put(self, topic: bytes, seq: int, payload: bytes, events: list) -> None:
        assert self._pub is not None
        self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        if self._metrics is not None:
            self._metrics.kv_event_batches.inc()
            for e in events:
                self._metrics.kv_events.labels(type(e).__name__).inc()

    # --- replay ------------------------------------------------------------------------------------

    def _serve_replays(self) -> None:
        sock = self._replay
        assert sock is not None
        while not self._stop.is_set():
            self._malformed.flush()  # a flood that stopped still gets its count logged
            try:
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) not in (3, 4) or len(frames[2]) != 8:
                self._malformed.hit("ignored a malformed KV-events replay request (%d frames)", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            with self._buffer_lock:
                topic = frames[3] if len(frames) == 4 else self._only_topic()
                kept = [entry for entry in self._buffer if entry[0] >= start and entry[1] == topic] if topic is not None else []
                topics = len(self._last_seq)
            if topic is None and topics > 1:
                self._warn_no_topic(topics)
            try:
                for seq, topic, payload in kept:
                    sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
                sock.send_multipart((client, b"", b"", END_OF_REPLAY, b""))
            except zmq.ZMQError:
                continue
            if self._metrics is not None:
                self._metrics.kv_event_replays.inc()

    def _only_topic(self) -> bytes | None:
        """The topic a request without one replays (under ``_buffer_lock``): the one this server has
        published on, as a vLLM publisher has one; with several, none: each has its own numbers, and
        another model's batches would be phantom hits to a subscriber of one (hashes name no model)."""
        return next(iter(self._last_seq)) if len(self._last_seq) == 1 else None

    def _warn_no_topic(self, topics: int) -> None:
        now = time.monotonic()
        if now - self._replay_warned >= REPLAY_WARN_S:
            self._replay_warned = now
            log.warning("a KV-events replay request named no topic, and this server publishes %d: nothing replayed "
                        "(a router of several topics sends [b'', start_seq, topic])", topics)  # fmt: skip
