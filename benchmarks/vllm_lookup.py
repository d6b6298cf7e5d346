"""The vLLM connector's lookup of a long prompt, as vLLM's scheduler asks it, against a raw ZeroMQ round
trip measured in the same run (interleaved rounds, so drift on a shared host moves both alike).

The scheduler half (``SchedulerSide.get_num_new_matched_tokens``) gets a vLLM ``Request`` whose tokens
are a Python list and whose prefix hashes vLLM has made (sha256, as its engine core does when a
connector is configured). It hashes the prompt into kvdepot chunk keys and sends one LOOKUP (with its
session, locking the hit). Two rows per prompt length:

  first sight  the engine has not seen this prompt: every chunk is hashed from the token list
  seen before  the same prompt again (a new request id): chunk keys come from the hash cache, keyed by
               vLLM's own prefix hashes, and only the LOOKUP round trip is left

Each timed call is a fresh request; its session is ended (untimed) before the next. The limit is a raw
ZeroMQ round trip to an echo process, taken two ways: right after vLLM made a ``Request`` of the same
tokens, as each timed lookup is (like for like: on this VM the CPU caches the Request's hashing cooled
and the peer that slept make it about twice the back-to-back figure), and back to back.

    .venv/bin/python benchmarks/vllm_lookup.py [--tokens 8192,32768] [--rounds 15] [--json out.json]

Needs vLLM (scripts/install-vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from itertools import count

import numpy as np

from kvdepot.bench.rawzmq import RawEcho
from kvdepot.bench.serverproc import bench_server, free_port, wait_prefault
from kvdepot.bench.stats import loadavg
from kvdepot.client.client import ClientOptions, KVClient
from kvdepot.layout import KVLayout

BLOCK, CHUNK, MODEL = 16, 256, "bench-lookup"
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="8192,32768", help="prompt lengths (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of each figure (default: %(default)s)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per round (default: %(default)s)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvdepot.connectors.vllm.config import ConnectorConfig
    from kvdepot.connectors.vllm.hash_cache import ChunkHashCache
    from kvdepot.connectors.vllm.scheduler import SchedulerSide

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    ids = count()
    load_start = loadavg()
    results: dict = {}
    server = bench_server(1.0, "kvdepot-bench-lookup-")
    with server, RawEcho(f"tcp://127.0.0.1:{free_port()}") as echo:
        wait_prefault(server)
        config = ConnectorConfig(url=server.url, chunk_size=CHUNK, transport="inline")
        for n_tokens in [int(t) for t in args.tokens.split(",")]:
            tokens = list(range(1000 + n_tokens, 1000 + 2 * n_tokens + 1))  # one past whole chunks: all claimable
            with KVClient(server.url, MODEL, LAYOUT, options=ClientOptions(chunk_size=CHUNK)) as c:
                c.store(tokens[:n_tokens], np.ones(LAYOUT.chunk_shape(n_tokens), np.float16))
            cold = SchedulerSide(config, MODEL, LAYOUT, BLOCK)  # no cache: every request hashes its prompt
            warm = SchedulerSide(config, MODEL, LAYOUT, BLOCK, hash_cache=ChunkHashCache(CHUNK, BLOCK))

            def lookups(side: SchedulerSide, n: int) -> list[float]:
                out = []
                for _ in range(n):
                    req = Request(f"r{next(ids)}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                    t0 = time.perf_counter()
                    hit, _ = side.get_num_new_matched_tokens(req, 0)
                    out.append(time.perf_counter() - t0)
                    assert hit == n_tokens, (hit, n_tokens)
                    side.request_finished(req)
                return out

            def echoes_after_requests(n: int) -> list[float]:
                """Raw round trips, each right after vLLM made a Request as before a timed lookup: the
                same cold caches and sleeping peer the lookup meets (back to back, a round trip takes
                about half as long)."""
                out = []
                for _ in range(n):
                    Request(f"e{next(ids)}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
                    out += echo.round_trips(1)
                return out

            lookups(cold, 3), lookups(warm, 3), echo.round_trips(20)  # warm-up (and the cache's first sight)
            rtt, rtt_after, first, seen = [], [], [], []
            for _ in range(args.rounds):
                rtt += echo.round_trips(args.calls)
                rtt_after += echoes_after_requests(args.calls)
                first += lookups(cold, args.calls)
                seen += lookups(warm, args.calls)
            cold.shutdown()
            warm.shutdown()
            results[n_tokens] = {"rtt_us": [x * 1e6 for x in rtt], "rtt_after_request_us": [x * 1e6 for x in rtt_after],
                                 "first_us": [x * 1e6 for x in first], "seen_us": [x * 1e6 for x in seen]}  # fmt: skip
    load_end = loadavg()

    print("| lookup (vLLM scheduler, token list) | p50 | p99 | raw ZeroMQ tcp RTT p50 after a Request / back to back, same run | "
          "ratio to the RTT after a Request | ratio to back to back | target |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for n_tokens, r in results.items():
        base, after = statistics.median(r["rtt_us"]), statistics.median(r["rtt_after_request_us"])
        for key, label in (("first_us", "first sight (hashed)"), ("seen_us", "seen before (hash cache)")):
            xs = sorted(r[key])
            p50, p99 = statistics.median(xs), xs[int(0.99 * (len(xs) - 1))]
            target = "≤ 2" if key == "seen_us" else ""
            print(f"| {n_tokens // 1024}k tokens, {label} | {p50:.0f} µs | {p99:.0f} µs | {after:.0f} / {base:.0f} µs | {p50 / after:.2f} | "
                  f"{p50 / base:.2f} | {target} |")  # fmt: skip
    print(f"\nload average: start {load_start}, end {load_end}; {args.rounds} interleaved rounds of {args.calls} calls each")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "load_start": load_start, "load_end": load_end}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
