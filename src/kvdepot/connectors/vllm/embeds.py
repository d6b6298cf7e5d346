"""What a request's prompt embeddings contribute to its keys (vLLM's ``--enable-prompt-embeds``).

A prompt given as embeddings has placeholder token ids (zeros) where its rows go: the KV of a chunk there
comes from the rows, so the chunk names them, a sha256 of the rows' bytes with their dtype and width
(vLLM's own block hashes name them by the same digest), and of which positions are rows in a prompt
that mixes rows and tokens. It goes into the chunk's link (``hashing.chunk_hashes``' ``extras``), and
through the chain into every later chunk. The same rows in another dtype are other keys: a miss, never
another request's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def embeds_extras(embeds: Any, is_token: Sequence[bool] | None, first_chunk: int, end_chunk: int, chunk_size: int) -> list[bytes] | None:
    """Per chunk of ``[first_chunk, end_chunk)``, the bytes that name its prompt-embedding rows (b"" for
    a chunk past them); None when no chunk there has any. ``embeds``: vLLM's ``prompt_embeds`` tensor,
    one row per prompt position; ``is_token``: its per-position mask in a mixed prompt (else None)."""
    rows = int(embeds.shape[0])
    if first_chunk * chunk_size >= rows:
        return None
    import torch  # the engine's: only a request that carries a tensor gets here

    kind = f"{embeds.dtype}/{tuple(embeds.shape[1:])}".encode()
    extras = []
    for c in range(first_chunk, end_chunk):
        lo, hi = c * chunk_size, min((c + 1) * chunk_size, rows)
        if lo >= rows:
            extras.append(b"")
            continue
        block = embeds[lo:hi].detach().contiguous().cpu().view(torch.uint8).numpy()
        mask = bytes(1 if t else 0 for t in is_token[lo:hi]) if is_token is not None else b""
        extras.append(b"embeds\0" + kind + b"\0" + hashlib.sha256(block).digest() + hashlib.sha256(mask).digest())
    return extras
