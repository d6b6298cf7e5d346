"""A trace as kvdepot reads it: a list of ``TraceOp``, whatever file format it came from.

Blocks are named by integer ids in chain order: a public trace's ``hash_ids`` as they are, a recorded
trace's chunk hashes by their first 8 bytes read as an integer. Two ops with the same leading ids
share that prefix, which is all prefix caching needs to know.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class OpKind(str, Enum):
    REQUEST = "request"  # a public trace's request: look its prefix up, load the hits, store the misses
    LOOKUP = "lookup"  # recorded: how many leading chunks are stored
    STORE = "store"  # recorded: store these chunks (those already stored are skipped)
    RETRIEVE = "retrieve"  # recorded: load the leading stored chunks


@dataclass(frozen=True, slots=True)
class TraceOp:
    t: float  # seconds since the trace's first op
    kind: OpKind
    blocks: tuple[int, ...]  # the complete blocks (chunks) of the request, in chain order
    block_tokens: int  # tokens per block
    prompt_tokens: int  # tokens the request asked about (>= blocks x block_tokens: a partial block is never cached)
    model: str = ""
    salt: str = ""
    block_bytes: int = 0  # KV bytes per block when the trace knows it (recorded traces), else 0
    found: int = -1  # recorded outcome: leading chunks found / chunks stored / chunks returned; -1 unknown
    space: bytes = b""  # recorded traces: the namespace the blocks live in (each TP rank has its own)

    @property
    def asks(self) -> bool:
        """Does this op count towards the hit ratio (a lookup)?"""
        return self.kind in (OpKind.REQUEST, OpKind.LOOKUP)


@dataclass(frozen=True, slots=True)
class Trace:
    ops: list[TraceOp]
    source: str  # "mooncake" or "kvdepot-recording"
    skipped: int = 0  # records left out (failed requests, unreadable lines)

    @property
    def block_bytes(self) -> int:
        """KV bytes per block the trace recorded (0 when it does not say)."""
        return next((op.block_bytes for op in self.ops if op.block_bytes), 0)

    def recorded_hit_ratio(self) -> float | None:
        """The token hit ratio the recorded lookups saw (None for a trace without outcomes)."""
        asked = hit = 0
        for op in self.ops:
            if op.kind is OpKind.LOOKUP and op.found >= 0:
                asked += op.prompt_tokens
                hit += op.found * op.block_tokens
        return hit / asked if asked else None
