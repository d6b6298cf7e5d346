"""kvdepot's own trace file: what ``kvdepot server --trace-record PATH`` writes.

Layout: the 8 bytes ``KVDTRACE``, then frames, each a little-endian uint32 length and that many bytes
of msgpack. The first frame is a ``RecordingHeader`` (it names the format version); every later frame
is one batch, a list of ``Record``. A server killed mid-write leaves at most a torn last frame, which
the reader drops and counts. Chunk hashes are kept as their first ``KEY_BYTES`` bytes (8: enough to
tell a trace's chunks apart, a quarter of a sha256): a recording says which prefixes were asked for,
it cannot be used to forge or read anyone's KV.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

MAGIC = b"KVDTRACE"
FORMAT = "kvdepot-trace"
VERSION = 1
KEY_BYTES = 8
_LEN = struct.Struct("<I")


class RecordingHeader(msgspec.Struct, frozen=True):
    format: str
    version: int
    key_bytes: int
    created: float  # time.time() when recording began
    server_version: str = ""


class Record(msgspec.Struct, frozen=True, array_like=True):
    """One LOOKUP, STORE or RETRIEVE as the server saw it."""

    t: float  # time.time() when the request arrived
    op: str  # "lookup" | "store" | "retrieve"
    model: str
    salt: str
    keys: bytes  # the request's chunk hashes (its whole chain), KEY_BYTES each, concatenated
    chunk_tokens: int
    chunk_bytes: int
    found: int  # lookup: leading chunks found; store: chunks stored; retrieve: chunks returned
    outcome: str  # "ok" or an error code's name
    duration_s: float
    space: bytes = b""  # the head of the namespace digest (rank, world size, layout, salt); empty before it was recorded

    def key_ids(self) -> tuple[int, ...]:
        k = self.keys
        return tuple(int.from_bytes(k[i : i + KEY_BYTES], "little") for i in range(0, len(k) - len(k) % KEY_BYTES, KEY_BYTES))


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(RecordingHeader)
_batch_decoder = msgspec.msgpack.Decoder(list[Record])


def frame(obj: object) -> bytes:
    payload = _encoder.encode(obj)
    return _LEN.pack(len(payload)) + payload


def start_bytes(header: RecordingHeader) -> bytes:
    return MAGIC + frame(header)


def is_recording(head: bytes) -> bool:
    return head.startswith(MAGIC)


def read_recording(f: BinaryIO) -> tuple[RecordingHeader, Iterator[list[Record]], list[int]]:
    """The header, the batches (lazily), and a one-item list that ends up holding the number of torn
    or unreadable frames once the batches are exhausted."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a kvdepot trace recording (no KVDTRACE magic)")
    try:
        first = _read_frame(f)
    except EOFError:
        first = None
    if first is None:
        raise ValueError("a kvdepot trace recording without its header")
    try:
        header = _header_decoder.decode(first)
    except msgspec.MsgspecError as exc:
        raise ValueError(f"unreadable recording header: {exc}") from None
    if header.format != FORMAT or header.version != VERSION or header.key_bytes != KEY_BYTES:
        raise ValueError(
            f"recording format {header.format!r} version {header.version} ({header.key_bytes}-byte keys) is not "
            f"{FORMAT!r} version {VERSION} ({KEY_BYTES}-byte keys) that this kvdepot reads"
        )
    bad = [0]

    def batches() -> Iterator[list[Record]]:
        while True:
            try:
                payload = _read_frame(f)
            except EOFError:  # a torn last frame: the writer died mid-write
                bad[0] += 1
                return
            if payload is None:
                return
            try:
                yield _batch_decoder.decode(payload)
            except msgspec.MsgspecError:
                bad[0] += 1

    return header, batches(), bad


def _read_frame(f: BinaryIO) -> bytes | None:
    head = f.read(_LEN.size)
    if not head:
        return None
    if len(head) < _LEN.size:
        raise EOFError
    (n,) = _LEN.unpack(head)
    payload = f.read(n)
    if len(payload) < n:
        raise EOFError
    return payload
