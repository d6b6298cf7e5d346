"""``ChunkHashCache``: vLLM's own prefix hash at a chunk's end -> kvdepot's hash of that chunk, so a
prefix this engine has seen before is not hashed again. Turning 32k tokens of a Python list into bytes
and hashing them costs the scheduler ~0.2-0.4 ms per new request; a dict lookup per chunk, a few µs.

Sound only where vLLM's prefix hash is collision resistant. vLLM chains it over every token of the
prefix (and the request's extra keys: salt, LoRA, media), so with its sha256 hashes equal vLLM hashes
mean equal tokens, and equal tokens mean equal kvdepot chains. With ``xxhash`` prefix caching the
cache is off: a collision there would hand a request another prompt's KV. vLLM's hashes are seeded
per process, and so is this cache (one per scheduler).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvdepot.types import ChunkHash

SAFE_VLLM_HASHES = ("sha256", "sha256_cbor")


class ChunkHashCache:
    def __init__(self, chunk_tokens: int, hash_block_tokens: int, capacity: int = 65536) -> None:
        if chunk_tokens % hash_block_tokens:
            raise ValueError(f"chunk of {chunk_tokens} tokens is not whole vLLM hash blocks of {hash_block_tokens}")
        self._blocks_per_chunk = chunk_tokens // hash_block_tokens
        self._capacity = capacity
        self._map: OrderedDict[bytes, ChunkHash] = OrderedDict()
        self._algorithm: object = None
        self.hits = 0
        self.misses = 0

    def __repr__(self) -> str:
        return f"ChunkHashCache({len(self._map)}/{self._capacity}, hits={self.hits}, misses={self.misses})"

    def use(self, algorithm: object) -> None:
        """kvdepot's hash algorithm (the server's): a change empties the cache, whose hashes were made
        with the other one."""
        if algorithm != self._algorithm:
            self._map.clear()
            self._algorithm = algorithm

    def _key(self, block_hashes: Sequence[bytes], chunk: int) -> bytes | None:
        index = (chunk + 1) * self._blocks_per_chunk - 1
        return block_hashes[index] if index < len(block_hashes) else None

    def get(self, block_hashes: Sequence[bytes], chunk: int) -> ChunkHash | None:
        """Chunk ``chunk``'s hash if this prefix was seen (vLLM has hashed the blocks up to its end)."""
        key = self._key(block_hashes, chunk)
        found = self._map.get(key) if key is not None else None
        if found is None:
            self.misses += 1
            return None
        self._map.move_to_end(key)
        self.hits += 1
        return found

    def put(self, block_hashes: Sequence[bytes], chunk: int, chunk_hash: ChunkHash) -> None:
        key = self._key(block_hashes, chunk)
        if key is None:
            return
        self._map[key] = chunk_hash
        self._map.move_to_end(key)
        if len(self._map) > self._capacity:
            self._map.popitem(last=False)
