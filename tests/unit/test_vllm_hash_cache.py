"""The vLLM scheduler's hash cache: vLLM's prefix hash at a chunk's end -> kvdepot's chunk hash."""

from __future__ import annotations

import pytest

from kvdepot.connectors.vllm.hash_cache import ChunkHashCache
from kvdepot.types import ChunkHash


def test_a_chunk_is_keyed_by_vllms_hash_of_the_block_that_ends_it():
    cache = ChunkHashCache(chunk_tokens=64, hash_block_tokens=16, capacity=8)  # 4 vLLM blocks a chunk
    blocks = [bytes([i]) * 8 for i in range(12)]
    cache.put(blocks, 0, ChunkHash(b"c0"))
    cache.put(blocks, 1, ChunkHash(b"c1"))
    other = [b"x" * 8] * 3 + [blocks[3]] + [b"y" * 8] * 4  # same block 3: the same prefix to chunk 0's end
    assert cache.get(other, 0) == b"c0"
    assert cache.get(other, 1) is None  # its block 7 differs
    assert cache.get(blocks[:7], 1) is None  # vLLM has not hashed that far yet
    cache.put(blocks[:7], 1, ChunkHash(b"never"))  # nothing to key it by: not kept
    assert cache.get(blocks, 1) == b"c1"
    assert (cache.hits, cache.misses) == (2, 2)


def test_the_oldest_entries_go_past_the_capacity():
    cache = ChunkHashCache(chunk_tokens=16, hash_block_tokens=16, capacity=2)
    blocks = [bytes([i]) for i in range(3)]
    for i in range(3):
        cache.put(blocks, i, ChunkHash(bytes([100 + i])))
    assert cache.get(blocks, 0) is None and cache.get(blocks, 2) == bytes([102])


def test_a_chunk_that_is_not_whole_hash_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole vLLM hash blocks"):
        ChunkHashCache(chunk_tokens=40, hash_block_tokens=16)


def test_another_hash_algorithm_empties_it():
    cache = ChunkHashCache(chunk_tokens=16, hash_block_tokens=16)
    blocks = [b"a"]
    cache.use("sha256")
    cache.put(blocks, 0, ChunkHash(b"s"))
    cache.use("sha256")
    assert cache.get(blocks, 0) == b"s"
    cache.use("blake3")  # the server came back with another algorithm
    assert cache.get(blocks, 0) is None
