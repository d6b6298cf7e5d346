"""``kvdepot bench hit-ratio``: a chat trace and an agentic workload through a real server, each hit
ratio next to an LRU oracle of the same capacity.

Two workloads: the first ``--requests`` of a conversation trace (Mooncake format), and an agentic
multi-turn workload synthesized in its shape (``kvdepot.trace.agentic``: sessions of many turns seconds
apart, histories growing by the answer and a tool's output, agents sharing long prefixes). For each,
a fresh server whose L1 holds ``--capacity`` of the workload's distinct blocks; the replay drives it
request by request in trace order, as an engine would (LOOKUP, read the hit, store the rest: the
``kvdepot replay`` path), back to back, since an LRU's outcome depends on the order, not the clock.

The limit each ratio stands next to: the LRU simulation (``kvdepot plan``'s) at the same capacity in
blocks, at the server's high watermark (where it starts evicting) and at its low one (where it
stops), and unbounded (the workload's own ceiling). Below the oracle means the server lost hits an
ideal LRU keeps: eviction in bulk between watermarks, arena fragmentation, or a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvdepot.bench.serverproc import bench_server, wait_prefault
from kvdepot.bench.stats import loadavg
from kvdepot.client.options import ClientOptions
from kvdepot.layout import KVLayout
from kvdepot.trace.agentic import AgenticShape, SourceShape, synthesize, to_mooncake_lines
from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS, read_mooncake
from kvdepot.trace.replay import Replayer, replay
from kvdepot.trace.simulate import compile_ops, curve, distinct_blocks

# 64 B a token (one layer, one KV head of 16, fp16): a 512-token block is 32 KiB, so a few thousand
# requests' distinct blocks fit a small L1 and the run is about caching, not copying.
HIT_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16")
DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"
HIGH_WATERMARK, LOW_WATERMARK = 0.95, 0.85  # the server's defaults, which this run keeps
MiB = 1 << 20


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=os.environ.get("KVDEPOT_TRACE", DEFAULT_TRACE),
                   help="a Mooncake-format conversation trace (default: $KVDEPOT_TRACE or %(default)s)")  # fmt: skip
    p.add_argument("--requests", type=int, default=3000, help="requests of each workload (default: %(default)s)")
    p.add_argument("--capacity", type=float, default=0.25, help="L1 as a fraction of the workload's distinct blocks (default: %(default)s)")
    p.add_argument("--transport", default="shm", choices=("shm", "inline"), help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="of the agentic synthesis (default: %(default)s)")
    p.add_argument("--save-agentic", default=None, help="also write the synthesized agentic trace (Mooncake JSONL) here")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")


@dataclass
class HitRow:
    workload: str
    requests: int
    sessions: int
    distinct_blocks: int
    l1_bytes: int
    capacity_blocks: int  # what L1 holds at its high watermark
    server_ratio: float
    oracle_high: float  # LRU at the high watermark's blocks
    oracle_low: float  # ... at the low watermark's
    unbounded: float
    errors: dict
    wall_s: float


def _workloads(args: argparse.Namespace) -> list[tuple[str, list[dict], int]]:
    try:
        lines = [json.loads(line) for line in Path(args.trace).read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise SystemExit(f"kvdepot bench hit-ratio: cannot read the conversation trace {args.trace}: {exc} (--trace PATH)") from None
    chat = lines[: args.requests]
    source = SourceShape.from_mooncake(lines)
    shape = AgenticShape()
    agentic: list[dict] = []
    sessions = 0
    while len(agentic) < args.requests:  # as many sessions as it takes to reach the request count
        sessions = max(sessions * 2, 16) if agentic else 64
        agentic = synthesize(source, AgenticShape(**{**asdict(shape), "sessions": sessions}), args.seed)
    agentic = agentic[: args.requests]
    if args.save_agentic:
        Path(args.save_agentic).write_text("\n".join(to_mooncake_lines(agentic)) + "\n")
    return [("conversation trace", chat, _sessions(chat)), ("agentic (synthesized)", agentic, _sessions(agentic))]


def _sessions(records: list[dict]) -> int:
    """Conversations (or agent sessions) that start in these records: requests that continue none before."""
    return len(SourceShape.from_mooncake(records).first_lengths)


def _run(name: str, records: list[dict], sessions: int, args: argparse.Namespace) -> HitRow:
    ops, _ = read_mooncake((json.dumps(r).encode() for r in records), MOONCAKE_BLOCK_TOKENS)
    compiled = compile_ops(ops)
    distinct = distinct_blocks(compiled)
    block_bytes = HIT_LAYOUT.chunk_bytes(MOONCAKE_BLOCK_TOKENS)
    l1_bytes = max(int(distinct * args.capacity) * block_bytes, 16 * MiB)
    high, low = int(l1_bytes * HIGH_WATERMARK) // block_bytes, int(l1_bytes * LOW_WATERMARK) // block_bytes
    oracle_high, oracle_low, unbounded = curve(compiled, [high, low, 0])
    server = bench_server(l1_bytes / (1 << 30), "kvdepot-bench-hit-")
    with server:
        wait_prefault(server)
        url = server.url if args.transport == "shm" else server.ipc_url
        with Replayer(url, HIT_LAYOUT, ClientOptions(transport=args.transport, timeout_s=30), "bench-hit-ratio") as replayer:
            result = replay(ops, replayer)
    print(f"# {name}: {result.hit_ratio:.3f} (LRU {oracle_high.ratio:.3f}) in {result.wall_s:.1f} s", file=sys.stderr, flush=True)
    return HitRow(name, len(ops), sessions, distinct, l1_bytes, high, result.hit_ratio, oracle_high.ratio, oracle_low.ratio,
                  unbounded.ratio, result.errors, result.wall_s)  # fmt: skip


def main(args: argparse.Namespace) -> int:
    load_start = loadavg()
    rows = [_run(name, records, sessions, args) for name, records, sessions in _workloads(args)]
    load_end = loadavg()
    print(f"First {args.requests} requests of each workload, replayed back to back in trace order ({args.transport}); L1 = "
          f"{args.capacity:g} x the workload's distinct blocks of {HIT_LAYOUT.chunk_bytes(MOONCAKE_BLOCK_TOKENS) // 1024} KiB "
          f"(512 tokens); LRU oracle at the server's high ({HIGH_WATERMARK}) and low ({LOW_WATERMARK}) watermark; "
          f"load {load_start} -> {load_end}\n")  # fmt: skip
    print("| workload | requests | sessions | distinct blocks | L1 (blocks at high watermark) | server hit ratio | "
          "LRU oracle (high / low watermark) | server / LRU (high) | unbounded |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.workload} | {r.requests} | {r.sessions} | {r.distinct_blocks} | {r.l1_bytes / MiB:.0f} MiB ({r.capacity_blocks}) | "
              f"{r.server_ratio:.3f} | {r.oracle_high:.3f} / {r.oracle_low:.3f} | {r.server_ratio / r.oracle_high if r.oracle_high else 0:.2f} | "
              f"{r.unbounded:.3f} |")  # fmt: skip
        if r.errors:
            print(f"  errors: {r.errors}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "load_start": load_start, "load_end": load_end}, f, indent=2)
    return 1 if any(r.errors for r in rows) else 0
