"""What a request's images, audio and video contribute to its keys.

vLLM puts a run of placeholder tokens in the prompt where each media item goes; the KV of those
positions (and of every token after them) comes from the item, not from the placeholder ids, which are
the same for every image. So a chunk that holds any of an item's placeholders names the item: its
identifier (vLLM's content hash of the item and its processor settings, or the ``multi_modal_uuids`` a
caller gave), its modality and where its placeholders lie. That goes into the chunk's link
(``hashing.chunk_hashes``' ``extras``), and so into every later chunk's hash through the chain: the same
text with another image shares nothing after the image, and the same image in the same place hits.
vLLM's own prefix hashes name media the same way (its ``("mm", identifier, offset)`` extra keys).

A caller's ``multi_modal_uuids`` are trusted as vLLM trusts them: a uuid reused for other content
would hand a request KV of the other content, here across engines and restarts as in vLLM's own cache.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

_FIELD = struct.Struct("<I")
_SPAN = struct.Struct("<QQ")


def _field(value: str) -> bytes:
    raw = value.encode()
    return _FIELD.pack(len(raw)) + raw


def media_extras(features: Sequence[Any], first_chunk: int, end_chunk: int, chunk_size: int) -> list[bytes] | None:
    """Per chunk of ``[first_chunk, end_chunk)``, the bytes that name the media items whose placeholders
    it holds (b"" for none); None when no chunk there holds any (the plain, faster chain)."""
    start, end = first_chunk * chunk_size, end_chunk * chunk_size
    touching = []
    for f in features:
        pos = f.mm_position
        if pos.offset < end and pos.offset + pos.length > start:
            touching.append((pos.offset, pos.length, _field(f.modality) + _field(f.identifier) + _SPAN.pack(pos.offset, pos.length)))
    if not touching:
        return None
    extras = [b""] * (end_chunk - first_chunk)
    for offset, length, named in sorted(touching):  # by position: vLLM's order, and one order for all
        lo = max(offset, start) // chunk_size - first_chunk
        hi = (min(offset + length, end) - 1) // chunk_size - first_chunk
        for c in range(lo, hi + 1):
            extras[c] += named
    return extras


def first_offset(features: Sequence[Any], after: int = 0) -> int | None:
    """The smallest placeholder offset among ``features[after:]`` (None: there are none)."""
    rest = features[after:]
    return min((f.mm_position.offset for f in rest), default=None)
