"""``kvdepot bench gpu``: the GPU paths' store and retrieve GB/s next to the same run's pinned copies.

For 16 chunks of 2 MiB and of 32 MiB (a Llama-3-8B-like KV in bf16: 32 layers, 8 KV heads of 128), each
figure is printed next to its physical limit measured in the same run on the same GPU, and the ratio:

- limits: pinned ``cudaMemcpy`` device-to-host and host-to-device of the same chunks, and a device-to-device
  copy of them;
- the paged gather and scatter alone (``DevicePagedCache``: blocks of a vLLM-like cache, shuffled, to
  and from a staging buffer), against the device-to-device copy;
- the worker-driven pinned path (``DeviceKV`` without the server's help: GPU gather, one DMA into the
  pinned arena slot, commit; and back), against pinned D2H / H2D;
- the server-driven path (``cuda_ipc``: the server process gathers and copies the registered cache's
  blocks itself), against pinned D2H / H2D.

The caches have each layer in an allocation of its own, as vLLM allocates them (``--one-allocation``: all
layers in one). Under the table, where each path's time went: the worker-driven path's prepare, enqueue,
copies and commit (or release); the server-driven path's reply and, for a retrieve, the copies after it.

Target (issue 25): both paths >= 0.8 x pinned D2H / H2D at 32 MiB chunks. ``--device cpu`` runs the same
code on the CPU (host cache files for the server-driven path; limits are host memcpy), to check the
benchmark itself where there is no GPU: its figures say nothing of a GPU. vLLM's hit TTFT through
kvdepot against vLLM's native CPU offload needs vLLM on the GPU machine: this command says so and does
not invent it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict

from kvdepot.bench.serverproc import bench_server, wait_prefault
from kvdepot.bench.stats import Sample, gbps, loadavg, timed
from kvdepot.bench.transfer import Row
from kvdepot.layout import KVLayout, PagedFormat
from kvdepot.types import SlotStatus

MiB = 1 << 20
LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 128 KiB a token
BLOCK = 16
SPARE_BLOCKS = 32


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run of the benchmark itself (default: %(default)s)")
    p.add_argument("--sizes-mib", default="2,32", help="chunk sizes in MiB (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=16, help="chunks per store/retrieve (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default: %(default)s)")
    p.add_argument("--l1-size-gb", type=float, default=4.0, help="server L1 size (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not for quoting)")
    p.add_argument("--one-allocation", action="store_true",
                   help="the source cache's layers in one allocation (default: one allocation per layer, as vLLM allocates them)")  # fmt: skip


def _ratio(a: Sample, b: Sample) -> str:
    return f"{a.median / b.median:.2f}" if b.median else "—"


def main(args: argparse.Namespace) -> int:
    from kvdepot.gpu import runtime
    from kvdepot.gpu.graphs import graphs_enabled

    torch = runtime.torch_or_none()
    if torch is None:
        print(f"kvdepot bench gpu needs torch in this environment ({runtime.INSTALL_HINT})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not runtime.cuda_available():
        print("kvdepot bench gpu measures the CUDA paths and needs an NVIDIA GPU with torch's CUDA build; "
              "--device cpu runs the benchmark's own code on the CPU (no GPU figures)", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    reps, warmup = (3, 1) if args.quick else (args.reps, args.warmup)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    raw: dict = {"load_start": loadavg(), "device": _device_name(torch, args.device), "reps": reps, "chunks": args.chunks,
                 "cuda_graphs": graphs_enabled()}  # fmt: skip
    rows: list[Row] = []
    server = bench_server(args.l1_size_gb)
    server.args += ["--gpu-transfer", "on" if args.device == "cuda" else "auto", "--gpu-staging-mb", str(max(sizes) * args.chunks)]
    with server:
        prefault_s = wait_prefault(server)
        print(f"# {raw['device']}; server arena ({args.l1_size_gb} GiB) pre-faulted in {prefault_s:.1f}s; load {raw['load_start']}", file=sys.stderr)
        for size in sizes:
            rows += _bench_size(torch, server, args.device, size, args.chunks, reps, warmup, raw, args.one_allocation)
    raw["load_end"] = loadavg()
    graphs = "none on a CPU" if args.device != "cuda" else "on" if raw["cuda_graphs"] else "off (KVDEPOT_CUDA_GRAPHS)"
    print(f"kvdepot bench gpu on {raw['device']}; caches of layers apart replayed as CUDA graphs: {graphs}")
    print("| metric | median (min-max) | physical limit, same run | ratio | target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.metric} | {r.value} | {r.limit} | {r.ratio} | {r.target} |")
    print("\nwhere the time went (median ms per phase):")
    for key, value in raw.items():
        if isinstance(value, dict) and "phases_ms" in value:
            for op, phases in value["phases_ms"].items():
                print(f"  {key} {op}: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    print(f"\nload average: start {raw['load_start']}, end {raw['load_end']}; {reps} timed reps each")
    print("vLLM hit TTFT through kvdepot vs vLLM's native CPU offload: not measured here (it needs vLLM on this GPU machine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "raw": raw}, f, indent=2, default=str)
    return 0


def _device_name(torch, device: str) -> str:
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        return f"{p.name} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return "CPU (a dry run: no GPU figures)"


def _bench_size(torch, server, device: str, size_mib: int, n: int, reps: int, warmup: int, raw: dict, one_allocation: bool) -> list[Row]:
    from kvdepot import ClientOptions, KVClient
    from kvdepot.client.options import Transport
    from kvdepot.connectors.vllm.device import DeviceKV
    from kvdepot.gpu.memory import EventRing, HostCacheFile
    from kvdepot.gpu.paged import DevicePagedCache

    chunk_tokens = size_mib * MiB // LAYOUT.bytes_per_token
    bpc = chunk_tokens // BLOCK
    chunk_bytes = LAYOUT.chunk_bytes(chunk_tokens)
    nbytes = n * chunk_bytes
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run(fn):
        def once() -> None:
            fn()
            sync()

        return once

    # --- the limits: pinned D2H / H2D of the same chunks, and a device-to-device copy ---------------------
    dev_chunks = torch.randint(0, 255, (n, chunk_bytes), dtype=torch.uint8, device=device)
    host = torch.empty((n, chunk_bytes), dtype=torch.uint8, pin_memory=cuda)
    dev_other = torch.empty_like(dev_chunks)
    d2h = gbps(nbytes, timed(run(lambda: [host[i].copy_(dev_chunks[i], non_blocking=True) for i in range(n)]), reps, warmup))
    h2d = gbps(nbytes, timed(run(lambda: [dev_other[i].copy_(host[i], non_blocking=True) for i in range(n)]), reps, warmup))
    d2d = gbps(nbytes, timed(run(lambda: dev_other.copy_(dev_chunks)), reps, warmup))
    where = "pinned cudaMemcpy" if cuda else "host memcpy (CPU dry run)"
    rows = [
        Row(f"{where} D2H, {n} x {size_mib} MiB", d2h.fmt("GB/s"), "—", "1.00"),
        Row(f"{where} H2D, {n} x {size_mib} MiB", h2d.fmt("GB/s"), "—", "1.00"),
        Row(f"device-to-device copy, {n} x {size_mib} MiB", d2d.fmt("GB/s"), "—", "1.00"),
    ]
    raw[f"limits_{size_mib}MiB"] = {"d2h": asdict(d2h), "h2d": asdict(h2d), "d2d": asdict(d2d)}
    del dev_other

    # --- a vLLM-like cache holding the chunks in shuffled blocks ------------------------------------------
    nblocks = n * bpc + SPARE_BLOCKS
    shape = (2, nblocks, BLOCK, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    file = HostCacheFile.create("/dev/shm", LAYOUT.num_layers, shape, torch.bfloat16) if not cuda else None
    if file:
        layers = file.layers
    elif one_allocation:
        layers = list(torch.empty((LAYOUT.num_layers, *shape), dtype=torch.bfloat16, device=device))
    else:  # as vLLM allocates them: each layer's cache on its own
        layers = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYOUT.num_layers)]
    for t in layers:
        t.view(torch.int16).random_(-(1 << 15), 1 << 15)
    dst_layers = [torch.zeros_like(t) for t in layers] if cuda else None
    dst_file = HostCacheFile.create("/dev/shm", LAYOUT.num_layers, shape, torch.bfloat16) if not cuda else None
    dst_layers = dst_layers or dst_file.layers
    order = torch.randperm(nblocks, generator=torch.Generator().manual_seed(size_mib))[: n * bpc].tolist()
    try:
        cache = DevicePagedCache(layers, PagedFormat.KV_FIRST, BLOCK)
        target = DevicePagedCache(dst_layers, PagedFormat.KV_FIRST, BLOCK)
        ids = cache.check_ids([order], n * bpc)
        staging = torch.empty(cache.chunk_shape(n, bpc), dtype=torch.bfloat16, device=device)
        gather = gbps(nbytes, timed(run(lambda: cache.gather(ids, staging)), reps, warmup))
        scatter = gbps(nbytes, timed(run(lambda: target.scatter(staging, ids)), reps, warmup))
        rows += [
            Row(f"paged gather, {n} x {size_mib} MiB (blocks -> staging)", gather.fmt("GB/s"), d2d.fmt("GB/s"), _ratio(gather, d2d)),
            Row(f"paged scatter, {n} x {size_mib} MiB (staging -> blocks)", scatter.fmt("GB/s"), d2d.fmt("GB/s"), _ratio(scatter, d2d)),
        ]
        del staging
        tokens = [t + size_mib * 1_000_000 for t in range(n * chunk_tokens)]
        layers_ids = [order]

        # --- the worker-driven pinned path -------------------------------------------------------------------
        opts = ClientOptions(chunk_size=chunk_tokens, transport="shm", timeout_s=120)
        with KVClient(server.url, f"bench-gpu-{size_mib}", LAYOUT, options=opts) as c:
            c.wait_prefault(300)
            write = DeviceKV(layers, PagedFormat.KV_FIRST, BLOCK, bpc, Transport.SHM, n * chunk_bytes)
            read = DeviceKV(dst_layers, PagedFormat.KV_FIRST, BLOCK, bpc, Transport.SHM, n * chunk_bytes)
            write.server_path(c)
            read.server_path(c)
            hashes = c.hashes(tokens)
            slot_ids = write.ids(order)

            phases = Phases()

            def store_shm() -> None:
                phases.start("store")
                with c.prepare_store(hashes) as slots:
                    assert all(s is not None for s in slots)
                    phases.mark("prepare")
                    done = write.mover.save(slot_ids, list(slots), ready=write.ready()[0])
                    phases.mark("enqueue")
                    done.wait()
                    phases.mark("copies")
                phases.mark("commit")

            def retrieve_shm() -> None:
                phases.start("retrieve")
                with c.prepare_retrieve(hashes) as views:
                    assert len(views) == n
                    phases.mark("prepare")
                    done = read.mover.load(views, slot_ids, 0, ready=read.ready()[0])
                    phases.mark("enqueue")
                    done.wait()
                    phases.mark("copies")
                phases.mark("release")

            st = gbps(nbytes, timed(run(store_shm), reps, warmup, setup=c.clear))
            rt = gbps(nbytes, timed(run(retrieve_shm), reps, warmup))
            _check(torch, layers, dst_layers, order)
            label = write.path
            rows += [
                Row(f"store, worker-driven {label}, {n} x {size_mib} MiB", st.fmt("GB/s"), d2h.fmt("GB/s"), _ratio(st, d2h), "≥ 0.8 at 32 MiB"),
                Row(f"retrieve, worker-driven {label}, {n} x {size_mib} MiB", rt.fmt("GB/s"), h2d.fmt("GB/s"), _ratio(rt, h2d), "≥ 0.8 at 32 MiB"),
            ]
            raw[f"worker_{size_mib}MiB"] = {"store": asdict(st), "retrieve": asdict(rt), "path": label, "phases_ms": phases.medians(warmup)}
            write.unpin()
            read.unpin()
            for t in dst_layers:
                t.zero_()

        # --- the server-driven path ------------------------------------------------------------------------
        with KVClient(server.url, f"bench-gpu-ipc-{size_mib}", LAYOUT, options=ClientOptions(chunk_size=chunk_tokens, timeout_s=120)) as c:
            src_rc = c.register_kv_cache(layers, "kv_first", BLOCK)
            dst_rc = c.register_kv_cache(dst_layers, "kv_first", BLOCK)
            hashes = c.hashes(tokens)
            ring = EventRing() if cuda else None

            phases = Phases()

            def store_ipc() -> None:
                phases.start("store")
                handle = ring.record()[1] if ring else b""
                statuses = src_rc.store(hashes, layers_ids, ready_event=handle)
                # Every chunk copied (the setup cleared L1): one refused or found stored moved nothing.
                assert statuses == [SlotStatus.ALLOCATED] * n, statuses
                phases.mark("reply (copies done)")

            def retrieve_ipc() -> None:
                phases.start("retrieve")
                handle = ring.record()[1] if ring else b""
                assert dst_rc.retrieve(hashes, layers_ids, ready_event=handle) == n
                phases.mark("reply (copies queued)")
                dst_rc.wait_all()
                sync()
                phases.mark("copies")

            st = gbps(nbytes, timed(run(store_ipc), reps, warmup, setup=c.clear))
            rt = gbps(nbytes, timed(run(retrieve_ipc), reps, warmup))
            _check(torch, layers, dst_layers, order)
            rows += [
                Row(f"store, server-driven {src_rc.kind}, {n} x {size_mib} MiB", st.fmt("GB/s"), d2h.fmt("GB/s"), _ratio(st, d2h), "≥ 0.8 at 32 MiB"),
                Row(f"retrieve, server-driven {src_rc.kind}, {n} x {size_mib} MiB", rt.fmt("GB/s"), h2d.fmt("GB/s"), _ratio(rt, h2d), "≥ 0.8 at 32 MiB"),
            ]
            raw[f"server_{size_mib}MiB"] = {"store": asdict(st), "retrieve": asdict(rt), "path": src_rc.kind, "phases_ms": phases.medians(warmup)}
    finally:
        for f in (file, dst_file):
            if f is not None:
                f.close()
    return rows


class Phases:
    """Where one path's time goes: per rep, the milliseconds between marks (medians over the timed reps)."""

    def __init__(self) -> None:
        self.reps: dict[str, list[dict[str, float]]] = {}
        self._t = 0.0
        self._rep: dict[str, float] = {}

    def start(self, op: str) -> None:
        self._rep = {}
        self.reps.setdefault(op, []).append(self._rep)
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._rep[phase] = (now - self._t) * 1e3
        self._t = now

    def medians(self, warmup: int) -> dict[str, dict[str, float]]:
        out = {}
        for op, reps in self.reps.items():
            timed_reps = reps[warmup:]
            out[op] = {k: round(statistics.median(r[k] for r in timed_reps), 3) for k in timed_reps[0]} if timed_reps else {}
        return out


def _check(torch, src, dst, order) -> None:
    """Every byte of every moved block came back (a benchmark that moved garbage fast proves nothing)."""
    for a, b in zip(src, dst):
        if not torch.equal(a[:, order].view(torch.int16), b[:, order].view(torch.int16)):
            raise AssertionError("retrieved blocks differ from the stored ones")
