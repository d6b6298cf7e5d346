"""Framing: turning typed messages into ZeroMQ frames and back. Pure functions, no sockets.

A request is ``[header, body, *payload]``; a reply is ``[header, body, *payload]`` (the ROUTER socket adds
and strips the routing-id frame). ``header`` and ``body`` are msgpack; payload frames are raw KV bytes.
Decoding never trusts the peer: every failure raises ``ProtocolViolation`` with the ErrorCode to reply.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvdepot.errors import ErrorCode, KVDepotError
from kvdepot.protocol.messages import (
    PROTOCOL_VERSION,
    REGISTRY,
    ErrorReply,
    ReplyHeader,
    RequestHeader,
    RequestType,
)

TARGET_FRAME_BYTES = 2 << 20  # what senders aim for: measured fastest through ZeroMQ here
MAX_BODY_BYTES = 8 << 20  # the msgpack body of one message


class ProtocolViolation(KVDepotError):
    """A frame the peer sent cannot be accepted; ``request_id`` is known when the header decoded."""

    def __init__(self, message: str, code: ErrorCode, request_id: int = 0) -> None:
        super().__init__(message, code)
        self.request_id = request_id


_encoder = msgspec.msgpack.Encoder()
_req_header_decoder = msgspec.msgpack.Decoder(RequestHeader)
_reply_header_decoder = msgspec.msgpack.Decoder(ReplyHeader)
_error_decoder = msgspec.msgpack.Decoder(ErrorReply)
_request_decoders = {t: msgspec.msgpack.Decoder(req) for t, (req, _) in REGISTRY.items()}
_reply_decoders = {t: msgspec.msgpack.Decoder(rep) for t, (_, rep) in REGISTRY.items()}
_request_types = {req: t for t, (req, _) in REGISTRY.items()}
_types_by_value = {int(t): t for t in REGISTRY}  # int -> RequestType without Enum.__call__ per message


# --- requests ---------------------------------------------------------------------------------------


def encode_request(request_id: int, body: msgspec.Struct, timeout_ms: int = 0) -> list[bytes]:
    rtype = _request_types[type(body)]
    header = RequestHeader(PROTOCOL_VERSION, request_id, int(rtype), timeout_ms)
    return [_encoder.encode(header), _encoder.encode(body)]


MAX_ERROR_TEXT = 300  # of a decoder's message, which may quote the whole offending value (megabytes)


def _brief(exc: BaseException) -> str:
    """``exc``'s message, cut short: it goes back to the client, into the log and the recent-events ring."""
    text = str(exc)
    return text if len(text) <= MAX_ERROR_TEXT else f"{text[:MAX_ERROR_TEXT]}... ({len(text)} characters in all)"


def decode_request_header(frame: bytes | memoryview) -> RequestHeader:
    if len(frame) > 256:
        raise ProtocolViolation(f"request header of {len(frame)} bytes", ErrorCode.BAD_REQUEST)
    try:
        header = _req_header_decoder.decode(frame)
    except Exception as exc:  # msgspec raises more than DecodeError (e.g. UnicodeDecodeError)
        raise ProtocolViolation(f"undecodable request header: {type(exc).__name__}: {_brief(exc)}", ErrorCode.BAD_REQUEST) from None
    if header.version != PROTOCOL_VERSION:
        raise ProtocolViolation(
            f"protocol version {header.version} is not supported (server speaks {PROTOCOL_VERSION})",
            ErrorCode.VERSION_MISMATCH,
            header.request_id,
        )
    return header


def decode_request_body(header: RequestHeader, frame: bytes | memoryview) -> tuple[RequestType, msgspec.Struct]:
    rtype = _types_by_value.get(header.type)
    if rtype is None:
        raise ProtocolViolation(
            f"unknown request type {header.type}", ErrorCode.UNKNOWN_REQUEST_TYPE, header.request_id
        )
    if len(frame) > MAX_BODY_BYTES:
        raise ProtocolViolation(
            f"request body of {len(frame)} bytes exceeds {MAX_BODY_BYTES}",
            ErrorCode.MESSAGE_TOO_LARGE,
            header.request_id,
        )
    try:
        return rtype, _request_decoders[rtype].decode(frame)
    except Exception as exc:  # msgspec raises more than DecodeError (e.g. UnicodeDecodeError)
        raise ProtocolViolation(
            f"malformed {rtype.name} body: {type(exc).__name__}: {_brief(exc)}", ErrorCode.BAD_REQUEST, header.request_id
        ) from None


# --- replies ----------------------------------------------------------------------------------------


def encode_reply(request_id: int, body: msgspec.Struct) -> list[bytes]:
    return [_encoder.encode(ReplyHeader(PROTOCOL_VERSION, request_id, 0)), _encoder.encode(body)]


def encode_error(request_id: int, code: ErrorCode, message: str) -> list[bytes]:
    header = ReplyHeader(PROTOCOL_VERSION, request_id, int(code))
    return [_encoder.encode(header), _encoder.encode(ErrorReply(code=int(code), message=message))]


def decode_reply_header(frame: bytes | memoryview) -> ReplyHeader:
    try:
        header = _reply_header_decoder.decode(frame)
    except Exception as exc:
        raise ProtocolViolation(f"undecodable reply header: {exc}", ErrorCode.BAD_REQUEST) from None
    if header.version != PROTOCOL_VERSION:
        raise ProtocolViolation(
            f"server speaks protocol {header.version}, this client {PROTOCOL_VERSION}", ErrorCode.VERSION_MISMATCH
        )
    return header


def decode_reply_body(rtype: RequestType, header: ReplyHeader, frame: bytes | memoryview) -> msgspec.Struct:
    """The typed reply; raises the matching KVDepotError when the server answered with an error."""
    from kvdepot.errors import error_from_code

    try:
        if header.status != 0:
            err = _error_decoder.decode(frame)
            raise error_from_code(err.code, err.message)
        return _reply_decoders[rtype].decode(frame)
    except KVDepotError:
        raise
    except Exception as exc:
        raise ProtocolViolation(f"malformed {rtype.name} reply: {exc}", ErrorCode.BAD_REQUEST) from None


# --- payload frames ---------------------------------------------------------------------------------
#
# An object ``[K, L, T, H, D]`` is K*L "rows" (one per key/value and layer), each T*H*D items long.
# Payload frames carry whole rows, ``rows_per_frame`` at a time (the sender picks it and says so in the
# body), so a receiver can copy each frame straight into a strided ``[K, L, T, H, D]`` destination.
# ``rows_per_frame == 0`` means plain byte pieces of at most ``max_frame_bytes`` (needed only when one
# row is itself larger than a frame).


def rows_per_frame_for(
    object_bytes: int, rows: int, max_frame_bytes: int, target_bytes: int = TARGET_FRAME_BYTES
) -> int:
    """Rows per frame for frames near ``target_bytes`` (never above the limit); 0 when a single row
    does not fit in a frame."""
    if rows <= 0 or object_bytes < rows or object_bytes % rows:
        raise ValueError(f"{object_bytes} bytes do not split into {rows} rows")
    row = object_bytes // rows
    if row > max_frame_bytes:
        return 0
    return max(1, min(rows, min(target_bytes, max_frame_bytes) // row))


def frame_sizes(object_bytes: int, rows: int, rows_per_frame: int, max_frame_bytes: int) -> list[int]:
    """The exact sizes of one object's payload frames under the agreed split."""
    if rows <= 0 or object_bytes % rows:
        raise ValueError(f"{object_bytes} bytes do not split into {rows} rows")
    if rows_per_frame == 0:
        full, rest = divmod(object_bytes, max_frame_bytes)
        return [max_frame_bytes] * full + ([rest] if rest else [])
    row = object_bytes // rows
    if rows_per_frame < 0 or rows_per_frame * row > max_frame_bytes:
        raise ValueError(f"{rows_per_frame} rows of {row} bytes exceed the {max_frame_bytes}-byte frame limit")
    full, rest = divmod(rows, rows_per_frame)
    return [rows_per_frame * row] * full + ([rest * row] if rest else [])


def split_object(buffer, rows: int, rows_per_frame: int, max_frame_bytes: int) -> list[memoryview]:
    """Cut one contiguous object into its payload frames (views, no copies)."""
    mv = memoryview(buffer).cast("B")
    out, pos = [], 0
    for size in frame_sizes(len(mv), rows, rows_per_frame, max_frame_bytes):
        out.append(mv[pos : pos + size])
        pos += size
    return out


def check_payload(
    frames: Sequence, n_objects: int, object_bytes: int, rows: int, rows_per_frame: int, max_frame_bytes: int, request_id: int
) -> int:
    """Raise unless ``frames`` are exactly ``n_objects`` objects split as agreed; returns frames per object."""
    try:
        sizes = frame_sizes(object_bytes, rows, rows_per_frame, max_frame_bytes)
    except ValueError as exc:
        raise ProtocolViolation(str(exc), ErrorCode.PAYLOAD_MISMATCH, request_id) from None
    per = len(sizes)
    if len(frames) != n_objects * per:
        raise ProtocolViolation(
            f"expected {n_objects * per} payload frames ({n_objects} objects x {per}), got {len(frames)}",
            ErrorCode.PAYLOAD_MISMATCH,
            request_id,
        )
    for i, frame in enumerate(frames):
        if len(frame) != sizes[i % per]:
            raise ProtocolViolation(
                f"payload frame {i} has {len(frame)} bytes, expected {sizes[i % per]}",
                ErrorCode.PAYLOAD_MISMATCH,
                request_id,
            )
    return per


def request_type_of(body: msgspec.Struct) -> RequestType:
    return _request_types[type(body)]
