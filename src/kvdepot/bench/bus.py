"""``kvdepot bench transfer --bus``: what the event bus costs the request path.

Two real servers on one ipc endpoint each, alike but for ``--event-queue-size`` (the default, with the
metrics, the recent-events ring, the alarm and KV events subscribed; and 0, the bus off). PING and a
LOOKUP of a stored 8-chunk prefix, as an engine asks it (a Python list of tokens), alternate between
them in rounds (which goes first alternates too), so drift and a neighbour's burst hit both alike.
Reported: each side's median latency, and bus-off / bus-on (1.00: no cost; the target is >= 0.95), with
the range of the rounds' own ratios: the spread this run could resolve.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.bench.stats import percentile, timed
from kvdepot.bench.transfer import Row
from kvdepot.layout import KVLayout

SIDES = ("bus off", "bus on")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32)
CHUNK = 256
PER_ROUND = 50  # short rounds, many of them: drift hits both sides alike


def bench_bus(rounds: int, raw: dict) -> list[Row]:
    from kvdepot.client.client import ClientOptions, KVClient

    tmp = tempfile.mkdtemp(prefix="kvdepot-bench-bus-")
    common = ["--l1-size-gb", "0.25", "--log-level", "warning", "--no-prefault"]
    extra = {"bus off": ["--event-queue-size", "0"], "bus on": ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]}
    servers = {
        side: ServerProcess(args=[*common, *extra[side]], http_port=0, ipc_path=os.path.join(tmp, f"{i}.sock"), env={"OMP_NUM_THREADS": "1"},
                            log_path=os.path.join(tmp, f"{i}.log"))  # fmt: skip
        for i, side in enumerate(SIDES)
    }
    tokens = [int(t) for t in np.arange(8 * CHUNK) + 7_000_000]  # a Python list, as vLLM hands them
    kv = np.ones(LAYOUT.chunk_shape(len(tokens)), np.float16)
    ping_s: dict[str, list[float]] = {s: [] for s in SIDES}
    lookup_s: dict[str, list[float]] = {s: [] for s in SIDES}
    # Each round's own off / on ratio of p50s: their spread says what the VM resolves this time.
    round_ratios: dict[str, list[float]] = {"PING": [], "LOOKUP": []}
    with servers["bus off"], servers["bus on"]:
        opts = ClientOptions(chunk_size=CHUNK, transport="inline", heartbeat=False)
        clients = {side: KVClient(servers[side].ipc_url, "bench-bus", LAYOUT, options=opts) for side in SIDES}
        try:
            for c in clients.values():
                assert c.store(tokens, kv) == len(tokens)
            for r in range(rounds + 1):
                this_round: dict[str, dict[str, float]] = {"PING": {}, "LOOKUP": {}}
                for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                    c = clients[side]
                    pings = timed(c.ping, PER_ROUND, warmup=5)
                    lookups = timed(lambda c=c: c.lookup(tokens), PER_ROUND, warmup=5)
                    if r:  # round 0 warms both up
                        ping_s[side] += pings
                        lookup_s[side] += lookups
                        this_round["PING"][side] = percentile(pings, 50)
                        this_round["LOOKUP"][side] = percentile(lookups, 50)
                if r:
                    for name, p50 in this_round.items():
                        round_ratios[name].append(p50["bus off"] / p50["bus on"])
        finally:
            for c in clients.values():
                c.close()
    rows = []
    for name, samples in (("PING", ping_s), ("LOOKUP 8 chunks (token list)", lookup_s)):
        off, on = percentile(samples["bus off"], 50), percentile(samples["bus on"], 50)
        ratios = round_ratios[name.split()[0]]
        raw[f"bus_{name.split()[0].lower()}_p50_us"] = {"off": off * 1e6, "on": on * 1e6, "n": len(samples["bus on"]), "round_ratios": ratios}
        spread = f" (rounds {min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        rows.append(Row(f"{name} p50, event bus on", f"{on * 1e6:.1f} µs", f"{off * 1e6:.1f} µs bus off", f"{off / on:.2f}{spread}", ">= 0.95"))
    return rows
