"""``kvdepot replay TRACE --server URL``: drive a running server through a trace with ``KVClient``s.

A public trace's request becomes what an engine does: LOOKUP its prefix, load the hits (RETRIEVE), and
STORE the chunks that missed. A recording's ops are replayed as recorded (each LOOKUP, STORE and
RETRIEVE in arrival order, with its model and cache salt). Block ids become chunk hashes through
``chains.py``; chunk size = block size, registered at REGISTER; the KV bytes are synthetic, of a small
layout (``--num-layers`` ...), so a replay measures the server's caching, not a model's size. Requests
go back to back unless ``--speed`` paces them by the trace's timestamps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from kvdepot.client.client import KVClient, check_url
from kvdepot.client.options import ClientOptions, Transport
from kvdepot.errors import KVDepotError
from kvdepot.layout import KVLayout, supported_dtypes
from kvdepot.trace.chains import BlockChains
from kvdepot.trace.mooncake import MOONCAKE_BLOCK_TOKENS
from kvdepot.trace.ops import OpKind, TraceOp
from kvdepot.trace.reader import load_trace
from kvdepot.trace.units import format_size

REPLAY_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")  # 512 B a token


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a Mooncake-format JSONL trace or a kvdepot recording (--trace-record)")
    p.add_argument("--server", required=True, help="the server's endpoint, tcp://HOST:PORT or ipc://PATH")
    p.add_argument("--block-tokens", type=int, default=MOONCAKE_BLOCK_TOKENS,
                   help="tokens per hash_id block of a Mooncake trace, registered as the chunk size (default: %(default)s)")  # fmt: skip
    p.add_argument("--speed", type=float, default=0.0, help="pace requests by the trace's timestamps, this many times faster (default: 0, back to back)")  # fmt: skip
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests or ops (default: all)")
    p.add_argument("--model", default="kvdepot-replay", help="model name for a Mooncake trace's requests (default: %(default)s)")
    p.add_argument("--cache-salt", default="", help="cache salt for a Mooncake trace's requests (default: none)")
    p.add_argument("--transport", choices=[t.value for t in Transport], default="auto", help="how KV moves: shm (same host), inline, or auto: shm where possible (default: %(default)s)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=30.0, help="deadline of one request (default: %(default)s)")
    lay = p.add_argument_group(f"synthetic KV layout (default: {REPLAY_LAYOUT.bytes_per_token} B a token)")
    lay.add_argument("--num-layers", type=int, default=REPLAY_LAYOUT.num_layers, help="(default: %(default)s)")
    lay.add_argument("--num-kv-heads", type=int, default=REPLAY_LAYOUT.num_kv_heads, help="(default: %(default)s)")
    lay.add_argument("--head-dim", type=int, default=REPLAY_LAYOUT.head_dim, help="(default: %(default)s)")
    lay.add_argument("--dtype", choices=supported_dtypes(), default=REPLAY_LAYOUT.dtype, help="(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead")


@dataclass
class ReplayResult:
    ops: int = 0
    asked_tokens: int = 0
    hit_tokens: int = 0
    bytes_stored: int = 0
    bytes_retrieved: int = 0
    chunks_stored: int = 0
    chunks_retrieved: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency_s: dict[str, list[float]] = field(default_factory=lambda: {"lookup": [], "retrieve": [], "store": []})
    wall_s: float = 0.0
    transports: set[str] = field(default_factory=set)

    @staticmethod
    def _ms(values: list[float], q: float) -> float | None:
        return float(np.percentile(np.asarray(values), q)) * 1e3 if values else None

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0

    def summary(self) -> dict:
        lat = {op: {"n": len(v), "p50_ms": self._ms(v, 50), "p99_ms": self._ms(v, 99)} for op, v in self.latency_s.items()}
        doc = {k: v for k, v in asdict(self).items() if k not in ("latency_s", "transports")}
        return {**doc, "hit_ratio": self.hit_ratio, "latency": lat, "transports": sorted(self.transports)}


class Replayer:
    """One KVClient per (model, chunk size) the trace names, all of the same synthetic layout."""

    def __init__(self, url: str, layout: KVLayout, options: ClientOptions, default_model: str, default_salt: str = "") -> None:
        self.url, self.layout, self.options = url, layout, options
        self.default_model, self.default_salt = default_model, default_salt
        self._clients: dict[tuple[str, int], tuple[KVClient, BlockChains, np.ndarray, np.ndarray]] = {}
        self.result = ReplayResult()

    def close(self) -> None:
        for client, *_ in self._clients.values():
            client.close()
        self._clients.clear()

    def __enter__(self) -> Replayer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _for(self, op: TraceOp):
        key = (op.model or self.default_model, op.block_tokens)
        got = self._clients.get(key)
        if got is None:
            opts = replace(self.options, chunk_size=op.block_tokens)
            client = KVClient(self.url, key[0], self.layout, options=opts)
            shape = self.layout.chunk_shape(op.block_tokens)
            raw = np.random.default_rng(op.block_tokens).integers(0, 256, size=self.layout.chunk_bytes(op.block_tokens), dtype=np.uint8)
            payload = raw.view(self.layout.storage_dtype).reshape(shape)
            got = (client, BlockChains(op.block_tokens, client.hash_algorithm), payload, np.empty_like(payload))
            self._clients[key] = got
            self.result.transports.add(client.transport)
        return got

    def run(self, op: TraceOp) -> None:
        client, chains, payload, scratch = self._for(op)
        # A request names its prompt's blocks from the first; a recorded op names chain hashes' ids, maybe a
        # chain's tail alone (an engine stores what it computed past its hit): hashed by id, not chained.
        hashes = chains.hashes(op.blocks) if op.kind is OpKind.REQUEST else chains.hashes_of_ids(op.blocks)
        salt = op.salt or self.default_salt
        r = self.result
        r.ops += 1
        if not hashes:  # a prompt shorter than one block: nothing to ask the server, nothing it could hit
            r.asked_tokens += op.prompt_tokens if op.asks else 0
            return
        try:
            if op.kind in (OpKind.REQUEST, OpKind.LOOKUP):
                hit = self._timed("lookup", lambda: client.stored_chunks(hashes, salt))
                r.asked_tokens += op.prompt_tokens
                r.hit_tokens += hit * op.block_tokens
                if op.kind is OpKind.REQUEST:
                    if hit:
                        self._retrieve(client, hashes[:hit], salt, scratch)
                    if hit < len(hashes):
                        self._store(client, hashes, salt, payload)
            elif op.kind is OpKind.STORE and hashes:
                self._store(client, hashes, salt, payload)
            elif op.kind is OpKind.RETRIEVE and hashes:
                self._retrieve(client, hashes, salt, scratch)
        except KVDepotError as exc:
            name = getattr(getattr(exc, "code", None), "name", type(exc).__name__)
            r.errors[name] = r.errors.get(name, 0) + 1

    def _timed(self, what: str, fn):
        t0 = time.perf_counter()
        out = fn()
        self.result.latency_s[what].append(time.perf_counter() - t0)
        return out

    def _store(self, client: KVClient, hashes, salt: str, payload: np.ndarray) -> None:
        def store() -> int:
            n = 0
            with client.prepare_store(hashes, salt) as slots:
                for slot in slots:
                    if slot is not None:
                        slot[...] = payload
                        n += 1
            return n

        n = self._timed("store", store)
        self.result.chunks_stored += n
        self.result.bytes_stored += n * payload.nbytes

    def _retrieve(self, client: KVClient, hashes, salt: str, scratch: np.ndarray) -> None:
        def retrieve() -> int:
            with client.prepare_retrieve(hashes, salt) as views:
                for v in views:
                    np.copyto(scratch, v)  # what an engine does with a hit: copy it into its own cache
                return len(views)

        n = self._timed("retrieve", retrieve)
        self.result.chunks_retrieved += n
        self.result.bytes_retrieved += n * scratch.nbytes


def replay(ops: list[TraceOp], replayer: Replayer, speed: float = 0.0) -> ReplayResult:
    """Run every op (paced by ``op.t / speed`` when ``speed`` > 0); Ctrl-C stops early with what ran."""
    start = time.monotonic()
    try:
        for op in ops:
            if speed > 0:
                wait = start + op.t / speed - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            replayer.run(op)
    except KeyboardInterrupt:
        print("interrupted: the figures cover the ops replayed so far", file=sys.stderr)
    replayer.result.wall_s = time.monotonic() - start
    return replayer.result


def main(args: argparse.Namespace) -> int:
    try:
        check_url(args.server)
        if args.speed < 0 or args.limit < 0 or args.block_tokens < 2:
            raise ValueError("--speed and --limit must be >= 0, --block-tokens >= 2")
        layout = KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, args.dtype)
        options = ClientOptions(transport=args.transport, timeout_s=args.timeout_s)
        trace = load_trace(args.trace, args.block_tokens, args.limit)
    except (OSError, ValueError) as exc:
        print(f"kvdepot replay: {exc}", file=sys.stderr)
        return 2
    if not trace.ops:
        print(f"kvdepot replay: {args.trace} holds nothing to replay", file=sys.stderr)
        return 2
    try:
        with Replayer(args.server, layout, options, args.model, args.cache_salt) as replayer:
            result = replay(trace.ops, replayer, args.speed)
    except KVDepotError as exc:  # e.g. no server there, or a registration it refuses
        print(f"kvdepot replay: {args.server}: {exc}", file=sys.stderr)
        return 1
    doc = {"trace": args.trace, "source": trace.source, "skipped": trace.skipped, "recorded_hit_ratio": trace.recorded_hit_ratio(),
           **result.summary()}  # fmt: skip
    print(json.dumps(doc, indent=2) if args.json else _text(doc))
    return 1 if result.errors and not result.asked_tokens else 0


def _text(doc: dict) -> str:
    lines = [
        f"replayed {doc['ops']} {'requests' if doc['source'] == 'mooncake' else 'recorded ops'} of {doc['trace']} in "
        f"{doc['wall_s']:.1f} s (transport {', '.join(doc['transports'])})",
        f"hit ratio: {doc['hit_ratio'] * 100:.2f}% of prompt tokens ({doc['hit_tokens']} of {doc['asked_tokens']})",
    ]
    if doc["recorded_hit_ratio"] is not None:
        lines.append(f"the recording saw: {doc['recorded_hit_ratio'] * 100:.2f}%")
    lines.append(f"stored {format_size(doc['bytes_stored'])} ({doc['chunks_stored']} chunks), "
                 f"retrieved {format_size(doc['bytes_retrieved'])} ({doc['chunks_retrieved']} chunks)")  # fmt: skip
    lines.append(f"{'latency':<10} {'p50':>10} {'p99':>10} {'n':>8}")
    for op, s in doc["latency"].items():
        if s["n"]:
            lines.append(f"{op:<10} {s['p50_ms']:>8.3f}ms {s['p99_ms']:>8.3f}ms {s['n']:>8}")
    if doc["errors"]:
        lines.append("errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(doc["errors"].items())))
    if doc["skipped"]:
        lines.append(f"{doc['skipped']} trace records skipped (failed requests, torn frames)")
    return "\n".join(lines)
