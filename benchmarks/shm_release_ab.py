"""A/B of a shared-memory retrieve with its release sent behind (A, the default) or waited for (B,
what the client did before 2026-11-28), next to memcpy of the same bytes: one server, one client,
the three alternating rep by rep so that a VM that slows down slows all of them.

    .venv/bin/python benchmarks/shm_release_ab.py [--size-mib 2] [--chunks 16] [--reps 41] [--l2 SPEC]

``--l2 SPEC`` (e.g. ``memory:size_gb=1,name=mem``) gives the server an L2 tier: then B is the whole
retrieve of before, which probed the tiers first (a LOOKUP) even when L1 held every chunk, and A asks
L1 first. Every chunk is in L1 either way.

Each rep retrieves ``chunks`` objects of ``size-mib`` into numpy arrays (the bench's "retrieve"
row), then a PING drains what is in flight, so every rep starts alike. Prints medians, each as a
ratio to the same run's memcpy, and what sending the release behind saves per retrieve.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvdepot.bench.transfer import _layout_for, bench_server, wait_prefault
from kvdepot.client.client import ClientOptions, KVClient

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=2)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--reps", type=int, default=41)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--l2", default="", help="an --l2 tier spec for the server (B then probes first, as before)")
    args = p.parse_args()
    n, size = args.chunks, args.size_mib
    layout, cs = _layout_for(size)
    server = bench_server(2.0)
    if args.l2:
        server.args += ["--l2", args.l2]
    with server:
        wait_prefault(server)
        tokens = np.arange(n * cs, dtype=np.uint32) + 7_000_000
        kv = np.random.default_rng(0).integers(0, 1 << 15, size=layout.chunk_shape(n * cs), dtype=np.uint16).view(np.float16)
        srcs = [np.ascontiguousarray(kv[:, :, i * cs : (i + 1) * cs]) for i in range(n)]
        dsts = [np.zeros_like(s) for s in srcs]
        with KVClient(server.url, "bench", layout, options=ClientOptions(chunk_size=cs, transport="shm", timeout_s=60)) as c:
            c.wait_prefault(120)
            hashes = c.hashes(tokens)
            with c.prepare_store(hashes) as slots:
                for slot, s in zip(slots, srcs):
                    np.copyto(slot, s)
            link = c.link
            variants = {"A released behind": link.release_behind, "B release waited for": link.finish}

            def retrieve(probe_first: bool = False) -> None:
                if probe_first:  # what KVClient.prepare_retrieve did with L2 tiers before
                    link.stored_chunks(hashes, "", probe=True)
                with c.prepare_retrieve(hashes) as views:
                    for d, v in zip(dsts, views):
                        np.copyto(d, v)

            def memcpy() -> None:
                for d, s in zip(dsts, srcs):
                    np.copyto(d, s)

            times: dict[str, list[float]] = {name: [] for name in [*variants, "memcpy"]}
            for rep in range(args.warmup + args.reps):
                for name in times:
                    if name in variants:
                        link.release_behind = variants[name]
                    t0 = time.perf_counter()
                    if name == "memcpy":
                        memcpy()
                    else:
                        retrieve(probe_first=bool(args.l2) and name.startswith("B"))
                    elapsed = time.perf_counter() - t0
                    if rep >= args.warmup:
                        times[name].append(elapsed)
                    c.ping()
            link.release_behind = variants["A released behind"]
            pings = []
            for _ in range(101):
                t0 = time.perf_counter()
                c.ping()
                pings.append(time.perf_counter() - t0)
    nbytes = n * size * MiB
    med = {name: statistics.median(xs) for name, xs in times.items()}
    tier = f", L2 {args.l2} (B probes first)" if args.l2 else ""
    print(f"| {n} x {size} MiB shm retrieve{tier} | median | GB/s | ratio to memcpy |")
    print("|---|---|---|---|")
    for name, t in med.items():
        print(f"| {name} | {t * 1e3:.3f} ms | {nbytes / t / 1e9:.2f} | {med['memcpy'] / t:.2f} |")
    saved = med["B release waited for"] - med["A released behind"]
    print(f"\nA saves {saved * 1e6:.0f} µs a retrieve against B (medians of {args.reps}); PING p50 {statistics.median(pings) * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
