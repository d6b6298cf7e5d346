"""Object identity: a namespace digest for (model, rank, layout, chunk size, salt) + the chunk hash.

Different salts, models, ranks or layouts land in different namespaces, so they can never read each
other's bytes even when their token chains are equal. A bottom-layer module: the server builds keys
from a registered context, storage and the tiers only carry them, and the peer tier names objects by
them across nodes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvdepot.types import NAMESPACE_BYTES


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    model: str
    world_size: int
    rank: int
    layout_fingerprint: str
    chunk_size: int

    def digest(self, cache_salt: str = "") -> bytes:
        h = hashlib.sha256()
        for part in (
            self.model,
            str(self.world_size),
            str(self.rank),
            self.layout_fingerprint,
            str(self.chunk_size),
            cache_salt,
        ):
            encoded = part.encode()
            h.update(len(encoded).to_bytes(4, "little"))  # length-prefixed: no ambiguous joins
            h.update(encoded)
        return h.digest()[:NAMESPACE_BYTES]

