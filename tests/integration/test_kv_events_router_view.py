"""A router's view, rebuilt only from kvdepot's KV events (decoded with vLLM's own classes), equals what
the server holds, through operations the other KV-event tests do not cover."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import msgspec
import numpy as np
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvdepot import ClientOptions, KVClient
from kvdepot.bench.serverproc import free_port
from kvdepot.types import NAMESPACE_BYTES
from support.servers import CHUNK, LAYOUT
from support.tiers import wait_store_idle

MODEL = "router-view-model"


class Router:
    """Applies one server's batches in order, per topic, without gaps; a view of blocks per medium."""

    def __init__(self, pub: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(pub)
        self.sub.subscribe(b"")
        self.decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self.media: dict[str, set[bytes]] = {}
        self.last_seq: dict[bytes, int] = {}

    def drain(self, quiet_s: float = 1.0) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            n = int.from_bytes(seq, "big")
            last = self.last_seq.get(topic)
            assert last is None or n == last + 1, f"gap on {topic!r}: {last} -> {n}"
            self.last_seq[topic] = n
            for e in self.decode(payload).events:
                if isinstance(e, AllBlocksCleared):
                    self.media.clear()
                elif isinstance(e, BlockStored):
                    self.media.setdefault(e.medium, set()).update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    self.media.setdefault(e.medium, set()).difference_update(e.block_hashes)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def held_in_fs(path: Path) -> set[bytes]:
    out = set()
    for _, _, files in os.walk(path):
        for name in files:
            try:
                key = bytes.fromhex(name)
            except ValueError:
                continue
            if len(key) == NAMESPACE_BYTES + 32:
                out.add(key[NAMESPACE_BYTES:])
    return out


def test_a_prefix_deleted_from_the_tiers_leaves_the_routers_tier_view(make_server, tmp_path, seed):
    """DELETE /cache/prefix (scope tiers or all) removes the prefix's objects from the fs tier: a router
    must be told (README: "a removal for every way kvdepot sees one leave (... delete ...)"), else it
    routes to a server for blocks it no longer holds, for ever."""
    pub = f"tcp://127.0.0.1:{free_port()}"
    fs = tmp_path / "fs"
    server = make_server("--l2", f"fs:path={fs},size_gb=0.01", "--kv-events-endpoint", pub)
    router = Router(pub)
    time.sleep(0.3)
    tokens = [seed + t for t in range(4 * CHUNK)]
    kv = np.ones((2, LAYOUT.num_layers, 4 * CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    try:
        with KVClient(server.ipc_url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as client:
            assert client.store(tokens, kv) == 4 * CHUNK
            hashes = client.hashes(tokens)
            wait_store_idle(server)
            router.drain()
            assert router.media.get("FS") == set(hashes) == held_in_fs(fs)
            for scope in ("tiers", "all"):
                r = httpx.request("DELETE", f"{server.http}/cache/prefix", json={"token_ids": tokens, "scope": scope}, timeout=30)
                assert r.status_code == 200, r.text
                router.drain()
                assert held_in_fs(fs) == set()
                assert router.media.get("FS", set()) == held_in_fs(fs), f"scope {scope}: the router still sees deleted FS blocks"
                client.store(tokens, kv)  # for the next scope (L1 may still hold it under scope tiers)
                wait_store_idle(server)
                router.drain()
    finally:
        router.close()


def test_an_fs_object_found_gone_on_load_leaves_the_routers_tier_view(make_server, tmp_path, seed):
    """Files removed behind the tier's back (an operator freeing the disk, a cleaner): the load that
    finds one gone drops it from the tier's index, and a router must hear of it too, else it routes to
    this server for FS blocks nobody holds, for good (the tier never evicts what it no longer indexes)."""
    pub = f"tcp://127.0.0.1:{free_port()}"
    fs = tmp_path / "fs"
    server = make_server("--l2", f"fs:path={fs},size_gb=0.01", "--kv-events-endpoint", pub)
    router = Router(pub)
    time.sleep(0.3)
    tokens = [seed + t for t in range(2 * CHUNK)]
    kv = np.ones((2, LAYOUT.num_layers, 2 * CHUNK, LAYOUT.num_kv_heads, LAYOUT.head_dim), np.float16)
    try:
        with KVClient(server.ipc_url, MODEL, LAYOUT, options=ClientOptions(transport="inline")) as client:
            assert client.store(tokens, kv) == 2 * CHUNK
            hashes = client.hashes(tokens)
            wait_store_idle(server)
            server.clear()  # L1 only: the next lookup asks the tier
            router.drain()
            assert router.media.get("FS") == set(hashes) == held_in_fs(fs)
            for root, _, files in os.walk(fs):
                for name in files:
                    if not name.startswith("."):
                        os.unlink(os.path.join(root, name))
            session = client.session("gone")
            hits = session.lookup(hashes)
            while hits is None:
                hits = session.status()
            assert hits == 0
            router.drain()
            assert server.status()["tiers"][0]["objects"] == 0
            assert router.media.get("FS", set()) == held_in_fs(fs) == set(), "the router still sees FS blocks the tier found gone"
    finally:
        router.close()
