"""``kvdepot bench transfer``: how fast KV moves between a worker and a real server process.

Every figure is printed next to the physical limit measured in the same run and their ratio:
single-thread memcpy of the same object sizes for the data paths, a raw ZeroMQ round trip for PING and
LOOKUP. Threads are pinned to one per process (OMP/MKL/OpenBLAS) as BENCHMARKING.md asks; the arena
is pre-faulted (server and client mappings) before anything is timed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass

import numpy as np

from kvdepot.bench.rawzmq import round_trips_like
from kvdepot.bench.serverproc import ServerProcess, bench_server, wait_prefault
from kvdepot.bench.stats import gbps, loadavg, memcpy_gbps, percentile, sample, timed
from kvdepot.connectors.paged import gather_chunks, scatter_chunks
from kvdepot.layout import KVLayout

MiB = 1 << 20
# A Llama-3-8B-like KV: 32 layers, 8 KV heads of 128, fp16 = 128 KiB per token.
BENCH_LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16")
BLOCK_SIZE = 16


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", default="2,32", help="chunk object sizes in MiB (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per store/retrieve call (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default: %(default)s)")
    p.add_argument("--transports", default="shm,inline", help="(default: %(default)s)")
    p.add_argument("--l1-size-gb", type=float, default=2.0, help="server L1 size (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not for quoting)")
    p.add_argument(
        "--curve",
        choices=("off", "also", "only"),
        default="off",
        help="the inline path over TCP with CurveZMQ encryption on and off (two servers, interleaved runs): "
        "also, or only that (default: %(default)s)",
    )
    p.add_argument(
        "--bus",
        choices=("off", "also", "only"),
        default="off",
        help="PING and LOOKUP with the event bus on and off (two servers, interleaved rounds): also, or only that (default: %(default)s)",
    )


@dataclass
class Row:
    metric: str
    value: str
    limit: str
    ratio: str
    target: str = ""


def _pin_threads() -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = "1"


def main(args: argparse.Namespace) -> int:
    _pin_threads()
    reps, warmup = (3, 1) if args.quick else (args.reps, args.warmup)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    transports = args.transports.split(",")
    load_start = loadavg()
    server = bench_server(args.l1_size_gb)
    rows: list[Row] = []
    raw: dict = {"load_start": load_start, "sizes_mib": sizes, "chunks": args.chunks, "reps": reps}
    if args.curve != "only" and args.bus != "only":
        with server:
            prefault_s = wait_prefault(server)
            print(f"# server arena ({args.l1_size_gb} GiB) pre-faulted in {prefault_s:.1f}s; load {load_start}", file=sys.stderr)
            for size in sizes:
                rows += _bench_size(server, size, args.chunks, transports, reps, warmup, raw)
            rows += _bench_latency(server, reps, raw)
    if args.bus != "off":
        from kvdepot.bench.bus import bench_bus

        rows += bench_bus(8 if args.quick else 8 * max(reps, 5), raw)
    if args.curve != "off" and args.bus != "only":
        from kvdepot.bench.curve import bench_curve

        for size in sizes:
            layout, cs = _layout_for(size)
            rows += bench_curve(layout, cs, size, args.chunks, reps, warmup, args.l1_size_gb, raw)
    raw["load_end"] = loadavg()
    _print_table(rows, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "raw": raw}, f, indent=2, default=str)
    return 0


def _layout_for(size_mib: int) -> tuple[KVLayout, int]:
    chunk_size = size_mib * MiB // BENCH_LAYOUT.bytes_per_token
    if chunk_size < BLOCK_SIZE or chunk_size % BLOCK_SIZE:
        raise ValueError(f"{size_mib} MiB is not a whole number of {BLOCK_SIZE}-token blocks of this layout")
    return BENCH_LAYOUT, chunk_size


def _bench_size(server: ServerProcess, size_mib: int, n: int, transports: list[str], reps: int, warmup: int, raw: dict) -> list[Row]:
    from kvdepot.client.client import ClientOptions, KVClient

    layout, cs = _layout_for(size_mib)
    nbytes = size_mib * MiB * n
    memcpy = memcpy_gbps(size_mib * MiB, n, reps)
    raw[f"memcpy_{size_mib}MiB"] = asdict(memcpy)
    rows = [Row(f"memcpy {n} x {size_mib} MiB (1 thread)", memcpy.fmt("GB/s"), "—", "1.00")]
    zmq_put = zmq_get = None
    if "inline" in transports:
        from kvdepot.bench.rawzmq import bulk_gbps
        from kvdepot.client.transfer import INLINE_BATCH_BYTES
        from kvdepot.protocol.codec import TARGET_FRAME_BYTES

        ep = f"ipc://{tempfile.mkdtemp(prefix='kvdepot-raw-')}/raw.sock"
        puts, gets = bulk_gbps(ep, nbytes, min(TARGET_FRAME_BYTES, size_mib * MiB), max(INLINE_BATCH_BYTES, size_mib * MiB), reps)
        zmq_put, zmq_get = sample(puts), sample(gets)
        raw[f"raw_zmq_ipc_{size_mib}MiB"] = {"put": asdict(zmq_put), "get": asdict(zmq_get)}
        rows.append(Row("raw ZeroMQ ipc, same frames: send / receive", f"{zmq_put.median:.2f} / {zmq_get.median:.2f} GB/s", "—", "1.00"))
    tokens = np.arange(n * cs, dtype=np.uint32) + size_mib * 1_000_000
    kv = np.random.default_rng(0).integers(0, 1 << 15, size=layout.chunk_shape(n * cs), dtype=np.uint16).view(np.float16)
    out = np.zeros_like(kv)
    # A paged cache holding the same tokens in shuffled blocks (vLLM flash-attn layout, one array per layer).
    nblocks = n * cs // BLOCK_SIZE
    rng = np.random.default_rng(1)
    table = rng.permutation(nblocks + 32)[:nblocks]
    # One allocation holding every layer, each layer a view of it (as vLLM allocates its KV cache).
    paged = np.zeros((layout.num_layers, 2, nblocks + 32, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim), np.float16)
    # Written, as an engine's cache is: untouched zeros would map one shared zero page, and a gather
    # reading that page alone runs faster than any memcpy (up to 1.9 x memcpy measured so). Each
    # (layer, K/V, block) holds its own tag, so the check after the scatter rows sees a block that came
    # back wrong, from another block, or not at all.
    tags = (np.arange(layout.num_layers * 2 * (nblocks + 32), dtype=np.uint32) % 65521 + 1).astype(np.uint16)
    paged.view(np.uint16)[...] = tags.reshape(layout.num_layers, 2, nblocks + 32, 1, 1, 1)
    caches = [paged[layer] for layer in range(layout.num_layers)]
    per_chunk = cs // BLOCK_SIZE
    block_ids = [table[i * per_chunk : (i + 1) * per_chunk] for i in range(n)]
    # "Transfer alone" moves contiguous chunk objects (as LMCache's figure does); the API rows use
    # store()/retrieve() on one [K, L, T, H, D] array, whose per-chunk slices are strided.
    chunks_src = [np.ascontiguousarray(kv[:, :, i * cs : (i + 1) * cs]) for i in range(n)]
    chunks_dst = [np.zeros_like(c) for c in chunks_src]
    for tr in transports:
        url = server.ipc_url if tr == "inline" else server.url
        with KVClient(url, "bench", layout, options=ClientOptions(chunk_size=cs, transport=tr, timeout_s=60)) as c:
            c.wait_prefault(120)
            hashes = c.hashes(tokens)
            label = f"{tr}{' (ipc)' if tr == 'inline' else ''} {n} x {size_mib} MiB"

            def store() -> None:
                with c.prepare_store(hashes) as slots:
                    for slot, src in zip(slots, chunks_src):
                        np.copyto(slot, src)

            def retrieve() -> None:
                with c.prepare_retrieve(hashes) as views:
                    assert len(views) == n
                    for view, dst in zip(views, chunks_dst):
                        np.copyto(dst, view)

            def store_api() -> None:
                assert c.store(tokens, kv) == n * cs

            def retrieve_api() -> None:
                assert c.retrieve(tokens, out=out).shape[2] == n * cs

            def store_gather() -> None:
                with c.prepare_store(hashes) as slots:
                    gather_chunks(caches, block_ids, slots)

            def retrieve_scatter() -> None:
                with c.prepare_retrieve(hashes) as views:
                    assert len(views) == n
                    scatter_chunks(views, caches, block_ids)

            results = {
                "store": gbps(nbytes, timed(store, reps, warmup, setup=c.clear)),
                "retrieve": gbps(nbytes, timed(retrieve, reps, warmup)),
            }
            for src, dst in zip(chunks_src, chunks_dst):
                assert np.array_equal(src.view(np.uint16), dst.view(np.uint16)), "retrieved bytes differ"
            results["store incl. paged gather"] = gbps(nbytes, timed(store_gather, reps, warmup, setup=c.clear))
            results["retrieve incl. paged scatter"] = gbps(nbytes, timed(retrieve_scatter, reps, warmup))
            paged[:, :, table] = 0  # untimed: the blocks the scatter writes, emptied, then one more scatter
            retrieve_scatter()
            want = tags.reshape(layout.num_layers, 2, nblocks + 32)[:, :, table, None, None, None]
            for layer in range(layout.num_layers):  # a layer at a time: no second copy of the whole cache
                got = paged[layer].view(np.uint16)[:, table]
                assert np.array_equal(got, np.broadcast_to(want[layer], got.shape)), "retrieve incl. paged scatter: the blocks differ from those gathered"
            results["store() of a [K,L,T,H,D] array"] = gbps(nbytes, timed(store_api, reps, warmup, setup=c.clear))
            results["retrieve(out=) into a [K,L,T,H,D] array"] = gbps(nbytes, timed(retrieve_api, reps, warmup))
            assert np.array_equal(out.view(np.uint16), kv.view(np.uint16)), "retrieved bytes differ"
            raw[f"{tr}_{size_mib}MiB"] = {k: asdict(v) for k, v in results.items()}
            shm = tr == "shm"
            targets = {
                "store": "≥ 0.9" if shm else "≥ 3 GB/s",
                "retrieve": "≥ 0.9" if shm else "≥ 3 GB/s",
                "store incl. paged gather": "≥ 0.5" if shm else "",
                "retrieve incl. paged scatter": "≥ 0.5" if shm else "",
            }
            for name, s in results.items():
                if shm:
                    limit, ratio = f"{memcpy.median:.2f} GB/s memcpy", s.median / memcpy.median
                else:  # the wire is the limit: compare with raw ZeroMQ in the same direction
                    ref = zmq_put if name.startswith("store") else zmq_get
                    limit, ratio = f"{ref.median:.2f} GB/s raw ZeroMQ", s.median / ref.median
                rows.append(Row(f"{label} {name}", s.fmt("GB/s"), limit, f"{ratio:.2f}", targets.get(name, "")))
            c.clear()
    return rows


def _bench_latency(server: ServerProcess, reps: int, raw: dict) -> list[Row]:
    from kvdepot.client.client import ClientOptions, KVClient

    rows = []
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16)
    n_ping = 2000
    for name, url in (("tcp", server.url), ("ipc", server.ipc_url)):
        floor = round_trips_like(url, n_ping)
        with KVClient(url, "bench-latency", tiny, options=ClientOptions(transport="inline", heartbeat=False)) as c:
            pings = timed(c.ping, n_ping, warmup=100)
            p50, p99 = percentile(pings, 50), percentile(pings, 99)
            f50 = percentile(floor, 50)
            raw[f"ping_{name}"] = {"p50_us": p50 * 1e6, "p99_us": p99 * 1e6, "raw_zmq_p50_us": f50 * 1e6}
            rows.append(Row(f"PING {name} p50 / p99", f"{p50 * 1e6:.0f} / {p99 * 1e6:.0f} µs", f"{f50 * 1e6:.0f} µs raw ZMQ RTT", f"{f50 / p50:.2f}", "≤ 80 µs (ipc)"))
            for n_tokens in (8192, 32768):
                tokens = np.arange(n_tokens, dtype=np.uint32) + 7
                kv = np.zeros(tiny.chunk_shape(n_tokens), np.float16)
                c.store(tokens, kv)
                assert c.lookup(tokens) == n_tokens
                hashes = c.hashes(tokens)
                full = timed(lambda: c.lookup(tokens), 500, warmup=50)
                server_only = timed(lambda: c.lookup_chunks(hashes), 500, warmup=50)
                hash_only = timed(lambda: c.hashes(tokens), 200, warmup=20)
                raw[f"lookup_{name}_{n_tokens}"] = {
                    "p50_us": percentile(full, 50) * 1e6,
                    "p99_us": percentile(full, 99) * 1e6,
                    "precomputed_hashes_p50_us": percentile(server_only, 50) * 1e6,
                    "hashing_p50_us": percentile(hash_only, 50) * 1e6,
                }
                p50 = percentile(full, 50)
                rows.append(
                    Row(
                        f"LOOKUP {n_tokens // 1024}k tokens {name} p50 (hashing {percentile(hash_only, 50) * 1e6:.0f} µs incl.)",
                        f"{p50 * 1e6:.0f} µs (p99 {percentile(full, 99) * 1e6:.0f})",
                        f"{f50 * 1e6:.0f} µs raw ZMQ RTT",
                        f"{f50 / p50:.2f}",
                        "≤ 300 µs" if n_tokens == 32768 else "",
                    )
                )
            # What engines hand over: a Python list of ints (hashing converts it without numpy's detour).
            as_list = (np.arange(32768, dtype=np.uint32) + 7).tolist()
            listed = timed(lambda: c.lookup(as_list), 500, warmup=50)
            p50 = percentile(listed, 50)
            raw[f"lookup_{name}_32768_list"] = {"p50_us": p50 * 1e6, "p99_us": percentile(listed, 99) * 1e6}
            rows.append(
                Row(
                    f"LOOKUP 32k tokens {name} p50, from a Python list",
                    f"{p50 * 1e6:.0f} µs (p99 {percentile(listed, 99) * 1e6:.0f})",
                    f"{f50 * 1e6:.0f} µs raw ZMQ RTT",
                    f"{f50 / p50:.2f}",
                    "",
                )
            )
            c.clear()
    return rows


def _print_table(rows: list[Row], raw: dict) -> None:
    print("| metric | median (min-max) | physical limit, same run | ratio | target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.metric} | {r.value} | {r.limit} | {r.ratio} | {r.target} |")
    print(f"\nload average: start {raw['load_start']}, end {raw['load_end']}; {raw['reps']} timed reps each")
