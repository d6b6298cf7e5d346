"""An agentic multi-turn workload, synthesized in the shape of a real conversation trace.

An agent session is a loop: the model answers, a tool runs, its output is appended, the model is asked
again with the whole history; now and then the user replies after a longer pause. So, unlike a chat,
one session sends many requests, each the previous one plus a little, seconds apart; and sessions of
one agent share a long prefix (the system prompt and the tool definitions).

What is taken from the source trace (Mooncake format), so the synthesis has its shape: the first
turn's prompt lengths (its ``input_length``s), the model's output lengths (its ``output_length``s) and
how much a continuing conversation grows from one request to the next (in blocks). What is the
agent's own: the shared prefix per agent, the turn count, the gaps (a tool's seconds, a user's
minutes) and the session arrivals. The result is a Mooncake-format trace (``to_mooncake_lines``) that
``kvdepot plan`` and ``kvdepot replay`` read like any other.

Each turn's blocks are the previous turn's blocks but its last (a partial block is re-hashed once it
fills, as engines hash only complete blocks), then new ones: the previous answer and the tool's output.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class AgenticShape:
    sessions: int = 300
    agents: int = 4  # distinct shared prefixes
    agent_prefix_blocks: tuple[int, int] = (4, 16)  # a shared prefix's length, drawn once per agent
    turns: tuple[int, int] = (4, 32)
    tool_gap_s: tuple[float, float] = (0.5, 8.0)  # between two turns of the tool loop
    user_gap_s: tuple[float, float] = (20.0, 300.0)  # a user's reply
    user_turn_every: int = 6  # on average, one turn in this many waits for the user
    session_arrival_s: float = 4.0  # mean gap between session starts (Poisson)
    max_blocks: int = 256  # a history is cut here (a context window of 128k tokens)
    block_tokens: int = MOONCAKE_BLOCK_TOKENS


@dataclass(frozen=True)
class SourceShape:
    """What the synthesis draws from the source trace (empirical distributions)."""

    first_lengths: list[int]  # input_length of requests that continue nothing
    output_lengths: list[int]
    growth_blocks: list[int]  # new blocks of a request that continues an earlier one

    @classmethod
    def from_mooncake(cls, lines: list[dict], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> SourceShape:
        earlier: set[tuple[int, ...]] = set()  # each earlier request's blocks but its (partial) last
        first, growth = [], []
        for rec in lines:
            ids = tuple(rec["hash_ids"])
            cont = next((k for k in range(len(ids), 1, -1) if ids[:k] in earlier), 0)
            if cont:  # it continues a conversation: an earlier prompt, whole (past its last block), then new blocks
                growth.append(len(ids) - cont)
            else:  # a shared one-block system prompt alone does not make a continuation
                first.append(rec["input_length"])
            if len(ids) > 1:
                earlier.add(ids[:-1])
        outputs = [rec.get("output_length", 0) for rec in lines if rec.get("output_length", 0) > 0]
        if not first or not outputs:
            raise ValueError("the source trace has no first turns or no output lengths to draw from")
        return cls(first, outputs, growth or [1])


def synthesize(source: SourceShape, shape: AgenticShape = AgenticShape(), seed: int = 0) -> list[dict]:
    """Mooncake records (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``),
    sorted by time."""
    rng = random.Random(seed)
    bt = shape.block_tokens
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    prefixes = [new_ids(rng.randint(*shape.agent_prefix_blocks)) for _ in range(shape.agents)]
    records = []
    start = 0.0
    for _ in range(shape.sessions):
        start += rng.expovariate(1.0 / shape.session_arrival_s)
        t = start
        own = max(2, -(-rng.choice(source.first_lengths) // bt) - 1)  # the task's own context, in blocks (2 at least:
        # then no session's first turn looks like the continuation of another's, which shares only the agent's prefix)
        ids = prefixes[rng.randrange(shape.agents)] + new_ids(own)
        for _ in range(rng.randint(*shape.turns)):
            output = rng.choice(source.output_lengths)
            length = (len(ids) - 1) * bt + rng.randint(1, bt)  # the last block is partial
            records.append({"timestamp": round(t * 1000), "input_length": length, "output_length": output, "hash_ids": list(ids)})
            user = rng.random() < 1.0 / shape.user_turn_every
            t += rng.uniform(*(shape.user_gap_s if user else shape.tool_gap_s)) + output * 0.02  # decoding at ~50 tokens/s
            grown = -(-output // bt) + rng.choice(source.growth_blocks)  # the answer, then the tool's (or user's) text
            ids = ids[:-1] + new_ids(grown)
            if len(ids) > shape.max_blocks:
                break
    records.sort(key=lambda r: r["timestamp"])
    return records


def to_mooncake_lines(records: list[dict]) -> list[str]:
    return [json.dumps(r) for r in records]
