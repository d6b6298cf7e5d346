"""The vLLM scheduler's hash cache: vLLM's prefix hash at a chunk's end -> kvdepot's chain of chunk
hashes up to there."""

from __future__ import annotations

import pytest

from kvdepot.connectors.vllm.hash_cache import ChunkHashCache
from kvdepot.types import ChunkHash

C = [ChunkHash(bytes([100 + i])) for i in range(8)]


def test_a_chain_is_keyed_by_vllms_hash_of_the_block_that_ends_each_chunk():
    cache = ChunkHashCache(chunk_tokens=64, hash_block_tokens=16, capacity=16)  # 4 vLLM blocks a chunk
    blocks = [bytes([i]) * 8 for i in range(12)]
    cache.put(blocks, 0, C[:3])
    assert cache.known(blocks, 0, 3) == tuple(C[:3])
    assert cache.known(blocks, 0, 2) == tuple(C[:2])  # asked for fewer chunks
    other = [b"x" * 8] * 3 + [blocks[3]] + [b"y" * 8] * 8  # same block 3: the same prefix to chunk 0's end
    assert cache.known(other, 0, 3) == (C[0],)  # the longest cached prefix, found by bisection
    assert cache.known(blocks[:7], 0, 3) == (C[0],)  # vLLM has hashed only up to chunk 0's end
    assert cache.known(blocks, 3, 3) == ()  # the caller holds all it asks for
    assert cache.known([b"z" * 8] * 12, 0, 3) == ()
    cache.put(blocks[:7], 1, C[:2])  # chunk 1's end is not hashed by vLLM yet: nothing to key it by
    assert cache.known(blocks[:8], 0, 2) == tuple(C[:2])  # still the first put's chain
    assert cache.hits == 3 + 2 + 1 + 1 + 2 and cache.misses == 2 + 3


def test_a_caller_holding_part_of_the_chain_gets_the_rest():
    cache = ChunkHashCache(chunk_tokens=16, hash_block_tokens=16)
    blocks = [bytes([i]) for i in range(6)]
    cache.put(blocks, 0, C[:2])
    cache.put(blocks, 2, C[:5])  # the prompt grew: chunks 2..4 hashed after 0..1 came from the cache
    assert cache.known(blocks, 2, 5) == tuple(C[:5])
    assert cache.known(blocks, 0, 6) == tuple(C[:5])  # chunk 5 was never put


def test_the_least_recently_used_entries_go_past_the_capacity():
    cache = ChunkHashCache(chunk_tokens=16, hash_block_tokens=16, capacity=2)
    a = [b"a0", b"a1"]
    b = [b"b0"]
    cache.put(a, 0, C[:2])
    assert cache.known(a[:1], 0, 1) == (C[0],)  # a0 is now the most recent
    cache.put(b, 0, [C[7]])  # over capacity: a1 goes
    assert cache.known(a, 0, 2) == (C[0],) and cache.known(b, 0, 1) == (C[7],)


def test_a_chunk_that_is_not_whole_hash_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole vLLM hash blocks"):
        ChunkHashCache(chunk_tokens=40, hash_block_tokens=16)


def test_another_hash_algorithm_empties_it():
    cache = ChunkHashCache(chunk_tokens=16, hash_block_tokens=16)
    blocks = [b"a"]
    cache.use("sha256")
    cache.put(blocks, 0, [ChunkHash(b"s")])
    cache.use("sha256")
    assert cache.known(blocks, 0, 1) == (b"s",)
    cache.use("blake3")  # the server came back with another algorithm
    assert cache.known(blocks, 0, 1) == ()
