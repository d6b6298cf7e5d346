"""The L2 envelope's one-pass copy and checksum gives the same checksum as hashing the bytes apart."""

from __future__ import annotations

import numpy as np
import pytest

from kvdepot.storage.l2 import envelope


@pytest.mark.parametrize("size", [0, 1, envelope.PIECE_BYTES - 1, envelope.PIECE_BYTES, 3 * envelope.PIECE_BYTES + 17])
def test_copy_hashed_copies_every_byte_and_hashes_them(size) -> None:
    key = b"k" * 48
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    running = envelope.start_checksum(key)
    envelope.copy_hashed(running, src.tobytes(), memoryview(dst))
    assert np.array_equal(src, dst)
    assert running.digest() == envelope.checksum(key, src)


def test_decode_into_round_trips_and_rejects_any_flipped_byte() -> None:
    key = b"q" * 48
    payload = np.random.default_rng(1).integers(0, 256, 2 * envelope.PIECE_BYTES + 5, dtype=np.uint8)
    stored = envelope.encode(key, payload)
    out = np.zeros_like(payload)
    envelope.decode_into(key, stored, memoryview(out))
    assert np.array_equal(out, payload)
    for offset in (envelope.HEADER_BYTES, envelope.HEADER_BYTES + len(key), len(stored) - 1):
        bad = bytearray(stored)
        bad[offset] ^= 0x01
        with pytest.raises(envelope.CorruptObject):
            envelope.decode_into(key, bytes(bad), memoryview(np.zeros_like(payload)))
    with pytest.raises(envelope.CorruptObject):
        envelope.decode_into(b"r" * 48, stored, memoryview(out))
