"""Mooncake-format traces: JSON lines ``{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [block ids]}``, each block id naming one fixed-size block of the prompt (512 tokens
in the published traces) given everything before it."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvdepot.trace.ops import OpKind, TraceOp

MOONCAKE_BLOCK_TOKENS = 512


class MooncakeLine(msgspec.Struct):
    timestamp: float  # milliseconds
    input_length: int
    hash_ids: list[int]
    output_length: int = 0


def read_mooncake(lines: Iterable[bytes], block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int = 0) -> tuple[list[TraceOp], int]:
    """The requests of a Mooncake trace (its first ``limit`` when > 0) and how many lines were skipped.

    Only complete blocks are cacheable (kvdepot stores whole chunks): a prompt of 6758 tokens in blocks
    of 512 has 13 cacheable blocks, whatever its last hash id says.
    """
    decoder = msgspec.json.Decoder(MooncakeLine)
    ops: list[TraceOp] = []
    skipped = 0
    t0: float | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = decoder.decode(line)
        except msgspec.ValidationError as exc:
            raise ValueError(f"line {number}: not a Mooncake trace record: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ValueError(f"line {number}: not JSON: {exc}") from None
        if rec.input_length < 0 or any(b < 0 for b in rec.hash_ids):
            skipped += 1
            continue
        t0 = rec.timestamp if t0 is None else t0
        complete = min(len(rec.hash_ids), rec.input_length // block_tokens)
        ops.append(
            TraceOp(
                t=(rec.timestamp - t0) / 1000.0,
                kind=OpKind.REQUEST,
                blocks=tuple(rec.hash_ids[:complete]),
                block_tokens=block_tokens,
                prompt_tokens=rec.input_length,
            )
        )
        if limit and len(ops) >= limit:
            break
    return ops, skipped
