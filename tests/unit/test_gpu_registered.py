"""``kvdepot.client.blocks.RegisteredKVCache`` when the server forgets the cache under a worker's threads
(a server restart): a load waits on the events of the registration its retrieve ran under, not on those
of a registration another thread made meanwhile (never recorded by that retrieve's copies: a wait on
them would let the forward read blocks still being written); and of the threads told at once, one
registers again (two would leave the server an orphaned cache).

The link and CUDA's events are fakes here; on a GPU the events are real (tests/gpu/test_cuda_paths.py),
but a re-registration racing a load needs a server that forgets a cache while a worker loads: not run."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from kvdepot.client import blocks
from kvdepot.client.blocks import RegisteredKVCache
from kvdepot.errors import UnknownKVCache
from kvdepot.gpu.memory import ExportedCache
from kvdepot.protocol import messages as m


class Event:
    """An opened server event: what waited on it."""

    def __init__(self, handle: bytes) -> None:
        self.handle = handle
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


class Stream:
    def __init__(self) -> None:
        self.waited: list[Event] = []

    def wait_event(self, event: Event) -> None:
        self.waited.append(event)


class Server:
    """The server's side of the link: registrations (each with layer events of its own), and a cache it
    forgets (``forget``); a retrieve of a forgotten cache answers UNKNOWN_KV_CACHE."""

    def __init__(self, layers: int = 2, register_s: float = 0.0, barrier: threading.Barrier | None = None) -> None:
        self.ids = itertools.count(1)
        self.known: set[int] = set()
        self.registrations = 0
        self.layers, self.register_s, self.barrier = layers, register_s, barrier

    def forget(self) -> None:
        self.known.clear()

    def request(self, body, timeout_s: float | None = None):
        if isinstance(body, m.RegisterKVCacheRequest):
            time.sleep(self.register_s)
            cache_id = next(self.ids)
            self.known.add(cache_id)
            self.registrations += 1
            handles = [f"cache {cache_id} layer {layer}".encode() for layer in range(self.layers)]
            return m.RegisterKVCacheReply(cache_id=cache_id, num_blocks=8, layer_events=handles)
        if body.cache_id not in self.known:
            if self.barrier is not None:
                self.barrier.wait(timeout=5)  # every thread is told before any registers again
            raise UnknownKVCache(f"no kv cache {body.cache_id}")
        if isinstance(body, m.StoreBlocksRequest):
            return m.StoreBlocksReply(statuses=[])
        return m.RetrieveBlocksReply(found=1)


@pytest.fixture(autouse=True)
def fake_events(monkeypatch):
    monkeypatch.setattr(blocks, "open_event", lambda handle, device: Event(handle))


def registered(server: Server) -> RegisteredKVCache:
    cache = RegisteredKVCache(server, ExportedCache([], []), 4, 0)
    cache.register()
    return cache


def test_a_load_waits_on_the_events_its_retrieve_ran_under_after_another_thread_registers_again():
    server = Server()
    cache = registered(server)
    found, copies = cache.retrieve_copies([b"h" * 16], [[0]])
    assert found == 1 and copies.kind == "cuda_ipc"
    server.forget()  # the server restarted: the saver thread's next store registers again
    cache.store([b"h" * 16], [[0]])
    assert cache.cache_id == 2

    stream = Stream()
    copies.wait_layer(0, stream)
    copies.wait_all(stream)
    copies.synchronize()
    assert [e.handle for e in stream.waited] == [b"cache 1 layer 0", b"cache 1 layer 1"]  # what its copies record
    assert copies.events[-1].synchronized == 1
    now = Stream()
    cache.wait_all(now)  # the cache's own: as registered now
    assert [e.handle for e in now.waited] == [b"cache 2 layer 1"]


def test_a_retrieve_redone_after_registering_again_waits_on_the_new_events():
    server = Server()
    cache = registered(server)
    server.forget()
    found, copies = cache.retrieve_copies([b"h" * 16], [[0]])
    assert found == 1 and [e.handle for e in copies.events] == [b"cache 2 layer 0", b"cache 2 layer 1"]


def test_threads_told_at_once_that_the_cache_is_forgotten_register_it_once():
    server = Server(register_s=0.2, barrier=threading.Barrier(2))
    cache = registered(server)
    server.forget()
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(cache.retrieve([b"h" * 16], [[0]]))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert results == [1, 1]
    assert server.registrations == 2 and cache.cache_id == 2  # the first registration, and one again
