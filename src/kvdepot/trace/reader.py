"""``load_trace``: a Mooncake-format JSONL trace or a kvdepot recording, told apart by their first bytes."""

from __future__ import annotations

from kvdepot.observability.trace_format import MAGIC, is_recording, read_recording
from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvdepot.trace.ops import OpKind, Trace, TraceOp

_RECORDED = frozenset({"lookup", "store", "retrieve"})


def load_trace(path: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int = 0) -> Trace:
    """The trace at ``path`` (its first ``limit`` requests or recorded ops when > 0). ``block_tokens``
    applies to Mooncake traces only (a recording names its own chunk size). ValueError when the file is
    neither format; OSError when it cannot be read."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
        f.seek(0)
        if is_recording(head):
            return _from_recording(f, limit)
        if head.lstrip()[:1] not in (b"{", b""):
            raise ValueError(f"{path}: neither a Mooncake-format JSONL trace nor a kvdepot recording")
        ops, skipped = read_mooncake(f, block_tokens, limit)
    return Trace(ops, "mooncake", skipped)


def _from_recording(f, limit: int) -> Trace:
    _, batches, bad = read_recording(f)
    records = [r for batch in batches for r in batch]
    records.sort(key=lambda r: r.t)  # the bus hands them over in completion order; replay in arrival order
    ops: list[TraceOp] = []
    skipped = bad[0]
    t0 = records[0].t if records else 0.0
    for r in records:
        if r.outcome != "ok" or r.op not in _RECORDED or r.chunk_tokens <= 0:
            skipped += 1  # a failed request changed nothing to replay
            continue
        blocks = r.key_ids()
        ops.append(
            TraceOp(
                t=r.t - t0,
                kind=OpKind(r.op),
                blocks=blocks,
                block_tokens=r.chunk_tokens,
                prompt_tokens=len(blocks) * r.chunk_tokens,
                model=r.model,
                salt=r.salt,
                block_bytes=r.chunk_bytes,
                found=r.found,
                space=r.space,
            )
        )
        if limit and len(ops) >= limit:
            break
    return Trace(ops, "kvdepot-recording", skipped)
