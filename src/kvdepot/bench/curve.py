"""``kvdepot bench transfer --curve``: what CurveZMQ encryption costs the inline path.

Two real servers on loopback TCP, alike but for ``--curve-server-key``/``--curve-clients``, each with
an inline client; store() and retrieve(out=) of the same KV alternate between them within every
repetition (which goes first alternates too), so a machine's drift or a neighbour's burst hits both
alike. Reported: each side's median GB/s and encrypted / plain, and PING p50 both ways.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

import numpy as np

from kvdepot.bench.serverproc import ServerProcess
from kvdepot.bench.stats import gbps, percentile, timed
from kvdepot.bench.transfer import Row
from kvdepot.layout import KVLayout

MiB = 1 << 20
SIDES = ("plain", "curve")


def bench_curve(layout: KVLayout, chunk_size: int, size_mib: int, n: int, reps: int, warmup: int, l1_size_gb: float, raw: dict) -> list[Row]:
    """Rows comparing the inline path over TCP with and without CurveZMQ."""
    from kvdepot.client.client import ClientOptions, KVClient
    from kvdepot.rpc.security import CurveClientKeys, write_key_files

    tmp = tempfile.mkdtemp(prefix="kvdepot-bench-curve-")
    keys = write_key_files(os.path.join(tmp, "keys"))
    curve = CurveClientKeys.from_files(keys["server_public"], keys["client_secret"])
    common = ["--l1-size-gb", str(l1_size_gb), "--log-level", "warning", "--no-prefault"]
    servers = {
        "plain": ServerProcess(args=common, http_port=0, env={"OMP_NUM_THREADS": "1"}, log_path=os.path.join(tmp, "plain.log")),
        "curve": ServerProcess(
            args=[*common, "--curve-server-key", str(keys["server_secret"]), "--curve-clients", str(keys["clients"])],
            http_port=0,
            env={"OMP_NUM_THREADS": "1"},
            log_path=os.path.join(tmp, "curve.log"),
            curve=curve,
        ),
    }
    tokens = np.arange(n * chunk_size, dtype=np.uint32) + 40_000_000 + size_mib
    kv = np.random.default_rng(2).integers(0, 1 << 15, size=layout.chunk_shape(n * chunk_size), dtype=np.uint16).view(np.float16)
    outs = {side: np.zeros_like(kv) for side in SIDES}
    nbytes = size_mib * MiB * n
    store_s: dict[str, list[float]] = {side: [] for side in SIDES}
    retrieve_s: dict[str, list[float]] = {side: [] for side in SIDES}
    ping_s: dict[str, list[float]] = {side: [] for side in SIDES}
    with servers["plain"], servers["curve"]:
        opts = ClientOptions(chunk_size=chunk_size, transport="inline", timeout_s=120, heartbeat=False)
        clients = {
            "plain": KVClient(servers["plain"].url, "bench-curve", layout, options=opts),
            "curve": KVClient(servers["curve"].url, "bench-curve", layout, options=opts, curve=curve),
        }
        try:
            for rep in range(warmup + reps):
                order = SIDES if rep % 2 == 0 else SIDES[::-1]
                for side in order:
                    c = clients[side]
                    c.clear()
                    [st] = timed(lambda c=c: c.store(tokens, kv), 1, warmup=0)
                    [rt] = timed(lambda c=c, side=side: c.retrieve(tokens, out=outs[side]), 1, warmup=0)
                    pings = timed(c.ping, 200, warmup=20)
                    if rep >= warmup:
                        store_s[side].append(st)
                        retrieve_s[side].append(rt)
                        ping_s[side].extend(pings)
            for side in SIDES:
                assert np.array_equal(outs[side].view(np.uint16), kv.view(np.uint16)), f"{side}: retrieved bytes differ"
        finally:
            for c in clients.values():
                c.close()
    results = {side: {"store": gbps(nbytes, store_s[side]), "retrieve": gbps(nbytes, retrieve_s[side])} for side in SIDES}
    raw[f"curve_inline_tcp_{size_mib}MiB"] = {
        side: {**{k: asdict(v) for k, v in results[side].items()}, "ping_p50_us": percentile(ping_s[side], 50) * 1e6} for side in SIDES
    }
    label = f"inline (tcp) {n} x {size_mib} MiB"
    rows = []
    for op in ("store", "retrieve"):
        plain, enc = results["plain"][op], results["curve"][op]
        rows.append(Row(f"{label} {op}, plain", plain.fmt("GB/s"), "—", "1.00"))
        rows.append(Row(f"{label} {op}, CurveZMQ", enc.fmt("GB/s"), f"{plain.median:.2f} GB/s plain", f"{enc.median / plain.median:.2f}"))
    p_plain, p_curve = percentile(ping_s["plain"], 50), percentile(ping_s["curve"], 50)
    rows.append(Row("PING tcp p50, CurveZMQ vs plain", f"{p_curve * 1e6:.0f} µs", f"{p_plain * 1e6:.0f} µs plain", f"{p_plain / p_curve:.2f}"))
    return rows
