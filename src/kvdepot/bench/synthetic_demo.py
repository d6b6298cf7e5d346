"""``kvdepot demo --synthetic``: a server on embedded defaults and a small engine-like workload against it
(no engine needed: the default ``kvdepot demo`` runs a real vLLM, see ``engine_demo``).

The workload imitates an engine serving questions over a few long documents: each request looks up
its prompt, fetches the stored prefix, "computes" the rest (a deterministic function of the tokens,
so every fetched byte can be checked), and stores it. It runs once per transport and prints hits,
bytes moved and speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request

import numpy as np

from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.client.options import Transport
from kvdepot.layout import KVLayout

LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, dtype="float16")  # 8 KiB per token
DOC_TOKENS = 4096
QUESTION_TOKENS = 200


def fake_kv(tokens: np.ndarray) -> np.ndarray:
    """The 'prefill' of the demo: KV that depends on every token so far (like real attention KV)."""
    prefix_sums = np.cumsum(tokens.astype(np.int64)) % 4093
    base = (prefix_sums % 2048).astype(np.float16)
    kv = np.empty(LAYOUT.chunk_shape(len(tokens)), dtype=np.float16)
    kv[...] = base[None, None, :, None, None]
    kv[1] += 1  # values differ from keys
    return kv


def workload(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 32000, DOC_TOKENS, dtype=np.uint32) for _ in range(4)]
    prompts = []
    for i in range(24):
        doc = docs[rng.integers(0, len(docs))]
        question = rng.integers(0, 32000, QUESTION_TOKENS, dtype=np.uint32)
        prompts.append(np.concatenate([doc, question]))
    return prompts


def run_transport(url: str, transport: str) -> dict:
    from kvdepot.client.client import ClientOptions, KVClient

    stats = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0, "bytes_in": 0, "bytes_out": 0, "transfer_s": 0.0, "verified": True}
    with KVClient(url, "demo-model", LAYOUT, options=ClientOptions(transport=transport)) as c:
        c.wait_prefault(30)
        salt = f"demo-{transport}"
        out = LAYOUT.empty(DOC_TOKENS + QUESTION_TOKENS)  # reused, as an engine reuses its KV memory
        out.fill(0)
        for tokens in workload():
            stats["requests"] += 1
            stats["prompt_tokens"] += len(tokens)
            hit = c.lookup(tokens, cache_salt=salt)
            t0 = time.perf_counter()
            got = c.retrieve(tokens[:hit], cache_salt=salt, out=out) if hit else LAYOUT.empty(0)
            stats["transfer_s"] += time.perf_counter() - t0
            full = fake_kv(tokens)
            if not np.array_equal(got, full[:, :, :hit]):
                stats["verified"] = False
            stats["hit_tokens"] += hit
            stats["bytes_out"] += got.nbytes
            t0 = time.perf_counter()
            stored = c.store(tokens, full, cache_salt=salt)
            stats["transfer_s"] += time.perf_counter() - t0
            stats["bytes_in"] += (stored - hit) * LAYOUT.bytes_per_token
        stats["transport"] = c.transport
    return stats


def run(args: argparse.Namespace) -> int:
    """Returns the exit code: 0 when every fetched byte was exact, 1 when not, and the server's own
    code (2 for a bad configuration) with its one-line reason when it could not start. The server's log
    goes to ``--workdir`` (kept, and named), else to a temporary directory that is kept, and named, only
    when the workload failed (the log is what explains that), and removed otherwise."""
    work = args.workdir or tempfile.mkdtemp(prefix="kvdepot-demo-")
    os.makedirs(work, exist_ok=True)
    keep = bool(args.workdir)
    try:
        http_port = free_port()
        server = ServerProcess(
            args=["--l1-size-gb", str(args.l1_size_gb)],
            port=args.port,
            http_port=http_port,
            log_path=os.path.join(work, "server.log"),
        )
        print(f"kvdepot demo --synthetic: starting a server (L1 {args.l1_size_gb} GiB)")
        failed = server.start_or_explain()
        if failed is not None:
            print(f"kvdepot demo: the server did not start: {failed[1]}", file=sys.stderr)
            return failed[0]
        keep = True  # until the workload passes
        try:
            code = _run_workload(server, http_port)
        finally:
            server.stop()
        keep = bool(args.workdir) or code != 0
        return code
    finally:
        if keep:
            print(f"work directory (the server's log): {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _run_workload(server: ServerProcess, http_port: int) -> int:
    ok = True
    print(f"server up on {server.url}, HTTP on :{http_port}\n")
    print(f"workload: 24 requests = one of 4 documents ({DOC_TOKENS} tokens) + a fresh {QUESTION_TOKENS}-token question")
    print(f"KV layout {LAYOUT.fingerprint()} ({LAYOUT.bytes_per_token // 1024} KiB/token), chunks of 256 tokens\n")
    print(f"{'transport':<10} {'hit rate':>9} {'hit tokens':>11} {'stored MiB':>11} {'fetched MiB':>12} {'GB/s':>6}  bit-exact")
    for transport in (Transport.SHM, Transport.INLINE):
        s = run_transport(server.url, transport)
        moved = s["bytes_in"] + s["bytes_out"]
        print(
            f"{s['transport']:<10} {s['hit_tokens'] / s['prompt_tokens']:>8.1%} {s['hit_tokens']:>11} "
            f"{s['bytes_in'] / 2**20:>11.1f} {s['bytes_out'] / 2**20:>12.1f} {moved / max(s['transfer_s'], 1e-9) / 1e9:>6.2f}  "
            f"{'yes' if s['verified'] else 'NO'}"
        )
        ok &= s["verified"] and s["hit_tokens"] > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as r:
        st = json.load(r)
    l1 = st["l1"]
    print(
        f"\nserver /status: {l1['objects']} objects, {l1['used_bytes'] / 2**20:.1f} of "
        f"{l1['capacity_bytes'] / 2**20:.0f} MiB used, leases {st['leases']}, requests {sum(st['requests'].values())}"
    )
    print("\ndemo", "passed" if ok else "FAILED")
    return 0 if ok else 1
