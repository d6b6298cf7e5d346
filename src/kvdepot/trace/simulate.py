"""An LRU simulation of prefix caching: how many of a trace's prompt tokens an L1 of a given number of
blocks would have served.

Semantics, per op (the same a ``kvdepot replay`` drives a server through):

- a request (public trace): its hit is the leading run of its blocks in the cache; then every block is
  used, most recent last (hits refreshed, misses stored, the least recently used evicted past capacity);
- a recorded lookup: the leading run is its hit, and those blocks are refreshed;
- a recorded store: every block is used as above; a recorded retrieve refreshes its leading run.

The hit ratio counts tokens: hit blocks x block tokens over the prompt tokens of every request or lookup
(a prompt's partial last block is never cached, as kvdepot stores whole chunks only). The server evicts
between watermarks rather than at the last byte, so treat a point of the curve as an L1 of that size
filled to its high watermark.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvdepot.trace.ops import OpKind, TraceOp

_REQUEST, _LOOKUP, _STORE, _RETRIEVE = 0, 1, 2, 3
_CODE = {OpKind.REQUEST: _REQUEST, OpKind.LOOKUP: _LOOKUP, OpKind.STORE: _STORE, OpKind.RETRIEVE: _RETRIEVE}


@dataclass(frozen=True, slots=True)
class CurvePoint:
    capacity_blocks: int  # 0: unbounded
    hit_tokens: int
    asked_tokens: int

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0


Compiled = list[tuple[int, list[int], int, int]]  # (op code, block keys, block tokens, prompt tokens)


def compile_ops(ops: Sequence[TraceOp]) -> Compiled:
    """Ops as plain tuples, block ids made unique per (model, salt, namespace): what the inner loop
    wants. (The namespace tells a server's TP ranks apart: they ask for the same chunk hashes, and
    each rank's objects take their own room.)"""
    spaces: dict[tuple[str, str, bytes], int] = {}
    out: Compiled = []
    for op in ops:
        space = spaces.setdefault((op.model, op.salt, op.space), len(spaces))
        keys = list(op.blocks) if space == 0 else [b + (space << 64) for b in op.blocks]
        out.append((_CODE[op.kind], keys, op.block_tokens, op.prompt_tokens if op.asks else 0))
    return out


def distinct_blocks(compiled: Compiled) -> int:
    """How many blocks an L1 needs to hold the whole trace (beyond that it never evicts)."""
    seen: set[int] = set()
    for _, keys, _, _ in compiled:
        seen.update(keys)
    return len(seen)


def simulate(compiled: Compiled, capacity_blocks: int) -> CurvePoint:
    """One LRU of ``capacity_blocks`` (0: unbounded) run over the whole trace."""
    if capacity_blocks <= 0:
        return _unbounded(compiled)
    cache: OrderedDict[int, None] = OrderedDict()
    touch, pop = cache.move_to_end, cache.popitem
    hit_tokens = asked = 0
    for code, keys, block_tokens, prompt_tokens in compiled:
        n = 0
        if code != _STORE:
            for b in keys:
                if b not in cache:
                    break
                touch(b)
                n += 1
        if code == _REQUEST or code == _STORE:
            for b in keys[n:] if code == _REQUEST else keys:
                if b in cache:
                    touch(b)
                else:
                    cache[b] = None
                    if len(cache) > capacity_blocks:
                        pop(last=False)
        if prompt_tokens:
            asked += prompt_tokens
            hit_tokens += n * block_tokens
    return CurvePoint(capacity_blocks, hit_tokens, asked)


def _unbounded(compiled: Compiled) -> CurvePoint:
    cache: set[int] = set()
    hit_tokens = asked = 0
    for code, keys, block_tokens, prompt_tokens in compiled:
        n = 0
        if code != _STORE:
            for b in keys:
                if b not in cache:
                    break
                n += 1
        if code == _REQUEST or code == _STORE:
            cache.update(keys)
        if prompt_tokens:
            asked += prompt_tokens
            hit_tokens += n * block_tokens
    return CurvePoint(0, hit_tokens, asked)


def curve(compiled: Compiled, capacities: Sequence[int], jobs: int = 1) -> list[CurvePoint]:
    """The hit ratio at each capacity (in blocks). Capacities at or past the trace's distinct blocks
    never evict, so they share one unbounded run; the others are independent runs, spread over ``jobs``
    processes (forked, so the trace is not copied) when the trace is big enough to be worth it."""
    total = distinct_blocks(compiled)
    bounded = sorted({c for c in capacities if 0 < c < total})
    touches = sum(len(keys) for _, keys, _, _ in compiled)
    if jobs > 1 and len(bounded) > 1 and touches >= _PARALLEL_TOUCHES and "fork" in mp.get_all_start_methods():
        global _shared
        _shared = compiled
        try:
            with mp.get_context("fork").Pool(min(jobs, len(bounded))) as pool:
                runs = dict(zip(bounded, pool.map(_simulate_shared, bounded)))
        finally:
            _shared = None
    else:
        runs = {c: simulate(compiled, c) for c in bounded}
    unbounded = _unbounded(compiled) if len(runs) < len(set(capacities)) else None
    return [runs[c] if c in runs else CurvePoint(c, unbounded.hit_tokens, unbounded.asked_tokens) for c in capacities]


_PARALLEL_TOUCHES = 200_000  # below this, starting processes costs more than it saves
_shared: Compiled | None = None


def _simulate_shared(capacity_blocks: int) -> CurvePoint:
    assert _shared is not None
    return simulate(_shared, capacity_blocks)
