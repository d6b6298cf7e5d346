"""Chained chunk hashing (kvdepot.hashing): exact digests, chain structure, input validation."""

from __future__ import annotations

import array
import hashlib
import struct

import blake3
import numpy as np
import pytest
import xxhash

from kvdepot.hashing import HashAlgorithm, chunk_hashes, tokens_to_bytes


def sha256_chain(tokens: list[int], chunk_size: int) -> list[bytes]:
    """Independent reference: SGLang HiCache's page key, h_i = sha256(h_{i-1} + uint32le(tokens))."""
    out, prev = [], b""
    for i in range(len(tokens) // chunk_size):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{chunk_size}I", *chunk)).digest()
        out.append(prev)
    return out


def test_sha256_chain_equals_independent_hashlib_computation():
    tokens = [0, 1, 2, 3, 70000, 2**32 - 1, 42, 7, 9, 9, 9]  # 11 tokens: 2 complete chunks of 4, 3 left over
    got = chunk_hashes(tokens, 4, "sha256")
    assert got == sha256_chain(tokens, 4)
    assert len(got) == 2


def test_first_hash_is_plain_digest_of_first_chunk_bytes():
    got = chunk_hashes([1, 2], 2)
    assert got == [hashlib.sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00").digest()]


def test_blake3_and_xxh3_chains_match_their_libraries():
    tokens = list(range(6))
    b0 = blake3.blake3(struct.pack("<3I", 0, 1, 2)).digest()
    b1 = blake3.blake3(b0 + struct.pack("<3I", 3, 4, 5)).digest()
    assert chunk_hashes(tokens, 3, HashAlgorithm.BLAKE3) == [b0, b1]
    x0 = xxhash.xxh3_128(struct.pack("<3I", 0, 1, 2)).digest()
    x1 = xxhash.xxh3_128(x0 + struct.pack("<3I", 3, 4, 5)).digest()
    assert chunk_hashes(tokens, 3, "xxh3_128") == [x0, x1]


@pytest.mark.parametrize(
    ("algorithm", "size"),
    [(HashAlgorithm.SHA256, 32), (HashAlgorithm.BLAKE3, 32), (HashAlgorithm.XXH3_128, 16)],
)
def test_digest_sizes(algorithm, size):
    assert algorithm.digest_size == size
    hashes = chunk_hashes(list(range(12)), 4, algorithm)
    assert [len(h) for h in hashes] == [size, size, size]


@pytest.mark.parametrize(("n_tokens", "n_hashes"), [(0, 0), (1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (9, 2)])
def test_only_complete_chunks_are_hashed(n_tokens, n_hashes):
    assert len(chunk_hashes(list(range(n_tokens)), 4)) == n_hashes


def test_incomplete_tail_does_not_change_the_complete_hashes():
    base = chunk_hashes(list(range(8)), 4)
    assert chunk_hashes(list(range(8)) + [123, 456], 4) == base


def test_algorithms_give_different_chains():
    tokens = list(range(8))
    sha, b3 = chunk_hashes(tokens, 4, "sha256"), chunk_hashes(tokens, 4, "blake3")
    assert sha[0] != b3[0] and sha[1] != b3[1]


def test_prefix_continues_a_chain():
    tokens = list(range(100, 124))
    whole = chunk_hashes(tokens, 4)
    head = chunk_hashes(tokens[:8], 4)
    tail = chunk_hashes(tokens[8:], 4, prefix=head[-1])
    assert head + tail == whole
    assert len(whole) == 6


def test_prefix_changes_every_hash():
    tokens = list(range(8))
    assert all(a != b for a, b in zip(chunk_hashes(tokens, 4), chunk_hashes(tokens, 4, prefix=b"\x00" * 32)))


def test_list_and_numpy_inputs_agree():
    tokens = [5, 0, 2**32 - 1, 17, 3, 3, 1, 2]
    expected = chunk_hashes(tokens, 2)
    for arr in (
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=">u4"),  # big-endian input is converted, not reinterpreted
        np.array(tokens, dtype=np.uint64),
    ):
        assert chunk_hashes(arr, 2) == expected


def test_numpy_input_slice_non_contiguous():
    arr = np.arange(16, dtype=np.uint32)
    assert chunk_hashes(arr[::2], 4) == chunk_hashes(list(range(0, 16, 2)), 4)


def test_tokens_to_bytes_is_little_endian_uint32():
    assert bytes(tokens_to_bytes([1, 256, 2**32 - 1])) == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"
    assert bytes(tokens_to_bytes(np.array([1, 256], dtype=np.int32))) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert bytes(tokens_to_bytes([])) == b""


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [0, 2**32],
        [2**64],
        np.array([-1, 2], dtype=np.int64),
        np.array([2**32], dtype=np.int64),
        np.array([2**32], dtype=np.uint64),
        [[1, 2], [3, 4]],
        np.zeros((2, 2), dtype=np.uint32),
    ],
    ids=["neg-list", "2**32-list", "2**64-list", "neg-np", "2**32-np", "2**32-u64", "2d-list", "2d-np"],
)
def test_bad_tokens_raise_value_error(tokens):
    with pytest.raises(ValueError):
        tokens_to_bytes(tokens)
    with pytest.raises(ValueError):
        chunk_hashes(tokens, 1)


@pytest.mark.parametrize("tokens", [[1.5, 2.0], np.array([1.5, 2.0])], ids=["list", "numpy"])
def test_non_integer_tokens_raise_value_error(tokens):
    with pytest.raises(ValueError):
        tokens_to_bytes(tokens)


@pytest.mark.parametrize("chunk_size", [0, -4])
def test_non_positive_chunk_size_raises(chunk_size):
    with pytest.raises(ValueError):
        chunk_hashes([1, 2, 3, 4], chunk_size)


def test_unknown_algorithm_raises():
    with pytest.raises(ValueError):
        chunk_hashes([1, 2, 3, 4], 2, "md5")


def test_every_sequence_of_token_ids_hashes_as_the_list_does():
    # The same ids must give the same keys whatever holds them, else one engine's stores are another's
    # silent misses. bytes and bytearray are sequences of ints too (a byte-level tokenizer's ids); as
    # the initializer of array.array they were taken as raw uint32 words: a quarter of the tokens.
    tokens = [97, 98, 99, 100, 0, 255, 7, 1] * 4
    expected = chunk_hashes(tokens, 4)
    assert len(expected) == 8
    for kind in (bytes, bytearray, tuple, lambda t: array.array("q", t), lambda t: array.array("B", t),
                 lambda t: memoryview(bytes(t)), lambda t: [np.int32(x) for x in t], lambda t: np.array(t, np.uint8)):  # fmt: skip
        assert chunk_hashes(kind(tokens), 4) == expected, kind
    assert bytes(tokens_to_bytes(b"\x01\xff")) == b"\x01\x00\x00\x00\xff\x00\x00\x00"
