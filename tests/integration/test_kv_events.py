"""KV events for routers: a subscriber that decodes the stream with vLLM's own event classes rebuilds,
per medium, exactly the set of objects the server holds in L1 and in its fs tier, through evictions in
both, salts, clears, and a subscriber restart that replays what it missed; on llm-d's topics
(``kv@<node>@<model>``, subscribed to as ``kv@``), each numbered on its own."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvdepot import ClientOptions, KVClient
from kvdepot.bench.serverproc import free_port
from kvdepot.keys import NamespaceSpec
from kvdepot.types import NAMESPACE_BYTES
from support.servers import CHUNK, LAYOUT

END = (-1).to_bytes(8, "big", signed=True)
SALTS = ("", "tenant-a")
MODEL = "events-model"


class Subscriber:
    """A router's view, as llm-d's indexer subscribes: SUB to ``kv@`` for the live stream, ROUTER replay
    for what came before; each topic's sequence numbers applied once, in order, without a gap."""

    def __init__(self, pub: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.subscribe(b"kv@")
        self.replay_addr = replay
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.media: dict[str, set[tuple[bytes, str]]] = {}
        self.last_seq: dict[bytes, int] = {}
        self.batches = 0

    def catch_up(self, start: int, *topic: bytes) -> int:
        """Ask for the kept batches from ``start`` (of ``topic``, or of the server's one topic, as vLLM's
        subscribers ask); returns how many came."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_addr)
        dealer.send_multipart([b"", start.to_bytes(8, "big"), *topic])
        n = 0
        while True:
            assert dealer.poll(10_000), "the replay socket did not answer"
            _, topic_got, seq, payload = dealer.recv_multipart()
            if seq == END:
                break
            assert not topic or topic_got == topic[0]
            self._apply(topic_got, int.from_bytes(seq, "big"), payload)
            n += 1
        dealer.close(0)
        return n

    def drain(self, quiet_s: float = 1.5) -> None:
        """Apply live batches until none came for ``quiet_s``."""
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            self._apply(topic, int.from_bytes(seq, "big"), payload)

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        prefix, node, model = topic.decode().split("@")  # as llm-d's indexer reads it
        assert prefix == "kv" and node and model == MODEL, topic
        last = self.last_seq.get(topic)
        if last is not None and seq <= last:
            return  # seen already (live and replayed overlap)
        assert last is None or seq == last + 1, f"gap on {topic}: {last} -> {seq}"
        self.last_seq[topic] = seq
        self.batches += 1
        for e in self.decode(payload).events:
            if isinstance(e, AllBlocksCleared):
                self.media.clear()
            elif isinstance(e, BlockStored):
                assert e.block_size == CHUNK and e.token_ids == [] and e.parent_block_hash is None
                salts = [x[0] if x else "" for x in (e.extra_keys or [None] * len(e.block_hashes))]
                self.media.setdefault(e.medium, set()).update(zip(e.block_hashes, salts))
            elif isinstance(e, BlockRemoved):
                held = self.media.setdefault(e.medium, set())
                for h in e.block_hashes:
                    held.difference_update({(h, s) for s in SALTS})
            else:
                raise AssertionError(f"unexpected event {e!r}")

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def prompts(seed: int, first: int, count: int) -> list[tuple[list[int], str]]:
    """One-chunk prompts (so a lookup tells whether that one object is held), alternating salts."""
    return [([seed + 1_000_003 * i + t for t in range(CHUNK)], SALTS[i % 2]) for i in range(first, first + count)]


def store(client: KVClient, batch: list[tuple[list[int], str]]) -> None:
    kv = np.ones((2, LAYOUT.num_layers, CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    for tokens, salt in batch:
        assert client.store(tokens, kv, cache_salt=salt or None) == CHUNK


def held_in_l1(client: KVClient, everything: list[tuple[list[int], str]]) -> set[tuple[bytes, str]]:
    """What L1 holds now (a session-less LOOKUP answers from L1 alone: it loads nothing from the tier)."""
    out = set()
    for tokens, salt in everything:
        h = client.hashes(tokens)[0]
        if client.link.lookup([h], salt, probe=True) == 1:
            out.add((h, salt))
    return out


def held_in_fs(path: Path) -> set[tuple[bytes, str]]:
    spec = NamespaceSpec(MODEL, 1, 0, LAYOUT.fingerprint(), CHUNK)
    salt_of = {spec.digest(s): s for s in SALTS}
    out = set()
    for _, _, files in os.walk(path):
        for name in files:
            try:
                key = bytes.fromhex(name)
            except ValueError:
                continue  # not an object (a temporary file)
            if len(key) == NAMESPACE_BYTES + 32:
                out.add((key[NAMESPACE_BYTES:], salt_of[key[:NAMESPACE_BYTES]]))
    return out


def settle(server) -> None:
    """The L2 push has nothing queued or in flight (so every tier store was acknowledged)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        store_state = server.status()["l2_controllers"]["store"]
        if store_state["queued"] == 0 and store_state["in_flight"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the L2 push did not settle: {store_state}")


def test_a_subscriber_rebuilds_every_medium_exactly_also_after_a_restart_with_replay(make_server, tmp_path, seed):
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    fs = tmp_path / "fs"
    # L1 of 1 MiB (chunks of 8 KiB: evictions at ~120 objects); an fs tier of 0.6 MiB (evicts too).
    server = make_server(
        "--l1-size-gb", str(1 / 1024), "--l2", f"fs:path={fs},size_gb={0.6 / 1024}",
        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay, "--kv-events-topic", "kv@{node}@{model}",
    )
    first = Subscriber(pub, replay)
    time.sleep(0.3)  # let the SUB join, then replay from the start: nothing is missed either way
    first.catch_up(0)
    everything = []
    with KVClient(server.ipc_url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as client:
        batch = prompts(seed, 0, 200)
        store(client, batch)
        everything += batch
        settle(server)
        first.drain()
        [(topic, seen_by_first)] = first.last_seq.items()
        node = f"{socket.gethostname()}:{server.port}"  # as llm-d reads it: kv@<pod>@<model>
        assert (topic.decode() if isinstance(topic, bytes) else topic) == f"kv@{node}@{MODEL}"
        first.close()  # the router restarts; meanwhile the server goes on

        batch = prompts(seed, 200, 100)
        store(client, batch)
        everything += batch
        r = httpx.post(f"{server.http}/cache/clear", json={"scope": "l1"}, timeout=30)
        assert r.status_code == 200, r.text
        batch = prompts(seed, 300, 60)
        store(client, batch)
        everything += batch
        assert client.clear("tiers") > 0  # AllBlocksCleared, then L1 announced again
        batch = prompts(seed, 360, 40)
        store(client, batch)
        everything += batch
        settle(server)

        second = Subscriber(pub, replay)
        second.media = {m: set(s) for m, s in first.media.items()}  # what the router kept from before
        second.last_seq = {topic: seen_by_first}
        time.sleep(0.3)
        assert second.catch_up(seen_by_first + 1, topic) > 0
        second.drain()
        try:
            l1 = held_in_l1(client, everything)
            on_disk = held_in_fs(fs)
            assert 0 < len(l1) < len(everything), "the workload must evict from L1 for this test to mean anything"
            assert 0 < len(on_disk) < 100, "the workload must evict from the fs tier too"
            assert second.media.get("CPU", set()) == l1
            assert second.media.get("FS", set()) == on_disk
            assert {s for _, s in l1} == set(SALTS)
        finally:
            second.close()
    metrics = httpx.get(f"{server.http}/metrics", timeout=10).text
    assert 'kvdepot_kv_events_total{event="BlockRemoved"}' in metrics
    assert "kvdepot_kv_event_replays_total 2.0" in metrics


def test_a_client_that_opts_in_names_its_blocks_tokens_on_both_transports(make_server, seed):
    pub = f"tcp://127.0.0.1:{free_port()}"
    server = make_server("--kv-events-endpoint", pub)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub)
    sub.subscribe(MODEL.encode())
    time.sleep(0.3)  # the SUB joins before anything is stored
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    kv = np.ones((2, LAYOUT.num_layers, 3 * CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    sent = {}
    try:
        for i, (url, transport) in enumerate(((server.ipc_url, "shm"), (server.url, "inline"))):
            opts = ClientOptions(transport=transport, send_token_ids=True)
            with KVClient(url, MODEL, LAYOUT, options=opts) as client:
                tokens = [seed + 7919 * i + t for t in range(3 * CHUNK)]  # a plain list, as engines hand them
                assert client.store(tokens, kv) == 3 * CHUNK
                sent[transport] = dict(zip(client.hashes(tokens), (tokens[k * CHUNK : (k + 1) * CHUNK] for k in range(3))))
        # Without opting in, the same store names no tokens.
        with KVClient(server.url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as plain:
            quiet = [seed + 31 + t for t in range(CHUNK)]
            assert plain.store(quiet, kv[:, :, :CHUNK]) == CHUNK
            quiet_hash = plain.hashes(quiet)[0]
        named: dict[bytes, list[int]] = {}
        unnamed = set()
        while sub.poll(1500):
            _, _, payload = sub.recv_multipart()
            for e in decode(payload).events:
                if isinstance(e, BlockStored) and e.medium == "CPU":
                    if e.token_ids:
                        assert len(e.token_ids) == len(e.block_hashes) * CHUNK
                        for k, h in enumerate(e.block_hashes):
                            named[h] = e.token_ids[k * CHUNK : (k + 1) * CHUNK]
                    else:
                        unnamed.update(e.block_hashes)
        assert named == {**sent["shm"], **sent["inline"]}
        assert quiet_hash in unnamed and quiet_hash not in named
    finally:
        sub.close(0)
        ctx.term()
    # Tokens that do not cover the chunks are refused, and nothing is stored.
    from kvdepot.errors import BadRequest
    from kvdepot.protocol import messages as m

    with KVClient(server.url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as c:
        h = c.hashes([seed + 5 + t for t in range(CHUNK)])
        before = server.status()["l1"]["objects"]
        try:
            c.link.request(m.PrepareStoreRequest(context_id=0, keys=h, token_ids=[1, 2, 3]))
            raise AssertionError("a PREPARE_STORE with 3 tokens for a 16-token chunk was accepted")
        except BadRequest as exc:
            assert "token_ids has 3 tokens for 1 chunks" in str(exc)
        assert server.status()["l1"]["objects"] == before


def _port_below_the_ephemeral_range() -> int:
    """A free port the kernel never picks as a source port. While the router is down the server's PUB
    keeps connecting to its address; to a free port of the ephemeral range on this host, Linux can pick
    that same port as the source and connect the socket to itself, and the router cannot bind it."""
    import random

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(200):
        port = random.randrange(max(1024, low - 8000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise AssertionError("no free port below the ephemeral range")


def test_with_connect_the_server_reaches_a_router_that_binds_its_subscriber_and_again_after_it_restarts(make_server, seed):
    """llm-d's indexer binds its SUB and the engines connect to it (vLLM connects for an endpoint with a
    host): ``--kv-events-connect`` does the same, and ZeroMQ reconnects when the router comes back."""
    endpoint = f"tcp://127.0.0.1:{_port_below_the_ephemeral_range()}"
    ctx = zmq.Context()
    decode = msgspec.msgpack.Decoder(KVEventBatch).decode
    kv = np.ones((2, LAYOUT.num_layers, CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)

    def router():
        deadline = time.monotonic() + 10
        while True:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            try:
                sub.bind(endpoint)
            except zmq.ZMQError:  # the last router's port is not let go yet
                sub.close(0)
                assert time.monotonic() < deadline, f"cannot bind {endpoint} again"
                time.sleep(0.1)
                continue
            sub.subscribe(MODEL.encode())
            return sub

    def reaches(sub, client, round_: int) -> bool:
        """Store fresh chunks until the router gets one's BlockStored: a PUB drops what it sends before
        the SUB's subscription has reached it, however long that takes on a loaded machine."""
        sent: set[bytes] = set()
        deadline = time.monotonic() + 30
        for i in range(1000):
            if time.monotonic() > deadline:
                return False
            tokens = [seed + 104729 * (1000 * round_ + i) + t for t in range(CHUNK)]
            assert client.store(tokens, kv) == CHUNK
            sent.update(client.hashes(tokens))
            wait_until = time.monotonic() + 0.5
            while time.monotonic() < wait_until:
                if sub.poll(100):
                    _, _, payload = sub.recv_multipart()
                    if any(isinstance(e, BlockStored) and e.medium == "CPU" and sent & set(e.block_hashes) for e in decode(payload).events):
                        return True
        return False

    server = make_server("--kv-events-endpoint", endpoint, "--kv-events-connect")  # the router is not up yet: nothing waits for it
    try:
        with KVClient(server.url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as client:
            for round_ in range(2):
                sub = router()
                assert reaches(sub, client, round_), f"round {round_}: no store reached the router in 30 s"
                sub.close(0)  # the router restarts
    finally:
        ctx.destroy(linger=0)
