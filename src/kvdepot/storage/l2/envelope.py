"""How an object is written to any L2 backend: a small header, the key, then the bytes.

::

    magic "KVD2" | version u16 | key length u16 | payload length u64 | xxh3_128(key || payload) 16 B
    key bytes | payload bytes

The checksum covers key and payload, so a torn write, a bit flip, or an object filed under the wrong
name reads as corrupt: a miss, never bad KV. Nothing is ever unpickled.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVD2"
VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s")
HEADER_BYTES = _HEADER.size


class CorruptObject(Exception):
    """The stored bytes do not form a valid object for the expected key."""


class DestinationMismatch(ValueError):
    """The caller's buffer does not have the object's size: the caller's mistake, not corruption
    (the stored object is left alone)."""


class RejectedObject(Exception):
    """The backend refuses this one object (larger than the tier, tier full of pinned objects):
    a failed store of that object, not a sign that the backend is down."""


@dataclass(frozen=True, slots=True)
class Header:
    key_len: int
    payload_len: int
    checksum: bytes

    @property
    def total(self) -> int:
        return HEADER_BYTES + self.key_len + self.payload_len


def checksum(key: bytes, payload) -> bytes:
    h = xxhash.xxh3_128(key)
    h.update(payload)
    return h.digest()


def encode_header(key: bytes, payload) -> bytes:
    """The header plus the key: write these bytes, then the payload."""
    n = memoryview(payload).nbytes
    return _HEADER.pack(MAGIC, VERSION, len(key), n, checksum(key, payload)) + key


def decode_header(data: bytes | memoryview) -> Header:
    if len(data) < HEADER_BYTES:
        raise CorruptObject(f"object shorter than its header ({len(data)} bytes)")
    magic, version, key_len, payload_len, csum = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"bad magic/version {magic!r}/{version}")
    return Header(key_len, payload_len, csum)


def verify(key: bytes, header: Header, stored_key: bytes | memoryview, payload) -> None:
    """Raise CorruptObject unless ``stored_key``/``payload`` are exactly what ``header`` promises."""
    if bytes(stored_key) != key:
        raise CorruptObject("object is filed under another key")
    if memoryview(payload).nbytes != header.payload_len:
        raise CorruptObject(f"payload has {memoryview(payload).nbytes} bytes, header says {header.payload_len}")
    if checksum(key, payload) != header.checksum:
        raise CorruptObject("checksum mismatch")


def encode(key: bytes, payload) -> bytes:
    """The whole object as one bytes value (for backends that take a single value)."""
    return encode_header(key, payload) + bytes(memoryview(payload).cast("B"))


def decode_into(key: bytes, data: bytes | memoryview, dest) -> None:
    """Check a whole stored object and copy its payload into ``dest`` (a writable buffer)."""
    mv = memoryview(data).cast("B")
    header = decode_header(mv)
    if len(mv) != header.total:
        raise CorruptObject(f"object has {len(mv)} bytes, header says {header.total}")
    stored_key = mv[HEADER_BYTES : HEADER_BYTES + header.key_len]
    payload = mv[HEADER_BYTES + header.key_len :]
    dst = memoryview(dest).cast("B")
    if dst.nbytes != header.payload_len:
        raise DestinationMismatch(f"destination holds {dst.nbytes} bytes, object {header.payload_len}")
    verify(key, header, stored_key, payload)
    dst[:] = payload
