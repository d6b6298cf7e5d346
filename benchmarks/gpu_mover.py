"""The GPU mover alone, without the server: where a transfer's time goes.

``kvdepot bench gpu`` times the whole paths (RPC, leases, the server's copies). This takes them away and
times ``BlockMover.save`` / ``load`` between a vLLM-like paged cache on the GPU and host memory registered
with ``cudaHostRegister`` (as the L1 arena is), next to the same run's pinned copies of the same bytes:

- ``enqueue``: how long the call itself holds the host (it should only queue work);
- ``done``: until its completion event fires;
- loads plain and with per-layer events (the layer-by-layer last piece);
- a cache in one allocation (two kernels a piece) and one whose layers were allocated apart, as vLLM
  allocates them (a kernel per layer a piece, or one graph replay a piece: ``kvdepot.gpu.graphs``;
  both are timed).

    python benchmarks/gpu_mover.py [--sizes-mib 2,32] [--chunks 16]
"""

from __future__ import annotations

import argparse
import mmap
import time

import torch

from kvdepot.bench.stats import gbps, timed
from kvdepot.gpu import runtime
from kvdepot.gpu.mover import BlockMover
from kvdepot.gpu.paged import DevicePagedCache

LAYERS, HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3-8B-like, bf16: 128 KiB a token


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="2,32")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    if not runtime.cuda_available():
        raise SystemExit("this measures the CUDA mover: it needs an NVIDIA GPU and torch with CUDA")
    print(f"GPU mover on {torch.cuda.get_device_name(0)}, {args.chunks} chunks, median of {args.reps}")
    print("| chunk | cache | what | median GB/s | ratio to pinned copy | host held (enqueue), ms |")
    print("|---|---|---|---|---|---|")
    for size in (int(s) for s in args.sizes_mib.split(",")):
        for apart, graphs in ((False, False), (True, True), (True, False)):
            _one(size, args.chunks, args.reps, apart, graphs)


def _one(size_mib: int, n: int, reps: int, apart: bool, graphs: bool) -> None:
    tokens = (size_mib << 20) // (2 * LAYERS * HEADS * HEAD_DIM * 2)
    bpc = tokens // BLOCK
    nblocks = n * bpc + 32
    shape = (2, nblocks, BLOCK, HEADS, HEAD_DIM)
    if apart:
        layers = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    else:
        layers = list(torch.empty((LAYERS, *shape), dtype=torch.bfloat16, device="cuda"))
    for t in layers:
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
    cache = DevicePagedCache(layers, "kv_first", BLOCK)
    mover = BlockMover(cache, bpc, n * (size_mib << 20), graphs=graphs)
    chunk_bytes = mover.chunk_bytes
    memory = mmap.mmap(-1, n * chunk_bytes)
    host = torch.frombuffer(memory, dtype=torch.uint8)
    pinned = runtime.pin(host.data_ptr(), host.numel())
    slots = [host[i * chunk_bytes : (i + 1) * chunk_bytes].view(torch.int16).view(mover.chunk_shape) for i in range(n)]
    flat = torch.empty(n * chunk_bytes, dtype=torch.uint8, device="cuda")
    ids = cache.check_ids([torch.randperm(nblocks)[: n * bpc].numpy()], n * bpc)
    nbytes = n * chunk_bytes
    events = [torch.cuda.Event() for _ in range(LAYERS)]

    def limit(direction: str):
        def once() -> None:
            for i in range(n):
                a, b = host[i * chunk_bytes : (i + 1) * chunk_bytes], flat[i * chunk_bytes : (i + 1) * chunk_bytes]
                (a.copy_(b, non_blocking=True) if direction == "d2h" else b.copy_(a, non_blocking=True))
            torch.cuda.synchronize()

        return gbps(nbytes, timed(once, reps, 2))

    held: list[float] = []

    def moved(call):
        def once() -> None:
            t0 = time.perf_counter()
            done = call()
            held.append(time.perf_counter() - t0)
            done.wait()

        return once

    d2h, h2d = limit("d2h"), limit("h2d")
    rows = [
        ("pinned copy D2H", d2h, d2h),
        ("pinned copy H2D", h2d, h2d),
    ]
    for what, call, ref in (
        ("save (gather + D2H)", lambda: mover.save(ids, slots), d2h),
        ("load (H2D + scatter)", lambda: mover.load(slots, ids), h2d),
        ("load, per-layer events", lambda: mover.load(slots, ids, 0, events), h2d),
    ):
        held.clear()
        got = gbps(nbytes, timed(moved(call), reps, 2))
        rows.append((what, got, ref, sorted(held[2:])[len(held[2:]) // 2] * 1e3))
    for row in rows:
        what, got, ref = row[:3]
        enq = f"{row[3]:.2f}" if len(row) > 3 else "—"
        print(f"| {size_mib} MiB | {('layers apart' + ('' if graphs else ', graphs off')) if apart else 'one allocation'} | {what} | {got.median:.1f} | {got.median / ref.median:.2f} | {enq} |")
    pinned.close()
    del slots, host
    memory.close()


if __name__ == "__main__":
    main()
