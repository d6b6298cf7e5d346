"""KV events' topics and the stream's safety, on the publisher alone: the bus's records handed to
``handle`` as the drain thread would, and what a router's SUB socket gets, decoded with vLLM's classes."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvdepot.config import ObservabilityConfig
from kvdepot.errors import ConfigError
from kvdepot.events import EventKind, L1Changed, NamespaceSeen, ObjectEvent, TierCleared, TierRemoved, TierStored
from kvdepot.observability import kv_events
from kvdepot.observability.bus import MAX_BATCH, EventBus
from kvdepot.observability.kv_events import END_OF_REPLAY, KVEventsPublisher
from kvdepot.observability.metrics import Metrics
from kvdepot.server.observers import Observers
from kvdepot.types import NAMESPACE_BYTES, ObjectKey

PROBE = b"\x00probe"
decode = msgspec.msgpack.Decoder(KVEventBatch).decode


def namespace(n: int) -> bytes:
    return bytes([n]) * NAMESPACE_BYTES


def seen(ns: bytes, model: str, rank: int = 0) -> NamespaceSeen:
    return NamespaceSeen(ns, model, 2, rank, "", 16)


def block(i: int) -> bytes:
    return i.to_bytes(32, "big")


def l1(kind: EventKind, ns: bytes, blocks: range, generation: int = 1) -> L1Changed:
    return L1Changed(tuple(ObjectEvent(kind, ObjectKey(ns + block(i)), generation, 0, "") for i in blocks))


class Router:
    """A SUB socket that has joined (a probe sent on the raw PUB socket came back: no sleep, no race),
    and reads what comes as (topic, seq, batch)."""

    def __init__(self, ctx: zmq.Context, pub: KVEventsPublisher, prefix: bytes) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.connect(pub.bound_endpoints[0])
        self.sock.subscribe(prefix)
        while True:
            pub._pub.send_multipart((prefix + PROBE, b"", b""))
            if self.sock.poll(50):
                break

    def read(self, quiet_ms: int = 500) -> list[tuple[bytes, int, KVEventBatch]]:
        out = []
        while self.sock.poll(quiet_ms):
            topic, seq, payload = self.sock.recv_multipart()
            if not topic.endswith(PROBE):
                out.append((topic, int.from_bytes(seq, "big"), decode(payload)))
        return out


@pytest.fixture
def make(tmp_path):
    ctx = zmq.Context()
    made: list[KVEventsPublisher] = []

    def make(**kwargs) -> KVEventsPublisher:
        pub = KVEventsPublisher(f"ipc://{tmp_path}/pub{len(made)}", f"ipc://{tmp_path}/replay{len(made)}", **kwargs)
        made.append(pub)
        pub.bind()
        return pub

    make.ctx = ctx
    yield make
    for pub in made:
        pub.close()
    ctx.destroy(linger=0)


def test_a_topic_template_names_the_node_and_the_model_as_llm_d_reads_them(make):
    """llm-d's indexer subscribes to "kv@" and splits the topic "kv@<pod>@<model>"; each batch used to
    go on the bare model name, so it received nothing."""
    pub = make(topic="kv@{node}@{model}", node="host-1:5555")
    router = Router(make.ctx, pub, b"kv@")
    pub.start()
    pub.handle([seen(namespace(1), "llama"), seen(namespace(2), "qwen"), l1(EventKind.STORED, namespace(1), range(3)),
                l1(EventKind.STORED, namespace(2), range(3, 5))])  # fmt: skip
    got = router.read()
    stored = {}
    for topic, _, batch in got:
        prefix, pod, model = topic.decode().split("@")
        assert (prefix, pod) == ("kv", "host-1:5555")
        for e in batch.events:
            if isinstance(e, BlockStored):
                stored.setdefault(model, []).extend(e.block_hashes)
    assert stored == {"llama": [block(0), block(1), block(2)], "qwen": [block(3), block(4)]}


def test_the_default_topic_is_the_model_name_as_before(make):
    pub = make()
    router = Router(make.ctx, pub, b"llama")
    pub.start()
    pub.handle([seen(namespace(1), "llama"), l1(EventKind.STORED, namespace(1), range(2))])
    assert [e.block_hashes for _, _, b in router.read() for e in b.events if isinstance(e, BlockStored)] == [[block(0), block(1)]]


@pytest.mark.parametrize("template", ["kv@{pod}@{model}", "{model!r}", "{model:>9}", "{0}", "kv@{model", "kv@}"])
def test_a_topic_template_that_is_not_one_is_refused_at_start_naming_the_flag(template):
    with pytest.raises(ConfigError, match="--kv-events-topic"):
        Observers(ObservabilityConfig(kv_events_endpoint="ipc:///tmp/kvdepot-never-bound", kv_events_topic=template), Metrics())


def test_a_topic_template_with_literal_braces_is_one(make):
    pub = make(topic="{{kv}}@{model}")
    router = Router(make.ctx, pub, b"{kv}@")
    pub.start()
    pub.handle([seen(namespace(1), "m"), l1(EventKind.STORED, namespace(1), range(1))])
    assert {topic for topic, _, _ in router.read()} == {b"{kv}@", b"{kv}@m"}  # the start-up batch, the model's


def test_each_topic_begins_with_all_blocks_cleared_once_so_its_own_subscribers_forget_an_earlier_life(make):
    """The start-up AllBlocksCleared went on the empty topic alone: a router subscribed to one model's
    topic never got it and kept the blocks of the server's earlier life."""
    pub = make(topic="kv@{node}@{model}", node="n")
    llama = Router(make.ctx, pub, b"kv@n@llama")
    pub.start()
    pub.handle([seen(namespace(1), "llama"), seen(namespace(2), "qwen"), l1(EventKind.STORED, namespace(1), range(2)),
                l1(EventKind.STORED, namespace(2), range(2))])  # fmt: skip
    pub.handle([l1(EventKind.STORED, namespace(1), range(2, 4)), l1(EventKind.REMOVED, namespace(1), range(1))])
    events = [type(e) for topic, _, batch in llama.read() for e in batch.events]
    assert events[0] is AllBlocksCleared and AllBlocksCleared not in events[1:]
    assert events[1:] == [BlockStored, BlockStored, BlockRemoved]


def test_the_start_up_all_blocks_cleared_reaches_every_subscriber_of_this_servers_topics(make):
    pub = make(topic="kv@{node}@{model}", node="n")
    node = Router(make.ctx, pub, b"kv@n@")  # all this server's models, as a router of several would
    pub.start()
    [(topic, _, batch)] = node.read()
    assert topic == b"kv@n@" and [type(e) for e in batch.events] == [AllBlocksCleared]


# --- a bus that drops records -------------------------------------------------------------------------


def rebuild(got: list[tuple[bytes, int, KVEventBatch]]) -> set[tuple[bytes, bytes]]:
    """A router's index: (topic, block hash) it believes held, from the batches in order."""
    held: set[tuple[bytes, bytes]] = set()
    for topic, _, batch in got:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                held = {(t, h) for t, h in held if t != topic}
            elif isinstance(e, BlockStored):
                held |= {(topic, h) for h in e.block_hashes}
            elif isinstance(e, BlockRemoved):
                held -= {(topic, h) for h in e.block_hashes}
    return held


def test_a_removal_the_bus_dropped_never_leaves_a_router_a_phantom_block(make):
    """The bus dropped a removal while the stream went on gapless: the router kept the block for ever.
    The drop is told in order, behind every record published before it: here a whole drain round
    (MAX_BATCH records) comes before the store of block 0, and the reset must follow that store."""
    metrics = Metrics()
    pub = make(metrics=metrics)
    bus = EventBus(MAX_BATCH + 100)
    bus.subscribe("kv_events", pub.handle, KVEventsPublisher.KINDS)
    router = Router(make.ctx, pub, b"m")
    pub.start()
    ns = namespace(1)
    bus.publish(seen(ns, "m"))
    for i in range(1, MAX_BATCH + 1):  # a first drain round's worth of other blocks
        bus.publish(l1(EventKind.STORED, ns, range(i, i + 1)))
    bus.publish(l1(EventKind.STORED, ns, range(1)))  # block 0, in the second round
    while bus.stats().depth < bus.capacity:
        bus.publish(l1(EventKind.STORED, ns, range(10_000, 10_001)))
    bus.publish(l1(EventKind.REMOVED, ns, range(1)))  # block 0 leaves: dropped (the queue is full)
    assert bus.stats().dropped == 1
    bus.start()
    assert bus.flush()
    bus.publish(l1(EventKind.STORED, ns, range(20_000, 20_001)))  # after the reset
    assert bus.flush()
    bus.close()
    held = {h for _, h in rebuild(router.read())}
    assert block(0) not in held, "a block kvdepot removed is still announced"
    assert held == {block(20_000)}  # what came before the drop is forgotten: misses, never phantoms
    assert pub.resets == 1 and "kvdepot_kv_event_resets_total 1.0" in metrics.text().decode()
    # ... and so is each key's generation: one whose removal was dropped stayed for the server's life
    assert len(pub._l1._present) == 1


def test_namespaces_are_forgotten_least_recently_used_first(make, monkeypatch):
    """The table was FIFO and never refreshed: the busiest namespace, the first one seen, was the
    first forgotten, and its events were then skipped (and a removal skipped is a phantom block)."""
    monkeypatch.setattr(kv_events, "MAX_NAMESPACES", 2)
    metrics = Metrics()
    pub = make(metrics=metrics)
    router = Router(make.ctx, pub, b"m")
    pub.start()
    busy, quiet, new = namespace(1), namespace(2), namespace(3)
    pub.handle([seen(busy, "m"), seen(quiet, "m"), l1(EventKind.STORED, busy, range(1))])
    pub.handle([seen(new, "m"), l1(EventKind.REMOVED, busy, range(1)), l1(EventKind.STORED, quiet, range(1, 2))])
    removed = [h for _, _, b in router.read() for e in b.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed == [block(0)]  # the busy namespace is still known
    assert pub.unknown_namespace == 1  # the quiet one was forgotten
    assert "kvdepot_kv_event_unknown_namespace_total 1.0" in metrics.text().decode()


@pytest.mark.parametrize("where", ["l1", "tier"])
def test_a_removal_of_a_block_whose_namespace_was_forgotten_since_reaches_the_router(make, monkeypatch, where):
    """Every rank and salt takes a place among the namespaces remembered, and a context announces its
    namespace once: a quiet one is forgotten. Its announced blocks' removals were then skipped as of an
    unknown namespace, and the router kept them for ever. They go by the topic they were announced on."""
    monkeypatch.setattr(kv_events, "MAX_NAMESPACES", 2)
    pub = make()
    pub.name_tiers([("fs0", "fs")])
    router = Router(make.ctx, pub, b"m")
    pub.start()
    quiet, key = namespace(1), ObjectKey(namespace(1) + block(0))
    stored = l1(EventKind.STORED, quiet, range(1)) if where == "l1" else TierStored("fs0", "fs", (key,))
    pub.handle([seen(quiet, "m"), stored])
    pub.handle([seen(namespace(2), "m"), seen(namespace(3), "m")])  # two other salts or ranks: quiet is forgotten
    removed = l1(EventKind.REMOVED, quiet, range(1)) if where == "l1" else TierRemoved("fs0", "fs", (key,), "evicted")
    pub.handle([removed])
    got = router.read()
    assert any(isinstance(e, BlockStored) for _, _, b in got for e in b.events)
    assert rebuild(got) == set(), "the router was never told the block left"


# --- what is remembered per L2 medium -------------------------------------------------------------------


def test_a_tiers_announced_blocks_are_bounded_and_those_past_the_bound_are_withdrawn(make, monkeypatch):
    """A tier whose own drops kvdepot never hears of (a Valkey TTL, an S3 lifecycle rule, a peer's pool)
    grew the set of announced blocks for the server's whole life, other ranks' blocks included."""
    monkeypatch.setattr(kv_events, "MAX_TIER_BLOCKS", 3)
    pub = make()
    router = Router(make.ctx, pub, b"m")
    pub.start()
    rank0, rank1 = namespace(1), namespace(2)
    keys = lambda ns, blocks: tuple(ObjectKey(ns + block(i)) for i in blocks)  # noqa: E731
    pub.handle([seen(rank0, "m"), seen(rank1, "m", rank=1), TierStored("valkey0", "valkey", keys(rank0, range(4))),
                TierStored("valkey0", "valkey", keys(rank1, range(4)))])  # fmt: skip
    pub.handle([TierStored("valkey0", "valkey", keys(rank0, range(1, 2))),  # block 1 announced again: the newest
                TierStored("valkey0", "valkey", keys(rank0, range(4, 6)))])  # fmt: skip
    assert list(pub._in_tier["VALKEY"]) == list(keys(rank0, (1, 4, 5)))  # bounded, rank 0's only
    pub.handle([TierCleared("valkey0", "valkey")])
    got = router.read()
    valkey = {h for t, h in rebuild(got[:-1])}  # before the clear
    assert valkey == {block(1), block(4), block(5)}  # the 3 most recently announced; 0, 2 and 3 withdrawn
    cleared = [h for e in got[-1][2].events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(cleared) == [block(1), block(4), block(5)]  # the clear withdraws what is remembered
    assert rebuild(got) == set()


# --- sequence numbers and replay, per topic -----------------------------------------------------------


def replay(ctx: zmq.Context, pub: KVEventsPublisher, *request: bytes) -> list[tuple[bytes, int, KVEventBatch]]:
    """A replay request (``[b"", start_seq]`` as vLLM's subscribers send it, or with a topic frame)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(pub.bound_endpoints[1])
    dealer.send_multipart([b"", *request])
    out = []
    try:
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_OF_REPLAY:
                return out
            out.append((topic, int.from_bytes(seq, "big"), decode(payload)))
    finally:
        dealer.close(linger=0)


def two_models(pub: KVEventsPublisher) -> None:
    llama, qwen = namespace(1), namespace(2)
    pub.handle([seen(llama, "llama"), seen(qwen, "qwen")])
    for i in range(6):  # the two models' batches interleave
        pub.handle([l1(EventKind.STORED, llama if i % 3 else qwen, range(i, i + 1))])


def test_each_topic_numbers_its_batches_without_gaps(make):
    """One counter ran across all topics: a subscriber of one model saw a gap at every other model's
    batch, and could not tell a lost batch from another topic's."""
    pub = make()
    everything = Router(make.ctx, pub, b"")
    pub.start()
    two_models(pub)
    got = everything.read()
    [(startup, start)] = [(topic, seq) for topic, seq, _ in got if topic == b""]
    numbers: dict[bytes, list[int]] = {}
    for topic, seq, _ in got:
        numbers.setdefault(topic, []).append(seq)
    assert numbers == {b"": [start], b"llama": [start + 1, start + 2, start + 3, start + 4], b"qwen": [start + 1, start + 2]}


def test_a_replay_request_naming_a_topic_gets_that_topics_batches_only(make):
    """A replay sent every topic's batches: a router of one model indexed the others' blocks too."""
    pub = make()
    llama = Router(make.ctx, pub, b"llama")
    pub.start()
    two_models(pub)
    live = llama.read()
    replayed = replay(make.ctx, pub, (0).to_bytes(8, "big"), b"llama")
    assert [(t, s) for t, s, _ in replayed] == [(t, s) for t, s, _ in live]
    assert replay(make.ctx, pub, live[2][1].to_bytes(8, "big"), b"llama") == live[2:]


def test_vllms_replay_request_gets_the_one_topic_and_never_another_models_batches(make):
    """vLLM's request names no topic (a vLLM publisher has one): with one topic it gets that topic's
    batches, as from vLLM; with several, the end marker alone, not another model's blocks."""
    pub = make()
    pub.start()
    pub.handle([seen(namespace(1), "llama"), l1(EventKind.STORED, namespace(1), range(2))])
    pub.handle([l1(EventKind.REMOVED, namespace(1), range(1))])
    got = replay(make.ctx, pub, (0).to_bytes(8, "big"))
    assert [t for t, _, _ in got] == [b"llama", b"llama"]
    assert [type(e) for _, _, b in got for e in b.events] == [AllBlocksCleared, BlockStored, BlockRemoved]
    pub.handle([seen(namespace(2), "qwen"), l1(EventKind.STORED, namespace(2), range(5, 6))])
    assert replay(make.ctx, pub, (0).to_bytes(8, "big")) == []
    assert [t for t, _, _ in replay(make.ctx, pub, (0).to_bytes(8, "big"), b"qwen")] == [b"qwen"]


def test_a_forgotten_topic_is_cleared_and_numbered_on_from_the_time_never_back(make, monkeypatch):
    monkeypatch.setattr(kv_events, "MAX_TOPICS", 1)
    pub = make()
    everything = Router(make.ctx, pub, b"")
    pub.start()
    a, b = namespace(1), namespace(2)
    pub.handle([seen(a, "a"), seen(b, "b"), l1(EventKind.STORED, a, range(1))])
    pub.handle([l1(EventKind.STORED, b, range(1, 2))])  # a is forgotten: its routers drop its blocks
    pub.handle([l1(EventKind.STORED, a, range(2, 3))])  # a anew (b forgotten in turn)
    batches = everything.read()
    got = [(t, s, [type(e) for e in batch.events]) for t, s, batch in batches if t]
    assert [(t, kinds) for t, _, kinds in got] == [
        (b"a", [AllBlocksCleared, BlockStored]), (b"a", [AllBlocksCleared]), (b"b", [AllBlocksCleared, BlockStored]),
        (b"b", [AllBlocksCleared]), (b"a", [AllBlocksCleared, BlockStored]),
    ]  # fmt: skip
    a_numbers = [s for t, s, _ in got if t == b"a"]
    assert a_numbers[2] > a_numbers[1] == a_numbers[0] + 1  # a's numbers never go back
    assert rebuild(batches) == {(b"a", block(2))}  # b's block went with b (a miss, never a phantom)
