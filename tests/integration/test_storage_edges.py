"""Edges of the L2 tiers that a production deployment meets: a backend that fills up, and a tier that
holds many objects. Real servers on loopback (``support.plugin``)."""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import valkey

from kvdepot.storage.l2.fs_adapter import FsAdapter, FsConfig
from kvdepot.storage.l2.memory_adapter import MemoryAdapter, MemoryConfig, _Stored
from kvdepot.storage.l2.valkey_adapter import ValkeyAdapter
from kvdepot.types import ObjectKey

from support.adapter_tasks import load, store
from support.backends import ValkeyServer, valkey_config

MiB = 1 << 20


def new_key() -> bytes:
    return os.urandom(48)


# --- valkey: a server at maxmemory ---------------------------------------------------------------------


@pytest.fixture
def full_valkey(own_valkey: ValkeyServer):
    """(adapter, raw client, fill): a tier on a server of its own, ``fill()`` makes the server refuse
    writes the way a server at ``maxmemory`` under Valkey's default ``noeviction`` policy does."""
    raw = valkey.Valkey.from_url(own_valkey.url)
    adapter = ValkeyAdapter("full", valkey_config(own_valkey.url, max_value_mib=1))
    adapter.start()
    yield adapter, raw, lambda: raw.config_set("maxmemory", 1)
    adapter.close()
    raw.close()


@pytest.mark.parametrize("size", [1000, 3 * MiB], ids=["inline", "parts"])
def test_a_full_valkey_refuses_new_objects_and_still_serves_the_stored_ones(full_valkey, size):
    """Valkey at maxmemory with ``noeviction`` (its default) answers every write with OOM. That is the
    server refusing one object, not a dead server: it used to open the tier's breaker on every store,
    and the objects already stored could not be loaded either (the tier was down for good while the
    store controller kept pushing)."""
    adapter, raw, fill = full_valkey
    kept, kept_value = new_key(), os.urandom(size)
    assert store(adapter, kept, kept_value).value == [True]
    fill()
    refused = new_key()
    result = store(adapter, refused, os.urandom(size))
    assert result.ok and result.value == [False], result
    assert list(raw.scan_iter(match=adapter.manifest_name(refused) + b"*")) == []  # no part left behind
    usage = adapter.usage()
    assert (usage.healthy, usage.failures) == (True, 0), usage
    result, got = load(adapter, kept, size)
    assert result.ok and result.value == [True] and got == kept_value, result



# --- fs and memory: a tier with many objects ----------------------------------------------------------


class CountingTable(OrderedDict):
    """A tier's table (oldest first) that counts the entries a put looks at."""

    looked = 0

    def __iter__(self):
        for key in super().__iter__():
            self.looked += 1
            yield key

    def items(self):
        for key in super().__iter__():
            self.looked += 1
            yield key, self[key]


N, SIZE = 10_000, 4096


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_an_fs_put_looks_at_no_more_of_the_index_than_it_evicts(tmp_path, full):
    """A put costs what it writes and evicts, not what the tier holds: it copied the whole index under the
    lock every lookup and load take, on every put (~40 ms at 300k objects, ~0.3 s at a million)."""
    capacity_gb = N * SIZE / (1 << 30) if full else 1000.0  # full: the next put evicts the oldest
    adapter = FsAdapter("big", FsConfig(path=str(tmp_path / "fs"), size_gb=capacity_gb, fsync=False))
    adapter.start()
    try:
        with adapter._mu:  # a tier that indexed many objects (their files play no part in a put)
            index = CountingTable((ObjectKey(i.to_bytes(48, "big")), SIZE) for i in range(N))
            adapter._index, adapter._used = index, N * SIZE
        index.looked = 0
        adapter.put_now(ObjectKey(new_key()), memoryview(os.urandom(SIZE)))
        evicted = N + 1 - len(adapter._index)
        assert (evicted > 0) == full
        assert index.looked <= evicted + 1, f"a put looked at {index.looked} of {N} entries to evict {evicted}"
        assert adapter._used <= adapter._capacity
    finally:
        adapter.close()


@pytest.mark.parametrize("full", [False, True], ids=["room", "full"])
def test_a_memory_tier_put_looks_at_no_more_of_the_table_than_it_evicts(full):
    """The memory tier's put copied its whole table the same way."""
    adapter = MemoryAdapter("big", MemoryConfig(size_gb=N * SIZE / (1 << 30) if full else 1000.0))
    adapter.start()
    try:
        body = memoryview(bytearray(SIZE))
        with adapter._mu:
            table = CountingTable((ObjectKey(i.to_bytes(48, "big")), _Stored(b"", body)) for i in range(N))
            adapter._objects, adapter._used = table, N * SIZE
        table.looked = 0
        adapter.put_now(ObjectKey(new_key()), memoryview(os.urandom(SIZE)))
        evicted = N + 1 - len(adapter._objects)
        assert (evicted > 0) == full
        assert table.looked <= evicted + 1, f"a put looked at {table.looked} of {N} entries to evict {evicted}"
    finally:
        adapter.close()
