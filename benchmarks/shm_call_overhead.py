"""What a shared-memory store costs besides its copies: the PREPARE and COMMIT of a batch, next to a
PING and a LOOKUP of the same keys, with no byte written. One server, one client, every call of a
repetition back to back, so a VM that slows down slows all of them.

    .venv/bin/python benchmarks/shm_call_overhead.py [--chunks 16] [--size-mib 2] [--reps 300]

Rows (medians, µs, and each as a multiple of the same run's PING):
- ``ping``: the round trip with nothing to do;
- ``lookup``: LOOKUP of the batch's keys (absent): the dispatch of a request that names keys;
- ``prepare (request)`` / ``commit (request)``: the two requests alone, as the wire carries them;
- ``prepare_store() block``: the client's whole block, its slot views and lease renewal included.

To compare two versions of the code, run each with ``PYTHONPATH=<checkout>/src`` (the server process
inherits it), alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvdepot.bench.transfer import _layout_for, bench_server, wait_prefault
from kvdepot.client.client import ClientOptions, KVClient
from kvdepot.protocol import messages as m


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--size-mib", type=int, default=2)
    p.add_argument("--reps", type=int, default=300)
    args = p.parse_args()
    layout, cs = _layout_for(args.size_mib)
    n, reps = args.chunks, args.reps
    clear_every = max(1, (1 << 30) // (2 * n * args.size_mib << 20))  # two batches a rep, in a 2 GiB L1
    server = bench_server(2.0)
    with server:
        wait_prefault(server)
        with KVClient(server.url, "bench", layout, options=ClientOptions(chunk_size=cs, transport="shm", timeout_s=60)) as c:
            c.wait_prefault(120)
            link = c.link
            batches = [c.hashes(np.arange(n * cs, dtype=np.uint32) + 10_000_000 + i * n * cs) for i in range(2 * reps)]
            rows: dict[str, list[float]] = {k: [] for k in ("ping", "lookup", "prepare (request)", "commit (request)", "prepare_store() block")}
            for rep in range(reps):
                t0 = time.perf_counter()
                c.ping()
                t1 = time.perf_counter()
                link.lookup(batches[rep], "", probe=True)
                t2 = time.perf_counter()
                reply = link.request(m.PrepareStoreRequest(context_id=0, keys=list(batches[rep]), cache_salt=""))
                t3 = time.perf_counter()
                link.finish(m.CommitStoreRequest(context_id=link.registration.context_id, lease_id=reply.lease_id, abort=False))
                t4 = time.perf_counter()
                with c.prepare_store(batches[reps + rep]):
                    pass
                t5 = time.perf_counter()
                for name, took in zip(rows, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                    rows[name].append(took)
                if rep % clear_every == clear_every - 1:
                    c.clear()
    ping = statistics.median(rows["ping"])
    print(f"{n} chunks of {args.size_mib} MiB, {reps} repetitions (medians)")
    print("| call | µs | x PING |")
    print("|---|---:|---:|")
    for name, xs in rows.items():
        med = statistics.median(xs)
        print(f"| {name} | {med * 1e6:.0f} | {med / ping:.2f} |")


if __name__ == "__main__":
    main()
