"""``kvdepot plan TRACE``: how much of a trace's prompts an L1 of each size would serve, from an LRU
simulation (``simulate.py``), without a server. An operator sizes L1 (and L2 behind it) from the curve
before buying memory. With write-through L2 tiers (which hold all L1 holds), read the curve at L1 + L2's
size for the share served from either tier, and at L1's size for the share served from memory.

Bytes per block: ``--bytes-per-token``, or a model's KV shape (``--num-layers`` ...), or what a kvdepot
recording says, or by default a Llama-3-8B-like model in fp16 (32 layers, 8 KV heads of 128: 128 KiB a
token, 64 MiB a 512-token block).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from kvdepot.config import StorageConfig
from kvdepot.layout import KVLayout, supported_dtypes
from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS
from kvdepot.trace.ops import Trace
from kvdepot.trace.plot import ascii_bars, write_png
from kvdepot.trace.reader import load_trace
from kvdepot.trace.simulate import compile_ops, curve, distinct_blocks
from kvdepot.trace.units import format_size, parse_size

DEFAULT_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")  # Llama-3-8B-like


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format JSONL trace or a kvdepot recording (--trace-record)")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per hash_id block of a Mooncake trace (default: %(default)s; a recording names its own)")  # fmt: skip
    size = p.add_argument_group("KV bytes per block (first given wins; default: a recording's own, else a Llama-3-8B-like fp16 model, 128 KiB a token)")  # fmt: skip
    size.add_argument("--bytes-per-token", type=int, default=0, help="KV bytes of one token, all layers")
    size.add_argument("--num-layers", type=int, default=0, help=f"model shape instead (default {DEFAULT_LAYOUT.num_layers})")
    size.add_argument("--num-kv-heads", type=int, default=0, help=f"(default {DEFAULT_LAYOUT.num_kv_heads})")
    size.add_argument("--head-dim", type=int, default=0, help=f"(default {DEFAULT_LAYOUT.head_dim})")
    size.add_argument("--dtype", choices=supported_dtypes(), default="", help=f"(default {DEFAULT_LAYOUT.dtype})")
    p.add_argument("--sizes", default="", help="L1 sizes to simulate, comma-separated, e.g. 16GiB,64GiB,256GiB (default: --points sizes up to the whole trace)")  # fmt: skip
    p.add_argument("--points", type=int, default=12, help="how many sizes, each twice the last, ending where the whole trace fits (default: %(default)s)")  # fmt: skip
    p.add_argument("--limit", type=int, default=0, help="use only the first N requests (default: all)")
    p.add_argument("--model", default="", help="a recording's ops of this model only (a server of several models: plan each)")
    p.add_argument("--plot", choices=["auto", "always", "never"], default="auto", help="draw the curve in text (auto: when stdout is a terminal)")  # fmt: skip
    p.add_argument("--png", default="", help="also draw the curve to this PNG file (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the curve as JSON instead")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes for the simulation (default: %(default)s)")


@dataclass(frozen=True)
class BlockBytes:
    bytes: int
    why: str


def block_bytes(args: argparse.Namespace, trace: Trace, block_tokens: int) -> BlockBytes:
    if args.bytes_per_token:
        return BlockBytes(args.bytes_per_token * block_tokens, f"{args.bytes_per_token} B a token (--bytes-per-token)")
    if args.num_layers or args.num_kv_heads or args.head_dim or args.dtype:
        d = DEFAULT_LAYOUT
        lay = KVLayout(
            args.num_layers or d.num_layers, args.num_kv_heads or d.num_kv_heads, args.head_dim or d.head_dim, args.dtype or d.dtype
        )
        return BlockBytes(lay.chunk_bytes(block_tokens), f"{lay.bytes_per_token} B a token ({lay.num_layers} layers x {lay.num_kv_heads} KV heads x {lay.head_dim}, {lay.dtype})")  # fmt: skip
    if trace.block_bytes:
        return BlockBytes(trace.block_bytes, "as recorded")
    return BlockBytes(DEFAULT_LAYOUT.chunk_bytes(block_tokens), f"{DEFAULT_LAYOUT.bytes_per_token} B a token (default: a Llama-3-8B-like fp16 model; see --bytes-per-token)")  # fmt: skip


def _mixed(trace: Trace, explicit_size: bool) -> str:
    """Why one curve cannot be drawn for ``trace`` (chunks of different sizes: the simulation counts
    blocks, and sizes them all alike), or ""."""
    by_model: dict[str, set[tuple[int, int]]] = {}
    for op in trace.ops:
        by_model.setdefault(op.model, set()).add((op.block_tokens, 0 if explicit_size else op.block_bytes))
    sizes = set().union(*by_model.values())
    if len(sizes) <= 1:
        return ""
    if len(by_model) > 1:
        return ("the recording's models have chunks of different sizes ("
                + "; ".join(f"{m or '?'}: {', '.join(_size(t, b) for t, b in sorted(s))}" for m, s in sorted(by_model.items()))
                + "): plan each with --model NAME")  # fmt: skip
    return f"the trace mixes chunk sizes ({', '.join(_size(t, b) for t, b in sorted(sizes))}): plan each context on its own"


def _size(tokens: int, nbytes: int) -> str:
    return f"{tokens} tokens" + (f" / {format_size(nbytes)}" if nbytes else "")


def main(args: argparse.Namespace) -> int:
    if args.bytes_per_token < 0 or args.block_tokens <= 0 or args.points <= 0 or args.limit < 0:
        print("kvdepot plan: --block-tokens and --points must be positive, --bytes-per-token and --limit not negative", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, args.block_tokens, args.limit)
        sizes = sorted(parse_size(s) for s in args.sizes.split(",") if s.strip())
    except (OSError, ValueError) as exc:
        print(f"kvdepot plan: {exc}", file=sys.stderr)
        return 2
    if not any(op.asks for op in trace.ops):
        print(f"kvdepot plan: {args.trace} holds no requests or lookups to plan for", file=sys.stderr)
        return 2
    models = sorted({op.model for op in trace.ops})
    if args.model:
        trace = Trace([op for op in trace.ops if op.model == args.model], trace.source, trace.skipped)
        if not any(op.asks for op in trace.ops):
            print(f"kvdepot plan: no lookups of --model {args.model} in {args.trace} (its models: {', '.join(models)})", file=sys.stderr)
            return 2
    problem = _mixed(trace, explicit_size=bool(args.bytes_per_token or args.num_layers or args.num_kv_heads or args.head_dim or args.dtype))
    if problem:
        print(f"kvdepot plan: {problem}", file=sys.stderr)
        return 2
    compiled = compile_ops(trace.ops)
    total = distinct_blocks(compiled)
    tokens = {op.block_tokens for op in trace.ops}
    try:
        per_block = block_bytes(args, trace, tokens.pop())
    except ValueError as exc:  # a model shape KVLayout refuses
        print(f"kvdepot plan: {exc}", file=sys.stderr)
        return 2
    if sizes:
        capacities = [max(1, s // per_block.bytes) for s in sizes]
    else:
        capacities = sorted({max(1, total >> k) for k in range(args.points - 1, -1, -1)})
        sizes = [c * per_block.bytes for c in capacities]
    points = curve(compiled, capacities, jobs=max(1, args.jobs))
    best = points[-1].ratio if not args.sizes else curve(compiled, [total])[0].ratio
    if args.json:
        doc = {
            "trace": args.trace, "model": args.model or None, "source": trace.source, "ops": len(trace.ops), "skipped": trace.skipped,
            "distinct_blocks": total, "block_bytes": per_block.bytes, "max_hit_ratio": best,
            "recorded_hit_ratio": trace.recorded_hit_ratio(),
            "points": [{"l1_bytes": s, "l1_size_gb_to_set": to_set(s) / 2**30, "blocks": p.capacity_blocks, "hit_ratio": p.ratio,
                        "hit_tokens": p.hit_tokens, "asked_tokens": p.asked_tokens} for s, p in zip(sizes, points)],
        }  # fmt: skip
        print(json.dumps(doc, indent=2))
        return 0
    print(_header(args.trace, trace, total, per_block))
    print(f"{'L1 size':>12} {'blocks':>10} {'hit ratio':>10} {'of max':>8}")
    for s, p in zip(sizes, points):
        note = "  (holds the whole trace)" if p.capacity_blocks >= total else ""
        print(f"{format_size(s):>12} {p.capacity_blocks:>10} {p.ratio * 100:>9.2f}% {p.ratio / best * 100 if best else 0:>7.1f}%{note}")
    for share in (0.5, 0.9):
        enough = next(((sz, p) for sz, p in zip(sizes, points) if best and p.ratio >= share * best), None)
        if enough is not None:
            print(f"{share:.0%} of the best hit ratio ({enough[1].ratio * 100:.2f}%) needs at most {format_size(enough[0])} of L1"
                  f" (--l1-size-gb {to_set(enough[0]) / 2**30:.3g})")  # fmt: skip
    low = StorageConfig().low_watermark
    print(f"L1 sizes are what the cache holds; a server evicts down to its --low-watermark ({low:.0%} by default) of "
          f"--l1-size-gb, so the flag's figure is the size / {low:g}")  # fmt: skip
    if args.plot == "always" or (args.plot == "auto" and sys.stdout.isatty()):
        print()
        print(ascii_bars([format_size(s).replace(" ", "") for s in sizes], [p.ratio for p in points]))
    if args.png:
        why = write_png(args.png, sizes, [p.ratio for p in points], f"{os.path.basename(args.trace)}: hit ratio vs L1 size")
        if why:
            print(f"kvdepot plan: {why}", file=sys.stderr)
            return 1
        print(f"curve drawn to {args.png}")
    return 0


def to_set(cached_bytes: int) -> float:
    """The ``--l1-size-gb`` (in bytes) whose server holds ``cached_bytes`` even right after an eviction
    round: it evicts from its high watermark down to its low one (defaults)."""
    return cached_bytes / StorageConfig().low_watermark


def _header(path: str, trace: Trace, total: int, per_block: BlockBytes) -> str:
    asked = sum(op.prompt_tokens for op in trace.ops if op.asks)
    block_tokens = trace.ops[0].block_tokens
    lines = [
        f"{path}: {trace.source}, {sum(op.asks for op in trace.ops)} requests, {asked} prompt tokens, "
        f"{total} distinct blocks of {block_tokens} tokens ({format_size(total * per_block.bytes)} to hold them all)",
        f"KV per block: {format_size(per_block.bytes)}, {per_block.why}",
        "LRU over whole blocks; a request's hit is its leading run of cached blocks; partial last blocks never hit",
    ]
    if trace.skipped:
        lines.append(f"{trace.skipped} records skipped (failed requests, torn frames)")
    recorded = trace.recorded_hit_ratio()
    if recorded is not None:
        lines.append(f"the recorded server saw a hit ratio of {recorded * 100:.2f}%")
    return "\n".join(lines)
