"""The memory tier reuses removed objects' buffers for later stores, never one a load is reading."""

from __future__ import annotations

import threading

import numpy as np

from kvdepot.storage.l2 import memory_adapter
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig

SIZE = 1 << 20


def payload(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def address(buf) -> int:
    return np.frombuffer(buf, np.uint8).ctypes.data


def test_a_removed_objects_buffer_takes_the_next_store_of_its_size():
    tier = MemoryAdapter("mem", MemoryConfig(size_gb=0.125))
    tier._put(b"a" * 48, memoryview(payload(1)))
    first = address(tier._objects[b"a" * 48].body)
    tier._delete(b"a" * 48)
    tier._put(b"b" * 48, memoryview(payload(2)))
    assert address(tier._objects[b"b" * 48].body) == first
    out = np.empty(SIZE, np.uint8)
    assert tier._get_into(b"b" * 48, memoryview(out)) and np.array_equal(out, payload(2))
    # Evictions feed the spares too: a full tier stores into what it just evicted.
    keys = [bytes([i]) * 48 for i in range(200)]
    for i, key in enumerate(keys):
        tier._put(key, memoryview(payload(i)))
    used, capacity, count = tier._usage()
    assert used <= capacity and count < len(keys)
    assert tier._spare_bytes <= tier._spare_limit
    for i, key in enumerate(keys[-count:], start=len(keys) - count):
        assert tier._get_into(key, memoryview(out)) and np.array_equal(out, payload(i))


def test_a_buffer_a_load_is_reading_is_never_reused(monkeypatch):
    tier = MemoryAdapter("mem", MemoryConfig(size_gb=0.125))
    a, b, c = b"a" * 48, b"b" * 48, b"c" * 48
    tier._put(a, memoryview(payload(1)))
    being_read = address(tier._objects[a].body)
    inside, go = threading.Event(), threading.Event()
    real_copy = memory_adapter.envelope.copy_verified

    def slow_copy(*args):
        inside.set()
        assert go.wait(10)
        return real_copy(*args)

    monkeypatch.setattr(memory_adapter.envelope, "copy_verified", slow_copy)
    out = np.zeros(SIZE, np.uint8)
    loaded: list[bool] = []
    reader = threading.Thread(target=lambda: loaded.append(tier._get_into(a, memoryview(out))))
    reader.start()
    try:
        assert inside.wait(10)
        tier._delete(a)  # removed while the load copies out of it
        tier._put(b, memoryview(payload(2)))
        assert address(tier._objects[b].body) != being_read, "a store reused a buffer a load was reading"
    finally:
        go.set()
        reader.join(10)
    assert loaded == [True] and np.array_equal(out, payload(1))
    monkeypatch.setattr(memory_adapter.envelope, "copy_verified", real_copy)
    # Once nobody reads it, a removed buffer is reused.
    reused = address(tier._objects[b].body)
    tier._delete(b)
    tier._put(c, memoryview(payload(3)))
    assert address(tier._objects[c].body) == reused
