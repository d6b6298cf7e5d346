"""vLLM time-to-first-token with and without an external KV cache: no connector, kvdepot, LMCache.

One run, one random-weight Llama and one set of prompts, three configurations, each with its own fresh
engine in a subprocess:

  (a) none     vLLM alone
  (b) kvdepot  a ``kvdepot server`` (kvdepot.bench.serverproc.ServerProcess) + KVDepotConnector
  (c) lmcache  LMCache 0.5.6's multiprocess server + vLLM's LMCacheMPConnector (a benchmark peer only,
               never a kvdepot dependency: its server runs in its own virtual environment under
               ~/.cache/kvdepot-bench/lmcache-venv, its connector is put on the engine's PYTHONPATH
               from ~/.cache/kvdepot-bench/lmcache-connector; both are made on first use)

Workloads (requests go one at a time, greedy, a few output tokens):

  doc QA  documents of 4k-8k tokens, each asked several questions (doc + question)
  chat    a shared system prompt, users whose histories grow round by round

vLLM's own prefix cache is reset before every request in every configuration (the "engine's local
cache no longer holds it" case that an external cache is for): a hit can only come from the connector,
and configuration (a) recomputes everything. A *miss* is a request's first sight of its document or
history (QA question 1, chat round 1), a *hit* every later request.

The floor (``--floor N``, on by default): in one engine with kvdepot, N fresh documents, each asked
once cold, then again served by vLLM's *own* prefix cache (no reset), and again after a reset, served by
kvdepot: the two hits of the same prompt, in alternating order, so drift hits both alike. A kvdepot hit
can cost no less than vLLM's own; the table gives their ratio, the connector's load split (from its INFO
lines: the server's answer, the copy into vLLM's blocks) and the load's effective bandwidth next to a
memcpy of the same bytes measured in the same run.

The miss path (``--miss N``): two engines side by side, one with no connector and one through kvdepot,
each fresh prompt (never seen by either) sent to both, alternating which goes first, until the 95 %
interval of the median per-prompt ratio is within ``--miss-target`` each side: what a miss costs
(the lookup, then the save of the prompt's KV) against not having a connector at all.

    .venv/bin/python benchmarks/vllm_ttft.py [--quick] [--configs none,kvdepot,lmcache] [--floor N] [--miss N] [--json out.json]

Needs vLLM (scripts/install-vllm.sh). Times are those of a shared CPU machine: the load average at the
start and the end is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# The engine harness is the e2e tests' (kvdepot.bench.engines.vllm_engines): the same worker, model and environment.
from kvdepot.bench.engines.vllm_engines import Engine, ModelShape, TinyModel, connector_config, interrupt_group, make_tiny_model, words
from kvdepot.bench.serverproc import ServerProcess, free_port
from kvdepot.bench.stats import memcpy_seconds

CHUNK = 256  # tokens per chunk, kvdepot and LMCache alike (a multiple of vLLM's CPU block size, 128)
MODEL_NAME = "kvdepot-bench-llama"
MAX_TOKENS = 8

BENCH_CACHE = Path.home() / ".cache" / "kvdepot-bench"
LMCACHE_VENV = BENCH_CACHE / "lmcache-venv"
LMCACHE_TARGET = BENCH_CACHE / "lmcache-connector"
LMCACHE_VERSION = "0.5.6"
LMCACHE_SERVER_DEPS = [
    "numpy<=2.2.6", "numba", "py-cpuinfo", "psutil", "aiohttp", "requests", "sortedcontainers",
    "prometheus_client>=0.18.0,<=0.24.1", "cachetools", "pyyaml", "cryptography", "msgspec",
    "opentelemetry-api==1.40.0", "opentelemetry-sdk==1.40.0", "opentelemetry-exporter-prometheus==0.61b0",
    "pyzmq>=25", "httpx", "blake3",
]  # fmt: skip


@dataclass(frozen=True)
class Scale:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    doc_lengths: tuple[int, ...]  # document lengths (whole chunks); a QA prompt is a document + a question
    questions: int
    question_len: int
    system_len: int
    users: int
    rounds: int
    user_msg_len: int
    max_model_len: int

    @property
    def shape(self) -> ModelShape:
        return ModelShape(self.layers, self.hidden, self.heads, self.kv_heads, self.max_model_len)


FULL = Scale(8, 1024, 8, 4, (4096, 6144), 3, 32, 1024, 2, 3, 256, 8192)
QUICK = Scale(4, 512, 8, 4, (1024, 2048), 3, 32, 512, 2, 3, 128, 4096)


# --- LMCache (a benchmark peer) -------------------------------------------------------------------------


def _pip(python: str, *args: str, log) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", *args], check=True, stdout=log, stderr=subprocess.STDOUT)


def ensure_lmcache(log_path: Path) -> None:
    """LMCache's server venv and its connector's --target dir, made once and reused. Its wheel declares
    CUDA dependencies, hence --no-deps and the explicit list."""
    with open(log_path, "ab") as log:
        server_py = LMCACHE_VENV / "bin" / "python"
        ok = server_py.exists() and subprocess.run(
            [str(server_py), "-c", "import lmcache.v1.multiprocess.server, torch"], stdout=log, stderr=subprocess.STDOUT
        ).returncode == 0
        if not ok:
            if not server_py.exists():
                subprocess.run(["python3", "-m", "venv", str(LMCACHE_VENV)], check=True, stdout=log, stderr=subprocess.STDOUT)
            _pip(str(server_py), "torch==2.13.0", log=log)
            _pip(str(server_py), "--no-deps", f"lmcache=={LMCACHE_VERSION}", log=log)
            _pip(str(server_py), *LMCACHE_SERVER_DEPS, log=log)
        if not (LMCACHE_TARGET / "lmcache").is_dir() or not (LMCACHE_TARGET / "sortedcontainers").is_dir():
            _pip(sys.executable, "--no-deps", "--target", str(LMCACHE_TARGET), f"lmcache=={LMCACHE_VERSION}", "sortedcontainers", log=log)
        # vLLM must still import, and find the connector, with the target dir on its path.
        check = (
            "import vllm, lmcache; "
            "from vllm.distributed.kv_transfer.kv_connector.v1 import lmcache_mp_connector as m; "
            "print('lmcache', lmcache.__file__, m.LMCacheMPConnector)"
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(LMCACHE_TARGET), os.environ.get("PYTHONPATH")])))
        subprocess.run([sys.executable, "-c", check], check=True, env=env, stdout=log, stderr=subprocess.STDOUT)


@dataclass
class LMCacheServer:
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120.0) -> LMCacheServer:
        cmd = [
            str(LMCACHE_VENV / "bin" / "python"), "-m", "lmcache.v1.multiprocess.server",
            "--host", "127.0.0.1", "--port", str(self.port), "--chunk-size", str(CHUNK),
            "--l1-size-gb", "2", "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
        ]  # fmt: skip
        log = open(self.log_path, "ab")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    time.sleep(1.0)  # bound; let it finish setting up
                    return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"LMCache server not listening in {timeout_s}s")

    def stop(self) -> None:
        interrupt_group(self.proc, grace_s=20)


# --- workloads ------------------------------------------------------------------------------------------


@dataclass
class Record:
    workload: str
    kind: str  # "miss" | "hit" | "warmup"
    tag: str
    prompt_len: int
    ttft_s: float
    seconds: float
    cached: int
    out: list[int]


def kvdepot_server(wd: Path) -> ServerProcess:
    """A started kvdepot server for one configuration: the benchmark's chunk size, a 2 GiB L1, its log in ``wd``."""
    return ServerProcess(
        args=["--chunk-size", str(CHUNK), "--l1-size-gb", "2", "--log-level", "warning"],
        http_port=free_port(), env={"OMP_NUM_THREADS": "1"}, log_path=str(wd / "kvdepot-server.log"),
    ).start()  # fmt: skip


def warm_up(engine: Engine, s: Scale) -> None:
    """One-time costs (allocations, kernel set-up) out of the timings: prompts of every size class,
    of words used nowhere else (they are stored by a connector, and never asked again)."""
    rng = random.Random(777)
    for n in (200, max(s.doc_lengths), s.doc_lengths[0], 600):
        engine.one(words(rng, n), 2)


def run_workloads(engine: Engine, s: Scale, rep: int = 0) -> list[Record]:
    recs: list[Record] = []

    def rec(workload: str, kind: str, tag: str, prompt: list[int]) -> list[int]:
        o = engine.one(prompt, MAX_TOKENS)
        ttft = o["ttft_s"] if o["ttft_s"] else o["seconds"]
        recs.append(Record(workload, kind, f"r{rep}/{tag}", len(prompt), ttft, o["seconds"], o["num_cached_tokens"], o["token_ids"]))
        return o["token_ids"]

    # Doc QA: question q of every document, then question q+1 of every document, ...
    rng = random.Random(1 + 1000 * rep)
    docs = [words(rng, n) for n in s.doc_lengths]
    questions = [[words(rng, s.question_len) for _ in range(s.questions)] for _ in docs]
    for q in range(s.questions):
        for d, doc in enumerate(docs):
            rec("qa", "miss" if q == 0 else "hit", f"doc{d}({len(doc)})/q{q}", doc + questions[d][q])

    # Chat: round r of every user, then round r+1; a history is the system prompt, then the user's
    # messages each followed by the answer the engine gave.
    rng = random.Random(2 + 1000 * rep)
    system = words(rng, s.system_len)
    histories = [list(system) for _ in range(s.users)]
    for r in range(s.rounds):
        for u in range(s.users):
            histories[u] += words(rng, s.user_msg_len)
            answer = rec("chat", "miss" if r == 0 else "hit", f"user{u}/round{r}", histories[u])
            histories[u] += answer
    return recs


SAVE_LINE = re.compile(r"kvdepot: \S+ saved \d+ chunks \([\d.]+ MiB\) in ([\d.]+) ms")
LOAD_LINE = re.compile(  # the vLLM worker's INFO line for each load
    r"kvdepot: \S+ loaded (\d+) chunks \(([\d.]+) MiB\) in ([\d.]+) ms: retrieve ([\d.]+) ms, copy into blocks ([\d.]+) ms"
)


@dataclass
class FloorRecord:
    doc: int
    kind: str  # "cold" | "own" (vLLM's prefix cache) | "kvdepot"
    prompt_len: int
    ttft_s: float
    cached: int
    out: list[int]
    load_ms: float = 0.0  # the connector's load (kvdepot hits): total, the server's answer, the copy
    retrieve_ms: float = 0.0
    copy_ms: float = 0.0
    loaded_mib: float = 0.0


def run_floor(model: TinyModel, s: Scale, work: Path, docs: int, layerwise: bool = False, dtype: str = "float32",
              copy_threads: int = 0) -> list[FloorRecord]:  # fmt: skip
    """kvdepot hit vs vLLM's own prefix-cache hit of the same prompt, in one engine, interleaved.
    ``layerwise``: the connector's layerwise loads (layer N+1 copied while layer N computes)."""
    wd = work / "floor"
    wd.mkdir(parents=True, exist_ok=True)
    server = kvdepot_server(wd)
    engine = Engine(
        model, connector_config(server.url, chunk_size=CHUNK, model_name=MODEL_NAME, **({"layerwise": True} if layerwise else {}),
                                **({"copy_threads": copy_threads} if copy_threads else {})),
        wd, name="engine-floor", dtype=dtype,
        max_model_len=s.max_model_len, llm_kwargs={"max_num_batched_tokens": s.max_model_len}, kvcache_gb=2,
        env_extra={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    recs: list[FloorRecord] = []

    def rec(doc: int, kind: str, prompt: list[int]) -> None:
        start = engine.log_path.stat().st_size if engine.log_path.exists() else 0
        o = engine.one(prompt, MAX_TOKENS, reset_prefix_cache=kind != "own")
        r = FloorRecord(doc, kind, len(prompt), o["ttft_s"] or o["seconds"], o["num_cached_tokens"], o["token_ids"])
        time.sleep(0.05)  # the worker's log line is written before the step returns; let it reach the file
        with open(engine.log_path, "rb") as f:
            f.seek(start)
            for m in LOAD_LINE.finditer(f.read().decode(errors="replace")):
                r.loaded_mib += float(m[2])
                r.load_ms += float(m[3])
                r.retrieve_ms += float(m[4])
                r.copy_ms += float(m[5])
        recs.append(r)

    try:
        engine.start(timeout_s=600)
        warm_up(engine, s)
        rng = random.Random(4242)
        for d in range(docs):
            prompt = words(rng, s.doc_lengths[0]) + words(rng, s.question_len)
            rec(d, "cold", prompt)
            for kind in ("own", "kvdepot") if d % 2 == 0 else ("kvdepot", "own"):
                rec(d, kind, prompt)
    finally:
        engine.close()
        server.stop()
    return recs


def report_floor(recs: list[FloorRecord], dtype: str = "float32") -> dict:
    by = {k: [r for r in recs if r.kind == k] for k in ("cold", "own", "kvdepot")}
    # A kvdepot "hit" that brought fewer tokens than vLLM's own hit of the same document is no hit: it is
    # reported, and left out of the kvdepot figures (with its own-hit partner, so the pairs stay paired).
    own_of = {r.doc: r for r in by["own"]}
    short = [r for r in by["kvdepot"] if r.cached < own_of[r.doc].cached]
    if short:
        print(f"- kvdepot hits that brought less than vLLM's own (left out): "
              + ", ".join(f"doc{r.doc} {r.cached}/{own_of[r.doc].cached} tokens" for r in short))  # fmt: skip
        by["kvdepot"] = [r for r in by["kvdepot"] if r not in short]
        by["own"] = [own_of[r.doc] for r in by["kvdepot"]]
        if not by["kvdepot"]:
            print("- no kvdepot hit: no floor\n")
            return {"short_hits": len(short)}
    cold, own, kvd = (statistics.median(r.ttft_s for r in by[k]) for k in ("cold", "own", "kvdepot"))
    load = {k: statistics.median(getattr(r, k) for r in by["kvdepot"]) for k in ("load_ms", "retrieve_ms", "copy_ms", "loaded_mib")}
    nbytes = int(load["loaded_mib"] * 2**20)
    floor = memcpy_seconds(nbytes) if nbytes else 0.0
    extra = kvd - own
    same = sum(a.out == b.out for a, b in zip(by["own"], by["kvdepot"]))
    print(f"### the floor: a kvdepot hit vs vLLM's own prefix-cache hit of the same prompt ({len(by['cold'])} documents of "
          f"{by['cold'][0].prompt_len} tokens, {dtype}, same engine, alternating order)\n")  # fmt: skip
    print("| served by | TTFT p50 (ms) | / vLLM's own hit | tokens not computed |")
    print("|---|---:|---:|---:|")
    print(f"| nothing (cold) | {cold * 1e3:.0f} | {cold / own:.2f} | 0 |")
    print(f"| vLLM's own prefix cache | {own * 1e3:.0f} | 1.00 | {statistics.median(r.cached for r in by['own']):.0f} |")
    print(f"| kvdepot | {kvd * 1e3:.0f} | **{kvd / own:.2f}** (target <= 1.1) | {statistics.median(r.cached for r in by['kvdepot']):.0f} |")
    print()
    print(f"- kvdepot's load in the worker: {load['load_ms']:.1f} ms for {load['loaded_mib']:.1f} MiB: the server's answer "
          f"{load['retrieve_ms']:.1f} ms, the copy into vLLM's blocks {load['copy_ms']:.1f} ms; one memcpy of the same bytes "
          f"{floor * 1e3:.1f} ms (copy / memcpy {load['copy_ms'] / 1e3 / floor:.2f})" if floor else "- no load was logged")  # fmt: skip
    if floor and extra > 0:
        gbps = nbytes / extra / 1e9
        print(f"- a kvdepot hit costs {extra * 1e3:.0f} ms more than vLLM's own: {gbps:.2f} GB/s effective for the bytes it brings "
              f"= {extra and floor / extra:.2f} x memcpy (target >= 0.5); the load itself is "
              f"{load['load_ms'] / (extra * 1e3):.0%} of that")  # fmt: skip
    pairs = sorted(k.ttft_s / o.ttft_s for o, k in zip(by["own"], by["kvdepot"]))
    print(f"- per document, kvdepot's hit / vLLM's own: {', '.join(f'{x:.2f}' for x in pairs)} (median {statistics.median(pairs):.2f})")
    print(f"- the two hits gave the same greedy tokens in {same}/{len(by['own'])} documents\n")
    return {"cold_s": cold, "own_s": own, "kvdepot_s": kvd, "ratio": kvd / own, "memcpy_s": floor, "short_hits": len(short), **load}


@dataclass
class MissPair:
    pair: int
    prompt_len: int
    first: str  # which engine served this prompt first
    none_s: float  # TTFT without a connector
    kvdepot_s: float  # TTFT of the same prompt, a miss through kvdepot (lookup, then the save of its KV)
    kvdepot_cached: int
    control_s: float = 0.0  # a second engine without a connector (A/A): how far two alike engines differ
    save_ms: float = 0.0  # the connector's own save of this prompt, from its INFO line


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median: the order statistics x(k), x(n-k+1) with
    P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. The whole range when n is too small for one."""
    xs = sorted(xs)
    n = len(xs)
    tail, k = 0.0, 0
    while k < n // 2:
        nxt = tail + math.comb(n, k) / 2**n
        if nxt > (1 - confidence) / 2:
            break
        tail, k = nxt, k + 1
    return (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])


def run_miss(model: TinyModel, s: Scale, work: Path, min_pairs: int, max_pairs: int, target: float, dtype: str, control: bool = True) -> list[MissPair]:
    """The miss path against no connector: engines alive side by side (one without a connector, one
    through kvdepot and, with ``control``, a second without a connector), each fresh prompt sent to
    every one in a rotating order, until the 95 % interval of the median per-prompt ratio is narrower
    than ``target`` each side (or ``max_pairs``). The control says how far two alike engine processes
    differ: the resolution of the comparison on this host."""
    wd = work / "miss"
    wd.mkdir(parents=True, exist_ok=True)
    server = kvdepot_server(wd)
    # OMP_WAIT_POLICY=PASSIVE: a finished forward pass's OpenMP threads sleep rather than spin, so the
    # idle engine takes nothing from the one being timed (the same for both).
    env = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    configs = [("none", None), ("kvdepot", connector_config(server.url, chunk_size=CHUNK, model_name=MODEL_NAME)), ("control", None)]
    engines = {
        name: Engine(model, kv, wd, name=f"engine-miss-{name}", dtype=dtype, max_model_len=s.max_model_len,
                     llm_kwargs={"max_num_batched_tokens": s.max_model_len}, kvcache_gb=2, env_extra=env)
        for name, kv in configs[: 3 if control else 2]
    }  # fmt: skip
    names = list(engines)
    pairs: list[MissPair] = []
    try:
        for engine in engines.values():
            engine.start(timeout_s=600)
            warm_up(engine, s)
        rng = random.Random(9191)
        while len(pairs) < max_pairs:
            prompt = words(rng, s.doc_lengths[0]) + words(rng, s.question_len)
            k = len(pairs)
            order = names[k % len(names):] + names[: k % len(names)]  # each engine first in turn
            if (k // len(names)) % 2:
                order.reverse()  # and each engine before and after each other one
            start = engines["kvdepot"].log_path.stat().st_size if engines["kvdepot"].log_path.exists() else 0
            got = {name: engines[name].one(prompt, MAX_TOKENS) for name in order}
            ttft = {name: o["ttft_s"] or o["seconds"] for name, o in got.items()}
            time.sleep(0.05)  # the worker's log line is written before the step returns; let it reach the file
            with open(engines["kvdepot"].log_path, "rb") as f:
                f.seek(start)
                save_ms = sum(float(m[1]) for m in SAVE_LINE.finditer(f.read().decode(errors="replace")))
            pairs.append(MissPair(k, len(prompt), order[0], ttft["none"], ttft["kvdepot"], got["kvdepot"]["num_cached_tokens"],
                                  ttft.get("control", 0.0), save_ms))  # fmt: skip
            if len(pairs) >= max(min_pairs, 6):  # fewer than 6 have no 95 % interval for the median
                lo, hi = median_interval([p.kvdepot_s / p.none_s for p in pairs])
                print(f"  miss pair {len(pairs)}: ratio interval [{lo:.3f}, {hi:.3f}]", flush=True)
                if hi - lo <= 2 * target:
                    break
    finally:
        for engine in engines.values():
            engine.close()
        server.stop()
    return pairs


def report_miss(pairs: list[MissPair], target: float, dtype: str) -> dict:
    ratios = [p.kvdepot_s / p.none_s for p in pairs]
    med = statistics.median(ratios)
    lo, hi = median_interval(ratios)
    none_s, kvd_s = statistics.median(p.none_s for p in pairs), statistics.median(p.kvdepot_s for p in pairs)
    print(f"### the miss path: kvdepot against no connector, request by request ({len(pairs)} fresh prompts of "
          f"{pairs[0].prompt_len} tokens, {dtype}, the engines side by side, each prompt to each, rotating order)\n")  # fmt: skip
    print("| engine | TTFT p50 (ms) |")
    print("|---|---:|")
    print(f"| no connector | {none_s * 1e3:.0f} |")
    print(f"| kvdepot (a miss: lookup, then the save) | {kvd_s * 1e3:.0f} |")
    if all(p.control_s for p in pairs):
        print(f"| control: a second engine, no connector | {statistics.median(p.control_s for p in pairs) * 1e3:.0f} |")
    print()
    print(f"- per-prompt ratio kvdepot / none: median {med:.3f} = {100 * (med - 1):+.1f} % (target <= +{100 * target:.0f} %); "
          f"95 % interval of the median [{lo:.3f}, {hi:.3f}], spread {100 * (hi - lo) / 2:.1f} % each side; "
          f"quartiles {statistics.quantiles(ratios, n=4)[0]:.3f} / {statistics.quantiles(ratios, n=4)[2]:.3f}" if len(ratios) > 1 else "")  # fmt: skip
    if all(p.control_s for p in pairs):
        control = [p.control_s / p.none_s for p in pairs]
        clo, chi = median_interval(control)
        print(f"- control (a second engine without a connector) / none: median {statistics.median(control):.3f} "
              f"[{clo:.3f}, {chi:.3f}]: two alike engines differ this much here, so the kvdepot figure resolves no finer")  # fmt: skip
    saves = [p.save_ms for p in pairs if p.save_ms]
    if saves:
        print(f"- the connector's own save of each prompt (its INFO line, inside the kvdepot TTFT): median {statistics.median(saves):.1f} ms "
              f"= {statistics.median(saves) / 1e3 / kvd_s:.2%} of the kvdepot TTFT")  # fmt: skip
    found = sum(p.kvdepot_cached > 0 for p in pairs)
    print(f"- prompts where kvdepot found something (must be 0: every prompt is fresh): {found}\n")
    return {"median_ratio": med, "interval": [lo, hi], "none_s": none_s, "kvdepot_s": kvd_s, "pairs": len(pairs), "target": target}


def run_config(name: str, model: TinyModel, s: Scale, work: Path, repeats: int) -> list[Record]:
    wd = work / name
    wd.mkdir(parents=True, exist_ok=True)
    server = None
    env_extra: dict[str, str] = {}
    if name == "none":
        kv = None
    elif name == "kvdepot":
        server = kvdepot_server(wd)
        kv = connector_config(server.url, chunk_size=CHUNK, model_name=MODEL_NAME)
    elif name == "lmcache":
        ensure_lmcache(wd / "lmcache-install.log")
        port = free_port()
        server = LMCacheServer(port, wd / "lmcache-server.log").start()
        kv = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
        }
        env_extra["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LMCACHE_TARGET), os.environ.get("PYTHONPATH")]))
    else:
        raise ValueError(name)
    engine = Engine(
        model,
        kv,
        wd,
        name=f"engine-{name}",
        max_model_len=s.max_model_len,
        llm_kwargs={"max_num_batched_tokens": s.max_model_len},  # a whole prompt in one step
        kvcache_gb=2,
        env_extra={"OMP_NUM_THREADS": "1", **env_extra},  # one OpenMP thread outside the model runner
    )
    try:
        engine.start(timeout_s=600)
        warm_up(engine, s)
        return [r for rep in range(repeats) for r in run_workloads(engine, s, rep)]
    finally:
        engine.close()
        if server is not None:
            server.stop()


# --- report ---------------------------------------------------------------------------------------------


def p50(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def summarize(name: str, recs: list[Record]) -> dict:
    def sel(w: str, k: str) -> list[Record]:
        return [r for r in recs if r.workload == w and r.kind == k]

    tokens = sum(r.prompt_len + len(r.out) for r in recs)
    seconds = sum(r.seconds for r in recs)
    hits = [r for r in recs if r.kind == "hit"]
    # A "hit" request that found nothing in the connector was recomputed: not timed as a hit, but counted.
    return {
        "config": name,
        "qa_miss": p50([r.ttft_s for r in sel("qa", "miss")]),
        "qa_hit": p50([r.ttft_s for r in sel("qa", "hit") if r.cached > 0]),
        "chat_miss": p50([r.ttft_s for r in sel("chat", "miss")]),
        "chat_hit": p50([r.ttft_s for r in sel("chat", "hit") if r.cached > 0]),
        "hits_found_nothing": sum(r.cached == 0 for r in hits),
        "throughput": tokens / seconds if seconds else 0.0,
        "hit_tokens": sum(r.cached for r in hits),
        "hit_prompt_tokens": sum(r.prompt_len for r in hits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model and prompts (4 layers, hidden 512, 1-2k-token docs)")
    ap.add_argument("--configs", default="none,kvdepot,lmcache")
    ap.add_argument("--repeats", type=int, default=1, help="run the workloads this many times, with fresh prompts each time")
    ap.add_argument("--floor", type=int, default=4, help="documents for the kvdepot-hit vs vLLM's-own-hit comparison (0: none)")
    ap.add_argument("--floor-dtype", default="float32", help="the floor engine's dtype (default: %(default)s; users serve bfloat16)")
    ap.add_argument("--floor-copy-threads", type=int, default=0, help="the floor's connector option copy_threads (default: 0, its own choice)")
    ap.add_argument("--floor-layerwise", action="store_true", help="the floor's engine loads layer by layer (connector option layerwise)")
    ap.add_argument("--miss", type=int, default=0, metavar="N",
                    help="the miss path against no connector, request by request: at least N fresh prompts (0: none)")
    ap.add_argument("--miss-max", type=int, default=60, help="at most this many prompts for --miss (default: %(default)s)")
    ap.add_argument("--miss-target", type=float, default=0.02, help="--miss stops once the median's 95%% interval is within this each side")
    ap.add_argument("--miss-dtype", default="bfloat16", help="the dtype of the --miss engines (default: %(default)s, as users serve)")
    ap.add_argument("--json", help="write every request's record here")
    ap.add_argument("--workdir", help="keep logs here (default: a fresh temporary dir)")
    args = ap.parse_args()
    s = QUICK if args.quick else FULL
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kvdepot-vllm-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"workdir (logs): {work}", flush=True)
    load_start = os.getloadavg()
    t_start = time.monotonic()
    model = make_tiny_model(work / "model", s.shape)

    floor: list[FloorRecord] = []
    if args.floor:
        print(f"[{time.monotonic() - t_start:6.0f}s] floor ...", flush=True)
        floor = run_floor(model, s, work, args.floor, args.floor_layerwise, args.floor_dtype, args.floor_copy_threads)
        for r in floor:
            print(f"  doc{r.doc} {r.kind:7} len={r.prompt_len:5} cached={r.cached:5} ttft={1000 * r.ttft_s:7.0f} ms "
                  f"load={r.load_ms:6.1f} ms", flush=True)  # fmt: skip
    miss: list[MissPair] = []
    if args.miss:
        print(f"[{time.monotonic() - t_start:6.0f}s] miss ...", flush=True)
        miss = run_miss(model, s, work, args.miss, max(args.miss, args.miss_max), args.miss_target, args.miss_dtype)
        for r in miss:
            print(f"  pair{r.pair} first={r.first:7} none={1000 * r.none_s:7.0f} ms kvdepot={1000 * r.kvdepot_s:7.0f} ms "
                  f"({100 * (r.kvdepot_s / r.none_s - 1):+.1f} %) control={1000 * r.control_s:7.0f} ms save={r.save_ms:.1f} ms", flush=True)  # fmt: skip
    results: dict[str, list[Record] | str] = {}
    for name in [c for c in args.configs.split(",") if c]:
        print(f"[{time.monotonic() - t_start:6.0f}s] {name} ...", flush=True)
        try:
            results[name] = run_config(name, model, s, work, args.repeats)
        except Exception as exc:  # a peer that cannot run is reported, not fatal
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]
            print(f"  {name} failed: {exc!s:.3000}", flush=True)
            results[name] = f"not measured: {reason}"
        else:
            for r in results[name]:
                print(f"  {r.workload:4} {r.kind:4} {r.tag:22} len={r.prompt_len:5} cached={r.cached:5} ttft={1000 * r.ttft_s:7.0f} ms", flush=True)
    load_end = os.getloadavg()

    # --- the table
    label = "quick" if args.quick else "full"
    print()
    print(f"## vLLM TTFT ({label}: Llama {s.layers} layers, hidden {s.hidden}, {s.kv_heads} KV heads, fp32, CPU; "
          f"QA docs {list(s.doc_lengths)} tokens + {s.question_len}-token question x {s.questions} questions; chat system {s.system_len} + "
          f"{s.users} users x {s.rounds} rounds of {s.user_msg_len}; {MAX_TOKENS} output tokens, greedy; "
          f"vLLM prefix cache reset before every request; {args.repeats} repeat(s) with fresh prompts)")  # fmt: skip
    print()
    print("| config | QA miss TTFT p50 (ms) | QA hit TTFT p50 (ms) | chat miss TTFT p50 (ms) | chat hit TTFT p50 (ms) | throughput (tok/s) | hit tokens from connector |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    sums = {}
    for name, res in results.items():
        if isinstance(res, str):
            print(f"| {name} | {res} | | | | | |")
            continue
        sm = sums[name] = summarize(name, res)
        nothing = f" ({sm['hits_found_nothing']} hits found nothing: not in the hit columns)" if sm["hits_found_nothing"] else ""
        print(
            f"| {name} | {ms(sm['qa_miss'])} | {ms(sm['qa_hit'])} | {ms(sm['chat_miss'])} | {ms(sm['chat_hit'])} | "
            f"{sm['throughput']:.0f} | {sm['hit_tokens']}/{sm['hit_prompt_tokens']}{nothing} |"
        )
    print()
    floor_summary = report_floor(floor, args.floor_dtype) if floor else None
    miss_summary = report_miss(miss, args.miss_target, args.miss_dtype) if miss else None

    # --- targets
    first_len = s.doc_lengths[0]
    tag0 = f"/doc0({first_len})/"
    for name, res in results.items():
        if isinstance(res, str) or name == "none":
            continue
        cold = [r.ttft_s for r in res if tag0 in r.tag and r.kind == "miss"]
        hot = [r.ttft_s for r in res if tag0 in r.tag and r.kind == "hit" and r.cached > 0]
        if cold and hot:
            ratio = p50(hot) / p50(cold)
            target = " (target <= 0.15)" if first_len >= 4096 else ""
            print(f"- {name}: hit/cold TTFT p50 for the {first_len}-token document (+{s.question_len}-token question): {p50(hot) * 1000:.0f} / {p50(cold) * 1000:.0f} ms = {ratio:.3f}{target}")
    base = results.get("none")
    kvd = results.get("kvdepot")
    if isinstance(base, list) and isinstance(kvd, list):
        # true misses only: nothing came from the server (chat round 0 of a second user already
        # finds the shared system prompt there)
        b = {r.tag: r.ttft_s for r in base if r.kind == "miss"}
        k = {r.tag: r.ttft_s for r in kvd if r.kind == "miss" and r.cached == 0}
        common = sorted(set(b) & set(k))
        overhead = sum(k[t] for t in common) / sum(b[t] for t in common) - 1
        per = ", ".join(f"{t}: {100 * (k[t] / b[t] - 1):+.1f}%" for t in common)
        print(f"- kvdepot miss overhead vs no connector (sum of TTFTs of the requests that found nothing, {len(common)} of them): {100 * overhead:+.1f} % (target <= 3 %); per request: {per}")
    for name, res in results.items():
        if isinstance(res, list) and isinstance(base, list) and name != "none":
            same = sum(a.out == b.out for a, b in zip(res, base))
            print(f"- {name}: {same}/{len(res)} requests gave the same greedy tokens as no connector")
    print(f"- load average (1, 5, 15 min): start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}; "
          f"end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; {os.cpu_count()} CPUs; wall {time.monotonic() - t_start:.0f} s")  # fmt: skip

    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {n: (r if isinstance(r, str) else [vars(x) for x in r]) for n, r in results.items()}
                | {"summary": sums, "floor": [vars(r) for r in floor], "floor_summary": floor_summary}
                | {"miss": [vars(r) for r in miss], "miss_summary": miss_summary}
                | {"load_start": load_start, "load_end": load_end, "quick": args.quick},
                indent=1,
            )
        )


if __name__ == "__main__":  # vLLM spawns processes: everything runs under the main guard
    main()
