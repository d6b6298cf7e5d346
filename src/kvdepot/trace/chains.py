"""Block ids to chunk hashes, the same way every time: block ``b`` is the token pattern
``[b mod 2**32, b div 2**32, 2, 3, ..., block_tokens - 1]``, and a request's chunk hashes are the chain
over its blocks' patterns (``kvdepot.hashing``). Equal leading block ids give equal leading hashes;
any difference in a prefix changes every hash after it, as with real prompts.

A recording's block ids are chain hashes already (their first 8 bytes: each names its chunk given all
before it), and its STOREs and RETRIEVEs may name a chain's tail alone (an engine stores the chunks past
its hit): ``hashes_of_ids`` maps each such id to a hash of its own, the same wherever it appears."""

from __future__ import annotations

import numpy as np

from kvdepot.hashing import HashAlgorithm, chunk_hashes
from kvdepot.types import ChunkHash

_MAX_CACHED = 1 << 20  # (prefix hash, block id) pairs kept; past that the cache starts over


class BlockChains:
    def __init__(self, block_tokens: int, algorithm: HashAlgorithm) -> None:
        if block_tokens < 2:
            raise ValueError(f"blocks of {block_tokens} token(s) cannot hold a 64-bit block id; need at least 2")
        self.block_tokens = block_tokens
        self.algorithm = algorithm
        self._pattern = np.arange(block_tokens, dtype="<u4")
        self._cache: dict[tuple[bytes | None, int], ChunkHash] = {}

    def tokens(self, block: int) -> np.ndarray:
        t = self._pattern.copy()
        t[0], t[1] = block & 0xFFFFFFFF, (block >> 32) & 0xFFFFFFFF
        return t

    def hashes_of_ids(self, blocks: tuple[int, ...]) -> list[ChunkHash]:
        """One hash per block id, independent of the ids before it (ids that name chain positions)."""
        out: list[ChunkHash] = []
        cache = self._cache
        for b in blocks:
            h = cache.get((None, b))
            if h is None:
                h = chunk_hashes(self.tokens(b), self.block_tokens, self.algorithm)[0]
                if len(cache) >= _MAX_CACHED:
                    cache.clear()
                cache[(None, b)] = h
            out.append(h)
        return out

    def hashes(self, blocks: tuple[int, ...]) -> list[ChunkHash]:
        out: list[ChunkHash] = []
        prev = b""
        cache = self._cache
        for b in blocks:
            h = cache.get((prev, b))
            if h is None:
                h = chunk_hashes(self.tokens(b), self.block_tokens, self.algorithm, prefix=prev)[0]
                if len(cache) >= _MAX_CACHED:
                    cache.clear()
                cache[(prev, b)] = h
            out.append(h)
            prev = h
        return out
