"""The agentic workload synthesized from a conversation trace's shape: sessions whose every turn is the
previous prompt (past its partial last block) plus new blocks, agents sharing prefixes, Mooncake records
that kvdepot's own reader takes, and the same trace for the same seed."""

from __future__ import annotations

import json

from kvdepot.trace.agentic import AgenticShape, SourceShape, synthesize, to_mooncake_lines
from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake


def _source() -> SourceShape:
    # Two conversations on a one-block system prompt (0); the second turn of each continues the first.
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 300, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 900, "output_length": 100, "hash_ids": [0, 3]},
        {"timestamp": 2, "input_length": 2600, "output_length": 700, "hash_ids": [0, 1, 4, 5, 6]},
        {"timestamp": 3, "input_length": 1000, "output_length": 50, "hash_ids": [0, 3, 7]},
    ]
    return SourceShape.from_mooncake(lines)


def test_the_source_shape_tells_first_turns_from_continuations():
    src = _source()
    # [0, 1, 4, 5, 6] continues [0, 1, 2] (past its last block: [0, 1]), growing by 3 blocks; [0, 3, 7]
    # does not count: [0, 3] past its last block is [0], the shared system prompt alone.
    assert sorted(src.first_lengths) == [900, 1000, 1500]
    assert src.growth_blocks == [3]
    assert sorted(src.output_lengths) == [50, 100, 300, 700]


def test_every_turn_extends_its_sessions_last_prompt_and_agents_share_prefixes():
    shape = AgenticShape(sessions=20, agents=2, turns=(3, 6))
    recs = synthesize(_source(), shape, seed=1)
    assert [r["timestamp"] for r in recs] == sorted(r["timestamp"] for r in recs)
    for r in recs:
        n = len(r["hash_ids"])
        assert (n - 1) * MOONCAKE_BLOCK_TOKENS < r["input_length"] <= n * MOONCAKE_BLOCK_TOKENS  # the last block is partial
    # Walk each session: a turn is the previous prompt past its last block, then new blocks.
    continued = firsts = 0
    by_prefix: dict[tuple[int, ...], int] = {}
    for r in recs:
        ids = tuple(r["hash_ids"])
        parents = [p for p in by_prefix if ids[: len(p)] == p and len(ids) > len(p)]
        if parents:
            continued += 1
        else:
            firsts += 1
        by_prefix[ids[:-1]] = 1
    assert firsts == 20 and continued == len(recs) - 20
    assert len(SourceShape.from_mooncake(recs).first_lengths) == 20  # the reader's own count agrees
    heads = {tuple(r["hash_ids"][:4]) for r in recs}
    assert len(heads) == 2  # two agents, each with its shared prefix (>= 4 blocks)
    assert synthesize(_source(), shape, seed=1) == recs and synthesize(_source(), shape, seed=2) != recs


def test_the_synthesized_trace_reads_back_as_a_mooncake_trace():
    recs = synthesize(_source(), AgenticShape(sessions=5, turns=(2, 3)), seed=0)
    ops, skipped = read_mooncake(line.encode() for line in to_mooncake_lines(recs))
    assert skipped == 0 and len(ops) == len(recs)
    assert [len(op.blocks) for op in ops] == [len(r["hash_ids"]) - 1 for r in recs]  # the partial last block is never cached
    assert json.loads(to_mooncake_lines(recs)[0]) == recs[0]
