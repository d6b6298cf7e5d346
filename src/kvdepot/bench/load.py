"""``kvdepot bench load``: many engines on one server.

N client processes (1, 2, 4, 8, 16 by default), each its own interpreter as engine workers are, against
one real server. Once all are connected they start together and for ``--seconds`` each repeats one
round: LOOKUP of its prompt (a Python list of token ids, as vLLM hands them over, hashed on the way),
PREPARE of the prompt's chunks (``prepare_retrieve`` with the hashes the lookup made) and the copy out
of them, and a PING; every call is timed. Prompts are ``own`` (each client its own, stored by itself
first) or ``shared`` (one prompt that every client reads). Limits in the same run: memcpy of the
same chunk sizes on min(clients, CPUs) threads at once (aggregate GB/s) and a raw ZeroMQ round trip
(latencies).

Two phases per client count: back to back (every client runs rounds without pause: the aggregate
GB/s: each client's bytes over the time to the end of its last round, summed; and what latency
becomes when the clients saturate the cores), then paced (``--rate`` rounds a
second per client from random phases, as requests reach engines: the latencies the target reads).

What the figures answer: does the aggregate hold as clients are added, how far the tail of a LOOKUP
moves under load (paced p99 at N clients against the 1-client p50), and how close the inline path's
aggregate comes to memcpy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvdepot.bench.rawzmq import round_trips_like
from kvdepot.bench.serverproc import ServerProcess, bench_server, wait_prefault
from kvdepot.bench.stats import loadavg, memcpy_gbps_threads, percentile
from kvdepot.layout import KVLayout

MiB = 1 << 20
# 2 layers of 8 KV heads of 128, fp16: 8 KiB per token, so a 4k-token prompt is 32 MiB in 2 MiB chunks
# and 16 clients' own prompts fit a 2 GiB L1 together.
LOAD_LAYOUT = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, dtype="float16")
CHUNK_TOKENS = 256


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", default="1,2,4,8,16", help="client process counts (default: %(default)s)")
    p.add_argument("--prompts", default="own,shared", help="own: each client its own prompt; shared: one for all (default: %(default)s)")
    p.add_argument("--transports", default="shm,inline", help="(default: %(default)s)")
    p.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens (default: %(default)s: 32 MiB of KV)")
    p.add_argument("--seconds", type=float, default=3.0, help="how long every client runs its rounds (default: %(default)s)")
    p.add_argument("--l1-size-gb", type=float, default=2.0, help="server L1 size (default: %(default)s)")
    p.add_argument("--rate", type=float, default=5.0,
                   help="rounds a second per client in the paced phase, the one the latency target reads (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="1,4 clients, 1 s each (a smoke run, not for quoting)")


# --- one client (a child process) ---------------------------------------------------------------------


def _client(spec: dict) -> int:
    """Connect, store the prompt if it is this client's to store, say ready, then run the phases it is
    told (``run START END RATE``), answering each with its timings."""
    from kvdepot.client.client import ClientOptions, KVClient

    tokens = (np.arange(spec["tokens"], dtype=np.uint32) + spec["prompt_seed"] * 1_000_000).tolist()
    with KVClient(spec["url"], "bench-load", LOAD_LAYOUT,
                  options=ClientOptions(chunk_size=CHUNK_TOKENS, transport=spec["transport"], timeout_s=60)) as c:  # fmt: skip
        c.wait_prefault(120)
        hashes = c.hashes(tokens)
        kv = np.random.default_rng(spec["prompt_seed"]).integers(0, 1 << 15, LOAD_LAYOUT.chunk_shape(len(tokens)), dtype=np.uint16)
        if spec["store"]:
            assert c.store(tokens, kv.view(np.float16)) == len(tokens)
        else:  # the shared prompt, stored by another client before this one was started
            assert c.lookup(tokens) == len(tokens), "the shared prompt is not stored"
        if not np.array_equal(c.retrieve(tokens).view(np.uint16), kv):  # what the rounds then read is the right KV
            print(json.dumps({"error": "the prompt read back differs from what was stored"}), flush=True)
            return 1
        dst = [np.empty(LOAD_LAYOUT.chunk_shape(CHUNK_TOKENS), np.float16) for _ in hashes]
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if not cmd or cmd[0] != "run":
                break
            print(json.dumps(_rounds(c, tokens, hashes, dst, float(cmd[1]), float(cmd[2]), float(cmd[3]))), flush=True)
    return 0


def _rounds(c, tokens: list[int], hashes: list, dst: list[np.ndarray], start: float, end: float, rate: float) -> dict:
    """Rounds from ``start`` until ``end`` (wall clock): back to back (``rate`` 0), or ``rate`` a
    second at a fixed pace from a random phase, as requests reach an engine."""
    lookup, prepare, ping, rounds, moved = [], [], [], 0, 0
    finished = start  # wall clock at the end of the last round: a round begun before ``end`` ends after it
    pc = time.perf_counter
    period = 1.0 / rate if rate else 0.0
    due = start + (np.random.default_rng().random() * period)
    while True:
        now = time.time()
        if period:
            if due > now:
                time.sleep(due - now)
            due += period
        elif now < start:
            time.sleep(start - now)
        if time.time() >= end:
            break
        t0 = pc()
        found = c.lookup(tokens)
        t1 = pc()
        with c.prepare_retrieve(hashes) as views:
            t2 = pc()
            for view, out in zip(views, dst, strict=False):
                np.copyto(out, view)
            moved += sum(v.nbytes for v in views)
        t3 = pc()
        c.ping()
        t4 = pc()
        finished = time.time()
        if found != len(tokens):
            return {"error": f"LOOKUP found {found} of {len(tokens)} tokens"}
        lookup.append(t1 - t0)
        prepare.append(t2 - t1)
        ping.append(t4 - t3)
        rounds += 1
    return {"lookup": lookup, "prepare": prepare, "ping": ping, "rounds": rounds, "bytes": moved, "elapsed": finished - start}


class _Client:
    def __init__(self, spec: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.load", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    def answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a load client exited ({self.proc.wait()})")
        got = json.loads(line)
        if "error" in got:
            raise RuntimeError(f"a load client failed: {got['error']}")
        return got

    def run(self, start: float, end: float, rate: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {start} {end} {rate}\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


# --- the parent ---------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    transport: str
    prompts: str
    clients: int
    gbps: float  # back to back: the sum of every client's retrieved bytes / the time its rounds took
    rounds: int
    lookup_p50_us: float  # back to back (every client saturating its core share)
    lookup_p99_us: float
    prepare_p50_us: float
    prepare_p99_us: float
    ping_p50_us: float
    ping_p99_us: float
    paced_rate: float  # rounds a second per client in the paced phase
    paced_lookup_p50_us: float
    paced_lookup_p99_us: float
    paced_prepare_p99_us: float
    paced_ping_p99_us: float


def _run(server: ServerProcess, transport: str, prompts: str, n: int, tokens: int, seconds: float, paced_rate: float) -> LoadResult:
    url = server.ipc_url if transport == "inline" else server.url
    shared = prompts == "shared"
    clients: list[_Client] = []
    try:
        if shared:  # stored once, before the readers start
            clients.append(_Client({"url": url, "transport": transport, "tokens": tokens, "prompt_seed": 1, "store": True}))
            clients[0].answer()  # ready: stored
        for i in range(n - len(clients)):
            seed = 1 if shared else i + 1 + 100 * n
            clients.append(_Client({"url": url, "transport": transport, "tokens": tokens, "prompt_seed": seed, "store": not shared}))
        for c in clients[1 if shared else 0 :]:
            c.answer()  # ready
        phases = []
        for rate in (0.0, paced_rate):
            start = time.time() + 0.2
            for c in clients:
                c.run(start, start + seconds, rate)
            phases.append([c.answer() for c in clients])
    finally:
        for c in clients:
            c.close()
    busy, paced = phases

    def values(results: list[dict], op: str) -> list[float]:
        got = [x for r in results for x in r[op]]
        if not got:
            raise RuntimeError("no client finished a round in the window: give it more --seconds")
        return got

    def us(results: list[dict], op: str, q: float) -> float:
        return percentile(values(results, op), q) * 1e6

    # Each client's own span (its last round overran the window by up to a round): bytes / window
    # would count that round's bytes in time it did not get.
    aggregate = sum(r["bytes"] / r["elapsed"] for r in busy if r["elapsed"] > 0) / 1e9
    return LoadResult(transport, prompts, n, aggregate, sum(r["rounds"] for r in busy),
                      us(busy, "lookup", 50), us(busy, "lookup", 99), us(busy, "prepare", 50), us(busy, "prepare", 99),
                      us(busy, "ping", 50), us(busy, "ping", 99), paced_rate, us(paced, "lookup", 50), us(paced, "lookup", 99),
                      us(paced, "prepare", 99), us(paced, "ping", 99))  # fmt: skip


def main(args: argparse.Namespace) -> int:
    counts = [1, 4] if args.quick else [int(x) for x in args.clients.split(",")]
    seconds = 1.0 if args.quick else args.seconds
    load_start = loadavg()
    server = bench_server(args.l1_size_gb, "kvdepot-bench-load-")
    chunk_bytes = LOAD_LAYOUT.bytes_per_token * CHUNK_TOKENS
    results: list[LoadResult] = []
    with server:
        wait_prefault(server)
        # The limit of N clients is memcpy on as many cores as they can use: min(N, CPUs) threads at once.
        cpus = os.cpu_count() or 1
        memcpy = {t: memcpy_gbps_threads(chunk_bytes, args.tokens // CHUNK_TOKENS, 7, t).median for t in sorted({min(n, cpus) for n in counts})}
        rtt = {"tcp": percentile(round_trips_like(server.url, 1000), 50), "ipc": percentile(round_trips_like(server.ipc_url, 1000), 50)}
        for transport in args.transports.split(","):
            for prompts in args.prompts.split(","):
                for n in counts:
                    r = _run(server, transport, prompts, n, args.tokens, seconds, args.rate)
                    results.append(r)
                    print(f"# {transport} {prompts} {n:2d} clients: {r.gbps:.2f} GB/s, LOOKUP p50/p99 {r.lookup_p50_us:.0f}/{r.lookup_p99_us:.0f} µs",
                          file=sys.stderr, flush=True)  # fmt: skip
                    server.clear("l1")  # the next run starts from an empty L1
    load_end = loadavg()
    _print(results, memcpy, rtt, args, chunk_bytes, load_start, load_end)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": [asdict(r) for r in results], "memcpy_gbps": memcpy, "raw_zmq_rtt_s": rtt,
                       "load_start": load_start, "load_end": load_end}, f, indent=2)  # fmt: skip
    return 0


def _print(results: list[LoadResult], memcpy: dict[int, float], rtt: dict, args, chunk_bytes: int, load_start: str, load_end: str) -> None:
    cpus = os.cpu_count() or 1
    copies = ", ".join(f"{t} thread{'s' if t > 1 else ''} {g:.2f}" for t, g in sorted(memcpy.items()))
    print(f"Prompt {args.tokens} tokens = {args.tokens // CHUNK_TOKENS} chunks of {chunk_bytes // MiB} MiB; memcpy of "
          f"the same chunks (aggregate GB/s): {copies}; raw ZeroMQ RTT tcp {rtt['tcp'] * 1e6:.0f} µs, ipc {rtt['ipc'] * 1e6:.0f} µs; "
          f"load {load_start} -> {load_end}; {os.cpu_count()} CPUs; paced phase {args.rate:g} rounds/s per client\n")  # fmt: skip
    print("| path | prompts | clients | aggregate GB/s | / memcpy on min(clients, CPUs) threads | / previous row | back to back: LOOKUP p50 / p99 µs | "
          "paced: LOOKUP p50 / p99 µs | paced p99 / 1-client paced p50 | paced: PREPARE p99, PING p99 µs |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key in dict.fromkeys((r.transport, r.prompts) for r in results):
        rows = [r for r in results if (r.transport, r.prompts) == key]
        one = next((r.paced_lookup_p50_us for r in rows if r.clients == 1), None)  # no 1-client run: no ratio
        prev = None
        for r in rows:
            step = f"{r.gbps / prev:.2f}" if prev else "—"
            print(f"| {r.transport} | {r.prompts} | {r.clients} | {r.gbps:.2f} | {r.gbps / memcpy[min(r.clients, cpus)]:.2f} | {step} | "
                  f"{r.lookup_p50_us:.0f} / {r.lookup_p99_us:.0f} | {r.paced_lookup_p50_us:.0f} / {r.paced_lookup_p99_us:.0f} | "
                  f"{f'{r.paced_lookup_p99_us / one:.1f}' if one else '—'} | {r.paced_prepare_p99_us:.0f}, {r.paced_ping_p99_us:.0f} |")  # fmt: skip
            prev = r.gbps
    print("\nBack to back: every client runs rounds without pause (the aggregate). Paced: the same clients at a fixed rate "
          "each, from random phases (the latencies an engine's requests see). Targets: the aggregate does not fall as clients "
          "are added (/ previous row >= 1); paced LOOKUP p99 at 16 clients <= 5 x the 1-client p50; the inline aggregate >= "
          "0.5 x memcpy.")  # fmt: skip


if __name__ == "__main__":
    sys.exit(_client(json.loads(sys.argv[1])))
