"""``kvdepot bench peer``: the peer tier's data plane and directory against raw loopback sockets.

An owner node runs in a child process (its own interpreter, as on another machine) with a raw TCP
sender beside it; this process joins it as a reader. For each page size, in the same run:
- raw loopback socket: the child sends pages from memory, this process ``recv_into``s them (1 and 4
  connections): the limit of any TCP data plane here;
- remote get: ``PeerStore.batch_get_into`` of the same pages from the owner's pool (1 and 4 threads),
  read first (the directory asked) and read again (where the reader remembers finding them);
- set: ``batch_set`` into this node's pool (a copy plus the directory publish), next to memcpy;
- ``batch_exists`` of 128 keys next to one raw ZeroMQ round trip: in the pair (the reader holds every
  record's replica) and with a third node, for keys whose records live only on the other two (all first
  asked of one of them: one round trip; or spread over both, asked at once).
In the pair the reader's own shard holds every record, so a first read asks no other node.
Medians over ``--reps``; ratios are figure / limit. The owner and the reader share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import numpy as np

from kvdepot.bench.stats import loadavg, memcpy_seconds
from kvdepot.bench.transfer import Row
from kvdepot.peer.dataplane import RECV_PIECE_BYTES

MiB = 1 << 20
_RAW_REQUEST = struct.Struct("<QQ")  # offset into the payload, bytes
PAYLOAD_BYTES = 64 * MiB  # the owner's source bytes: twice the L3 of a server CPU, as a pool's pages are


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-kib", default="256,2048,32768", help="page sizes in KiB (default: %(default)s)")
    p.add_argument("--bytes-mib", type=int, default=128, help="bytes read per timed repetition (default: %(default)s)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions (default: %(default)s)")
    p.add_argument("--threads", default="1,4", help="reader threads (default: %(default)s)")
    p.add_argument("--secret", default="bench-secret", help="cluster secret of the two nodes (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this path")
    p.add_argument("--quick", action="store_true", help="fewer repetitions and bytes (a smoke run, not for quoting)")
    p.add_argument("--ttft", action="store_true",
                   help="also the cross-node TTFT: two kvdepot servers with peer tiers, a vLLM engine on each (needs vLLM; minutes)")  # fmt: skip
    p.add_argument("--ttft-tokens", type=int, default=4096, help="prompt length of the TTFT rows (default: %(default)s)")


# --- the owner (child process) ------------------------------------------------------------------------


def _owner(options: dict) -> int:
    from kvdepot.peer import PeerStore

    store = PeerStore(**options)
    payload = np.random.default_rng(1).bytes(PAYLOAD_BYTES)
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_sender, args=(raw, memoryview(payload)), daemon=True).start()
    print(json.dumps({"node": store.node_id, "raw_port": raw.getsockname()[1]}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] == "quit":
            break
        if parts[0] == "set":  # set PREFIX COUNT SIZE
            prefix, count, size = parts[1], int(parts[2]), int(parts[3])
            names = [f"{prefix}{i}" for i in range(count)]
            pages = [memoryview(payload)[_page_offset(i, size) :][:size] for i in range(count)]
            ok = store.batch_set(names, pages)
            print(json.dumps({"stored": sum(ok)}), flush=True)
        elif parts[0] == "clear":
            store.clear()
            print(json.dumps({"cleared": True}), flush=True)
    store.close()
    return 0


def _page_offset(i: int, size: int) -> int:
    """Where page ``i`` of ``size`` bytes starts in the owner's payload (its pool copy was made from there)."""
    return (i * size) % (PAYLOAD_BYTES - size + 1)


def _raw_sender(listener: socket.socket, payload: memoryview) -> None:
    """Per connection: read (offset, length), send that many bytes from that offset of the payload,
    straight from memory (no protocol). The pages' own offsets, so the raw sender reads as many
    distinct bytes as the data plane does from its pool: a sender that sent the same few MiB again
    and again would read them from the CPU's cache, a limit no pool of real pages has."""

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(_RAW_REQUEST.size, socket.MSG_WAITALL)
                if len(head) < _RAW_REQUEST.size:
                    return
                offset, n = _RAW_REQUEST.unpack(head)
                while n:
                    offset %= len(payload)
                    k = min(n, len(payload) - offset)
                    conn.sendall(payload[offset : offset + k])
                    offset, n = offset + k, n - k

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class _Owner:
    def __init__(self, options: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvdepot.bench.peer", json.dumps(options)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        hello = self._answer()
        self.node_id, self.raw_port = hello["node"], hello["raw_port"]

    def command(self, line: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the owner process exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.command("quit")
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- the reader (this process) ------------------------------------------------------------------------


def _raw_connections(port: int, n: int) -> list[socket.socket]:
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conns


def _raw_read(conns: list[socket.socket], dests: list[memoryview], per_batch: int) -> float:
    """Seconds to receive every destination's bytes over ``conns`` (one thread each, kept open across
    repetitions like the data plane's pooled connections), asking for ``per_batch`` pages at a time
    (as the data plane does), each page from its own offset of the owner's payload, and receiving each
    straight into its buffer in the data plane's pieces (``RECV_PIECE_BYTES``): a whole page per
    ``recv_into(MSG_WAITALL)`` ran 2-11 % slower here, a limit the data plane beat."""
    size = dests[0].nbytes

    def run(conn: socket.socket, mine: list[tuple[int, memoryview]]) -> None:
        for i in range(0, len(mine), per_batch):
            batch = mine[i : i + per_batch]
            conn.sendall(_RAW_REQUEST.pack(_page_offset(batch[0][0], size), sum(d.nbytes for _, d in batch)))
            for _, d in batch:
                got = 0
                while got < d.nbytes:  # as the data plane receives: RECV_PIECE_BYTES per call
                    want = min(RECV_PIECE_BYTES, d.nbytes - got)
                    got += conn.recv_into(d[got : got + want], want, socket.MSG_WAITALL)

    t0 = time.perf_counter()
    _in_threads(run, conns, list(enumerate(dests)))
    return time.perf_counter() - t0


def _raw_rtt(port: int, n: int = 200) -> float:
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(1)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.sendall(_RAW_REQUEST.pack(0, 1))
            c.recv_into(buf)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _raw_zmq_rtt(n: int = 300) -> float:
    from kvdepot.bench.rawzmq import round_trips_like

    return statistics.median(round_trips_like("tcp://", n))


def _exists_rounds(reader, names: list[str], rounds: int, per_round: int = 60) -> tuple[float, float, list[float]]:
    """batch_exists and a raw ZeroMQ round trip taken in alternating rounds (the host's drift moves
    both alike): (median batch_exists s, median raw RTT s, each round's ratio of medians)."""
    from kvdepot.bench.rawzmq import RawEcho
    from kvdepot.bench.serverproc import free_port

    exists: list[float] = []
    rtts: list[float] = []
    ratios: list[float] = []
    with RawEcho(f"tcp://127.0.0.1:{free_port()}") as echo:
        echo.round_trips(200)
        for _ in range(rounds * 2):
            mine = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                reader.batch_exists(names)
                mine.append(time.perf_counter() - t0)
            theirs = echo.round_trips(per_round)
            exists += mine
            rtts += theirs
            ratios.append(statistics.median(mine) / statistics.median(theirs))
    return statistics.median(exists), statistics.median(rtts), ratios


def _exists_rows(reader, owner: _Owner, node_options: dict, reps: int, rtt: float, raw: dict) -> list[Row]:
    """``batch_exists`` of 128 keys: in the pair, where the reader holds a replica of every record (two
    nodes, two replicas: its own shard answers), then with a third node joined, for keys whose records
    live only on the other two (one round trip to them, the directory's real cost in a larger cluster)."""

    def measured(label: str, field: str, keys: list[str]) -> Row:
        ex, zr, ratios = _exists_rounds(reader, keys, max(reps, 5))
        assert reader.batch_exists(keys) == len(keys), "the owner's pages went missing while they were timed"
        raw[f"{field}_s"], raw[f"{field}_round_ratios"] = ex, ratios
        ratio = statistics.median(ratios)
        return Row(label, f"{ex * 1e6:.0f} µs", f"{zr * 1e6:.0f} µs raw ZeroMQ RTT (interleaved)",
                   f"{ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f}; x TCP RTT {ex / rtt:.1f})")  # fmt: skip

    owner.command("clear")
    owner.command(f"set x 128 {4096}")
    names = [f"x{i}" for i in range(128)]
    assert reader.batch_exists(names) == 128, "the owner's pages must be visible"
    rows = [measured("batch_exists, 128 keys (2 nodes: every record held here too)", "batch_exists_128_local", names)]
    third = _Owner({**node_options, "discovery": owner.node_id})
    try:
        _wait_members(reader, 3)
        owner.command("clear")
        owner.command(f"set y 2048 {4096}")
        ring, replicas = reader.node._ring, reader.node.config.directory_replicas
        far = [f"y{i}" for i in range(2048) if reader.node_id not in ring.owners(f"y{i}".encode(), replicas)]
        one = [n for n in far if ring.owners(n.encode(), replicas)[0] == owner.node_id][:128]  # first asked: the owner
        far = far[:128]
        assert len(far) == len(one) == 128, "2048 keys over 3 nodes: a third of the records live on the other two"
        deadline = time.monotonic() + 15  # the owner publishes by its own view of the ring, a heartbeat behind the reader's
        while reader.batch_exists(far) != 128 or reader.batch_exists(one) != 128:
            if time.monotonic() > deadline:
                raise RuntimeError("the owner's pages are not visible from the reader in the 3-node ring")
            time.sleep(0.1)
        rows.append(measured("batch_exists, 128 keys (3 nodes: records on another, one round trip)", "batch_exists_128", one))
        rows.append(measured("batch_exists, 128 keys (3 nodes: records on both others, asked at once)", "batch_exists_128_two", far))
    finally:
        third.close()
    return rows


def _in_threads(fn, workers: list, items: list) -> None:
    share = -(-len(items) // len(workers))
    threads = [threading.Thread(target=fn, args=(w, items[i * share : (i + 1) * share])) for i, w in enumerate(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(args: argparse.Namespace) -> int:
    from kvdepot.peer import PeerStore

    reps = 3 if args.quick else args.reps
    total = (32 if args.quick else args.bytes_mib) * MiB
    sizes = [int(s) * 1024 for s in args.sizes_kib.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    pool_mb = max(total, 4 * max(sizes)) // MiB + 64
    node_options = {"port": 0, "data_port": 0, "metrics_port": 0, "pool_size_mb": pool_mb, "secret": args.secret, "heartbeat_interval_s": 0.5, "member_ttl_s": 3.0}
    load_start = loadavg()
    owner = _Owner(node_options)
    rows: list[Row] = []
    raw: dict = {"load_start": load_start, "reps": reps, "bytes_per_rep": total}
    try:
        with PeerStore(discovery=owner.node_id, **node_options) as reader:
            _wait_members(reader, 2)
            rtt = _raw_rtt(owner.raw_port)
            zrtt = _raw_zmq_rtt()
            raw["raw_rtt_s"], raw["raw_zmq_rtt_s"] = rtt, zrtt
            rows.append(Row("raw TCP round trip (loopback, 1 byte)", f"{rtt * 1e6:.0f} µs", "—", "1.00"))
            rows.append(Row("raw ZeroMQ round trip (tcp, the control plane's transport)", f"{zrtt * 1e6:.0f} µs", "—", "1.00"))
            for size in sizes:
                rows += _bench_size(reader, owner, size, total, threads, reps, raw)
            rows += _exists_rows(reader, owner, node_options, reps, rtt, raw)
    finally:
        owner.close()
    if args.ttft:
        rows += _cross_node_ttft(args.ttft_tokens, 2 if args.quick else 3, raw)
    raw["load_end"] = loadavg()
    _print(rows, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "raw": raw}, f, indent=2)
    return 0


def _cross_node_ttft(tokens: int, prompts: int, raw: dict) -> list[Row]:
    """Engine A (vLLM, bf16) computes each prompt cold against server A; engine B, a fresh process on
    server B, serves it with the prefix pulled through the peer tier. Medians of ``prompts`` prompts."""
    import tempfile
    from pathlib import Path

    from kvdepot.bench.engines.vllm_engines import BLOCK, Engine, ModelShape, connector_config, make_prompts, make_tiny_model
    from kvdepot.bench.serverproc import ServerProcess, free_port

    work = Path(tempfile.mkdtemp(prefix="kvdepot-bench-peer-ttft-"))
    model = make_tiny_model(work / "model", ModelShape(layers=8, hidden=1024, heads=8, kv_heads=4, max_positions=2 * tokens))
    head = free_port()
    fast = "metrics_port=0,heartbeat_interval_s=0.5,member_ttl_s=3,pool_size_mb=1024,secret=bench"

    def server(name: str, spec: str) -> ServerProcess:
        return ServerProcess(args=["--chunk-size", str(BLOCK), "--l1-size-gb", "2", "--log-level", "warning", "--l2", spec],
                             http_port=free_port(), env={"OMP_NUM_THREADS": "1"}, log_path=str(work / f"{name}.log")).start(60)  # fmt: skip

    a = server("a", f"peer:name=peers,port={head},data_port=0,{fast}")
    b = server("b", f"peer:name=peers,port={free_port()},data_port=0,discovery=127.0.0.1:{head},{fast}")
    todo = make_prompts(seed=4242, lengths=[tokens] * prompts)
    try:
        kw = {"max_model_len": 2 * tokens, "llm_kwargs": {"max_num_batched_tokens": 2 * tokens}, "kvcache_gb": 2, "dtype": "bfloat16"}
        with Engine(model, connector_config(a.url), work, name="engine-a", **kw) as engine:
            engine.one(make_prompts(seed=1, lengths=[BLOCK - 28])[0], 2)  # warm-up
            cold = [engine.one(p, 4) for p in todo]
        time.sleep(2.0)  # A's store controller pushes the chunks into its pool
        with Engine(model, connector_config(b.url), work, name="engine-b", **kw) as engine:
            engine.one(make_prompts(seed=2, lengths=[BLOCK - 28])[0], 2)
            hit = [engine.one(p, 4) for p in todo]
    finally:
        a.stop()
        b.stop()
    hits = [h["num_cached_tokens"] for h in hit]
    cold_s = statistics.median(c["ttft_s"] or c["seconds"] for c in cold)
    hit_s = statistics.median(h["ttft_s"] or h["seconds"] for h in hit)
    raw["ttft"] = {"tokens": tokens, "cold_s": [c["ttft_s"] for c in cold], "hit_s": [h["ttft_s"] for h in hit], "hit_tokens": hits}
    return [Row(f"cross-node vLLM TTFT, {tokens} tokens bf16 (hit {min(hits)}-{max(hits)} tokens via the peer tier)",
                f"{hit_s:.3f} s", f"{cold_s:.3f} s cold", f"{hit_s / cold_s:.2f}")]  # fmt: skip


def _wait_members(store, n: int, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(store.status()["members"]) < n:
        if time.monotonic() > deadline:
            raise RuntimeError("the reader did not join the owner")
        time.sleep(0.1)


def _bench_size(reader, owner: _Owner, size: int, total: int, threads: list[int], reps: int, raw: dict) -> list[Row]:
    count = max(4, total // size)
    owner.command("clear")
    assert owner.command(f"set p {count} {size}")["stored"] == count
    names = [f"p{i}" for i in range(count)]
    dests = [np.empty(size, np.uint8) for _ in range(count)]
    views = [memoryview(d) for d in dests]
    nbytes = count * size
    label = f"{size // 1024} KiB" if size < MiB else f"{size // MiB} MiB"
    rows = []
    per_batch = max(1, min(16, (8 * MiB) // size))  # what one engine request asks for at once, about

    def peer_get(names_views: list[tuple[str, memoryview]]) -> None:
        for i in range(0, len(names_views), per_batch):
            part = names_views[i : i + per_batch]
            got = reader.batch_get_into([n for n, _ in part], [v for _, v in part])
            if not all(got):
                raise RuntimeError(f"a remote get missed ({got.count(False)} of {len(got)})")

    pairs = list(zip(names, views, strict=True))
    peer_get(pairs)  # warm: connections made, pages touched
    # Checked once, untimed: the pages a get delivered are the owner's (``all(got)`` says only that it
    # answered), into zeroed buffers, before the raw socket's reads overwrite the same ones.
    for d in dests:
        d.fill(0)
    peer_get(pairs)
    payload = np.frombuffer(np.random.default_rng(1).bytes(PAYLOAD_BYTES), np.uint8)  # as the owner made it
    for i, d in enumerate(dests):
        off = _page_offset(i, size)
        assert np.array_equal(d, payload[off : off + size]), f"remote get of page {i} ({label}): bytes differ from the owner's"
    del payload
    for t in threads:
        conns = _raw_connections(owner.raw_port, t)
        _raw_read(conns, views, per_batch)  # warm, as the data plane's pooled connections are
        raw_cpu, again_cpu = _CpuMeter(owner.proc.pid), _CpuMeter(owner.proc.pid)
        raw_cpu.start()
        raw_times = [_raw_read(conns, views, per_batch) for _ in range(reps)]
        raw_cpu.stop()
        raw_s = statistics.median(raw_times)
        for c in conns:
            c.close()
        # First reads (the directory asked for every page) and reads again (where the reader found
        # them moments ago: no directory round), alternating so that drift moves both.
        cold, warm = [], []
        for _ in range(reps):
            reader.node.located.clear()
            cold.append(_timed_threads(peer_get, pairs, t))
            again_cpu.start()
            warm.append(_timed_threads(peer_get, pairs, t))
            again_cpu.stop()
        raw_gbps = nbytes / raw_s / 1e9
        cold_gbps, warm_gbps = nbytes / statistics.median(cold) / 1e9, nbytes / statistics.median(warm) / 1e9
        moved_gb = reps * nbytes / 1e9
        cpu = {"raw_owner": raw_cpu.owner / moved_gb, "raw_reader": raw_cpu.reader / moved_gb,
               "owner": again_cpu.owner / moved_gb, "reader": again_cpu.reader / moved_gb}  # fmt: skip
        raw[f"{label}_{t}t"] = {"raw_gbps": raw_gbps, "peer_gbps": cold_gbps, "peer_again_gbps": warm_gbps, "cpu_s_per_gb": cpu}
        threads_label = f"{t} thread{'s' if t > 1 else ''}"
        rows.append(Row(f"remote get {label} pages, {threads_label}", f"{cold_gbps:.2f} GB/s",
                        f"{raw_gbps:.2f} GB/s raw socket", f"{cold_gbps / raw_gbps:.2f}"))  # fmt: skip
        rows.append(Row(f"remote get {label} pages, {threads_label}, read again", f"{warm_gbps:.2f} GB/s",
                        f"{raw_gbps:.2f} GB/s raw socket", f"{warm_gbps / raw_gbps:.2f}"))  # fmt: skip
        # What a GB costs in CPU, both ends: where the cores are all busy (two cores, an owner and a
        # reader on one host), throughput is the cores over this.
        ours, theirs = cpu["owner"] + cpu["reader"], cpu["raw_owner"] + cpu["raw_reader"]
        rows.append(Row(f"CPU per GB read again, {label} pages, {threads_label} (owner + reader)",
                        f"{ours:.3f} core-s ({cpu['owner']:.3f} + {cpu['reader']:.3f})",
                        f"{theirs:.3f} core-s raw ({cpu['raw_owner']:.3f} + {cpu['raw_reader']:.3f})", f"{ours / theirs:.2f}"))  # fmt: skip
    src = [np.random.default_rng(i).integers(0, 255, size, dtype=np.uint8) for i in range(min(count, 64))]
    set_names = [f"s{i}" for i in range(len(src))]
    set_s = statistics.median([_timed(lambda: reader.batch_set(set_names, src)) for _ in range(reps)])
    copy_s = memcpy_seconds(len(src) * size)
    set_gbps, copy_gbps = len(src) * size / set_s / 1e9, len(src) * size / copy_s / 1e9
    raw[f"{label}_set"] = {"set_gbps": set_gbps, "memcpy_gbps": copy_gbps}
    rows.append(Row(f"set {label} pages (copy into the pool + publish)", f"{set_gbps:.2f} GB/s", f"{copy_gbps:.2f} GB/s memcpy", f"{set_gbps / copy_gbps:.2f}"))
    reader.clear()
    return rows


def _cpu_seconds(pid: int) -> float:
    """CPU time every thread of ``pid`` has run so far (nanosecond counters of the scheduler; the
    /proc/PID/stat ticks are 10 ms, too coarse for a repetition of tens of ms)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended meanwhile (its time goes with it: a thread per call is not ours)
    return total / 1e9


class _CpuMeter:
    """Core-seconds this process and the owner's spent between ``start`` and ``stop``."""

    def __init__(self, owner_pid: int) -> None:
        self.owner_pid = owner_pid
        self.reader = self.owner = 0.0

    def start(self) -> None:
        self._t0 = (time.process_time(), _cpu_seconds(self.owner_pid))

    def stop(self) -> None:
        self.reader += time.process_time() - self._t0[0]
        self.owner += _cpu_seconds(self.owner_pid) - self._t0[1]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_threads(fn, pairs: list, threads: int) -> float:
    if threads == 1:
        return _timed(lambda: fn(pairs))
    share = -(-len(pairs) // threads)
    ts = [threading.Thread(target=fn, args=(pairs[i * share : (i + 1) * share],)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def _print(rows: list[Row], raw: dict) -> None:
    print(f"# kvdepot bench peer: load {raw['load_start']} -> {raw['load_end']}; medians of {raw['reps']}; {os.cpu_count()} CPUs")
    widths = [max(len(getattr(r, f)) for r in rows) for f in ("metric", "value", "limit", "ratio")]
    heads = ("metric", "kvdepot", "limit (same run)", "ratio")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(v.ljust(w) for v, w in zip((r.metric, r.value, r.limit, r.ratio), widths, strict=True)) + " |")


if __name__ == "__main__":
    sys.exit(_owner(json.loads(sys.argv[1])))
