"""``ChunkHashCache``: vLLM's own prefix hash at a chunk's end -> kvdepot's hashes of the chunks up to
there, so a prefix this engine has seen before is not hashed again. Turning 32k tokens of a Python
list into bytes and hashing them costs the scheduler ~0.2-0.4 ms per new request; one dict lookup for
the whole prompt, a microsecond.

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
    """Each entry: vLLM's hash at the end of chunk ``i`` -> the chain of kvdepot hashes of chunks
    ``0..i`` (a slice of one tuple shared by every entry of the prompt that put it). So a prompt seen
    before costs one dict lookup however long it is (a 32k-token prompt has 128 chunks: one lookup, not
    128), and a prompt that shares only a prefix finds the longest cached one by bisection. Entries go
    least recently used first, past ``capacity`` entries (chunk ends)."""

    def __init__(self, chunk_tokens: int, hash_block_tokens: int, capacity: int = 65536) -> None:
        if chunk_tokens % hash_block_tokens:
            raise ValueError(f"chunk of {chunk_tokens} tokens is not whole vLLM hash blocks of {hash_block_tokens}")
        self._blocks_per_chunk = chunk_tokens // hash_block_tokens
        self._capacity = capacity
        self._map: OrderedDict[bytes | tuple[bytes, bytes], tuple[tuple[ChunkHash, ...], int]] = OrderedDict()
        self._algorithm: object = None
        self.hits = 0  # chunks whose hash came from the cache
        self.misses = 0  # chunks the caller had to hash after asking

    def __repr__(self) -> str:
        return f"ChunkHashCache({len(self._map)}/{self._capacity}, hits={self.hits}, misses={self.misses})"

    def use(self, algorithm: object) -> None:
        """kvdepot's hash algorithm (the server's): a change empties the cache, whose hashes were made
        with the other one."""
        if algorithm != self._algorithm:
            self._map.clear()
            self._algorithm = algorithm

    def known(self, block_hashes: Sequence[bytes], have: int, n_chunks: int, root: bytes = b"") -> tuple[ChunkHash, ...]:
        """The chain of chunk hashes of this prefix, as far as it is cached, up to ``n_chunks`` chunks;
        empty when nothing past the ``have`` chunks the caller already holds is cached. Chunks whose end
        vLLM has not hashed yet are never known. ``root``: where the chain starts (a LoRA adapter's root,
        adapters.py): vLLM's hashes name an adapter by its name and path only, and an adapter reloaded
        in place keeps both but gets a new root."""
        top = min(n_chunks, len(block_hashes) // self._blocks_per_chunk)
        if top <= have:
            return ()
        bpc = self._blocks_per_chunk
        entries = self._map
        end = top - 1
        key = _keyer(root)
        found = entries.get(key(block_hashes[(end + 1) * bpc - 1]))
        if found is None:  # a prefix of it, maybe: bisect for the last cached chunk end in [have, end)
            lo, hi = have, end
            while lo < hi:
                mid = (lo + hi) // 2
                got = entries.get(key(block_hashes[(mid + 1) * bpc - 1]))
                if got is None:
                    hi = mid
                else:
                    end, found, lo = mid, got, mid + 1
            if found is None:
                self.misses += top - have
                return ()
        entries.move_to_end(key(block_hashes[(end + 1) * bpc - 1]))
        chain, length = found
        self.hits += length - have
        self.misses += top - length
        return chain[:length]

    def put(self, block_hashes: Sequence[bytes], start: int, chain: Sequence[ChunkHash], root: bytes = b"") -> None:
        """Remember chunks ``start..len(chain)-1`` of this prefix's chain (those whose end vLLM has hashed),
        a chain that starts from ``root``."""
        bpc = self._blocks_per_chunk
        last = min(len(chain), len(block_hashes) // bpc)
        if last <= start:
            return
        frozen = tuple(chain[:last])
        entries = self._map
        keyer = _keyer(root)
        for i in range(start, last):
            key = keyer(block_hashes[(i + 1) * bpc - 1])
            entries[key] = (frozen, i + 1)
            entries.move_to_end(key)
        while len(entries) > self._capacity:
            entries.popitem(last=False)


def _keyer(root: bytes):
    """The cache key of a vLLM prefix hash for a chain from ``root`` (the hash alone for the base model)."""
    if not root:
        return lambda h: h
    return lambda h: (root, h)
